"""Scoring tokens a model sampled: per-token log-probs and entropy, with the LM head run only where needed.

Used by the update (old, new and reference log-probs), by SFT (cross-entropy on assistant tokens) and by the
collapse diagnostics. Prompts and env text need no logits: for a 0.5B Qwen the head is over a quarter of the model's
FLOPs, and (B, T, V) float32 logits are gigabytes, so only the positions of ``mask`` reach the head and the float32
log-softmax.

Log-probs are those of the distribution the tokens were sampled from: logits divided by the sampling temperature
(the batch carries it: :attr:`ragen_pl.types.TrajectoryBatch.temperature`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Scores", "entropy_from_logits", "logprobs_from_logits", "score", "scored_logits", "shift_values"]


def scored_logits(model: nn.Module, ids: Tensor, attn: Tensor, mask: Tensor, **kwargs: Any) -> tuple[Any, Tensor, Tensor]:
    """Forward ``model`` with its LM head run only where a token of ``mask`` is scored.

    Returns the model output, the (N, V) logits scoring the N tokens of ``mask`` (row-major order, as ``mask[:, 1:]``
    lists them) and those N token ids.
    """
    target = mask[:, 1:]  # (B, T-1): the logits at t-1 score token t
    cols = target.any(0).nonzero().squeeze(-1)  # positions some row scores
    out = model(input_ids=ids, attention_mask=attn, logits_to_keep=cols, **kwargs)
    keep = target[:, cols]
    return out, out.logits[keep], ids[:, 1:][:, cols][keep]


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``log softmax(logits)[labels]`` without materialising the full log-softmax. (..., V), (...) -> (...)."""
    logits = logits.float()
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last axis, (..., V) -> (...).

    ``H = logsumexp(z) - sum softmax(z) z``. Rows are processed ``chunk_size`` at a time, so the float32 softmax
    exists for one chunk only. Pass only the rows you need (the sampled tokens): the caller gathers them first.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for chunk in flat.split(chunk_size):
        z = chunk.float()
        out.append(torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1))
    if not out:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(out).reshape(logits.shape[:-1])


def shift_values(v: Tensor) -> Tensor:
    """(B, T) values read at each position, moved one to the right: ``values[:, t]`` is the value of the state
    *before* token t (the alignment of log-probs), and position 0 is 0."""
    return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1).float()


@dataclass
class Scores:
    logprobs: Tensor
    """(B, T) float32 log-prob of each token of ``mask`` (0 elsewhere)."""
    entropy: Tensor | None = None
    """(B, T) float32 entropy of the distribution each token of ``mask`` was drawn from (0 elsewhere)."""
    hidden: Tensor | None = None
    """(B, T, H) the last hidden states (for a value head on the policy's trunk)."""


def _spread(target: Tensor, values: Tensor) -> Tensor:
    """(N,) values of the true positions of ``target`` (B, T-1) -> (B, T), position 0 and the rest 0."""
    pad = torch.zeros_like(target[:, :1], dtype=values.dtype)
    return torch.cat([pad, torch.zeros_like(target, dtype=values.dtype).masked_scatter(target, values)], 1)


def score(model: nn.Module, ids: Tensor, attn: Tensor, mask: Tensor, temperature: float = 1.0,
          entropy: bool = False, hidden: bool = False) -> Scores:
    """Log-probs of ``ids`` at the positions of ``mask`` under ``model`` at ``temperature``; optionally the entropy
    there and the last hidden states. No (B, T, V) tensor is built."""
    out, logits, labels = scored_logits(model, ids, attn, mask, use_cache=False, output_hidden_states=hidden)
    logits = logits / temperature  # (N, V)
    target = mask[:, 1:]
    return Scores(logprobs=_spread(target, logprobs_from_logits(logits, labels)),
                  entropy=_spread(target, entropy_from_logits(logits)) if entropy else None,
                  hidden=out.hidden_states[-1] if hidden else None)
