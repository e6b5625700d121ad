"""``ragen-pl export CKPT --out DIR``: the trained policy of a checkpoint as a Hugging Face folder.

The folder loads with ``AutoModelForCausalLM.from_pretrained`` and in vLLM. LoRA adapters are merged into the
weights. A checkpoint is a Lightning ``.ckpt`` file, or the folder of a sharded (FSDP, FSDP2) save, which is first
gathered into one state dict with ``torch.distributed.checkpoint`` (no process group needed).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ragen_pl.checkpoint import CheckpointError, load_checkpoint

POLICY = "policy."


def _read(ckpt: Path) -> dict[str, Any]:
    if not ckpt.is_dir():
        return load_checkpoint(ckpt)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        try:
            dcp_to_torch_save(ckpt, whole)
        except Exception as err:
            raise CheckpointError(f"checkpoint {ckpt} is not a readable sharded checkpoint: "
                                  f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
        state = torch.load(whole, map_location="cpu", weights_only=False)
    meta = ckpt / "meta.pt"  # Lightning keeps the hyperparameters of sharded FSDP1 saves here
    if "hyper_parameters" not in state and meta.is_file():
        state.update(torch.load(meta, map_location="cpu", weights_only=False))
    return state


def _policy_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    weights = state.get("state_dict", state.get("model", state))
    if not isinstance(weights, dict):
        raise CheckpointError("checkpoint holds no model state dict")
    policy = {k[len(POLICY):]: v for k, v in weights.items() if k.startswith(POLICY)}
    if not policy:
        raise CheckpointError("checkpoint holds no policy weights (no keys starting with 'policy.')")
    return policy


def export(ckpt: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the checkpoint's policy (LoRA merged) and tokenizer to ``out``; return ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.hooks import hooks_from_hparams
    from ragen_pl.models import resolve_model
    from ragen_pl.policy import merging

    ckpt, out = Path(ckpt), Path(out)
    state = _read(ckpt)
    hparams = state.get("hyper_parameters") or {}
    if "model" not in hparams:
        raise CheckpointError(f"checkpoint {ckpt} has no `model` hyperparameter: not a ragen-pl training checkpoint")
    base = resolve_model(hparams["model"])
    dtype = getattr(torch, hparams.get("dtype", "float32"))
    policy = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    lora = hparams.get("lora")
    if lora:
        from ragen_pl.config import lora_from_saved
        from ragen_pl.lora import add_lora

        policy = add_lora(policy, lora_from_saved(lora))
    tokenizer = AutoTokenizer.from_pretrained(base)
    hooks = hooks_from_hparams(hparams)
    for hook in hooks:
        policy = hook.after_load(policy, tokenizer)
    missing, unexpected = policy.load_state_dict(_policy_weights(state), strict=False)
    # Tied output embeddings may be absent from the saved keys; anything else missing is a wrong checkpoint.
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {ckpt} does not match {hparams['model']}: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    if lora:
        with merging(policy, hooks):
            policy = policy.merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


__all__ = ["export"]
