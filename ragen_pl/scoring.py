"""Scoring tokens a model sampled: per-token log-probs and entropy, with the LM head run only where needed.

Used by the update (old, new and reference log-probs), by SFT (cross-entropy on assistant tokens) and by the
collapse diagnostics. Prompts and env text need no logits: for a 0.5B Qwen the head is over a quarter of the model's
FLOPs, and (B, T, V) float32 logits are gigabytes, so only the positions of ``mask`` reach the head and the float32
log-softmax.

Log-probs are those of the distribution the tokens were sampled from: logits divided by the sampling temperature
(the batch carries it: :attr:`ragen_pl.types.TrajectoryBatch.temperature`).

Shared prefix: the rows of a micro-batch start with the same prompt tokens (the system prompt and the env's
instructions; a group's whole first prompt). :func:`forward_shared` runs that prefix once, for one row, and the rest
of every row on top of its keys and values, expanded to the batch: gradients flow back through the prefix as they
would through each row's copy, so losses and gradients are those of the plain forward (tests/test_scoring.py) for
about a third less compute on FrozenLake's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Scores", "entropy_from_logits", "forward_shared", "logprobs_from_logits", "score", "scored_logits",
           "restrict_to_kept", "shared_prefix_length", "shift_values", "can_share"]

#: A shared prefix shorter than this is not worth a second forward call.
MIN_SHARED_PREFIX = 16


def shared_prefix_length(ids: Tensor, mask: Tensor) -> int:
    """How many leading tokens every row of ``ids`` (B, T) shares and no position of ``mask`` needs logits or hidden
    states for: at most the first scored position minus one (its logits sit at the position before it)."""
    if ids.shape[0] < 2 or not bool(mask.any()):
        return 0
    same = (ids == ids[:1]).all(0)  # (T,)
    common = int(same.long().cumprod(0).sum())
    first_scored = int(mask.float().argmax(-1)[mask.any(-1)].min())
    return max(0, min(common, first_scored - 1))


def can_share(model: nn.Module) -> bool:
    """A transformers model that takes a KV cache: not gradient checkpointed (it refuses a cache in training), not
    sharded (an FSDP1 root expects one forward per backward)."""
    from ragen_pl.dist import is_sharded

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return False
    return not getattr(model, "is_gradient_checkpointing", False) and not is_sharded(model)


def forward_shared(model: nn.Module, ids: Tensor, attn: Tensor, prefix: int, **kwargs: Any) -> Any:
    """``model`` on (B, T) rows whose first ``prefix`` tokens are the same: the prefix once, then the rest of every
    row on its keys and values, expanded to the batch. The output covers positions ``prefix..T-1`` (a
    ``logits_to_keep`` tensor counts from there; ``hidden_states`` are (B, T - prefix, H))."""
    from transformers import DynamicCache

    B = ids.shape[0]
    cache = DynamicCache()
    head = {"logits_to_keep": 1} if "logits_to_keep" in kwargs else {}  # a causal LM: no logits needed here
    model(input_ids=ids[:1, :prefix], past_key_values=cache, use_cache=True, **head)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.expand(B, -1, -1, -1), layer.values.expand(B, -1, -1, -1)
    positions = torch.arange(prefix, ids.shape[1], device=ids.device).expand(B, -1)
    return model(input_ids=ids[:, prefix:], attention_mask=attn, position_ids=positions, past_key_values=cache,
                 use_cache=True, **kwargs)


def scored_logits(model: nn.Module, ids: Tensor, attn: Tensor, mask: Tensor, share_prefix: bool = False,
                  **kwargs: Any) -> tuple[Any, Tensor, Tensor]:
    """Forward ``model`` with its LM head run only where a token of ``mask`` is scored.

    With ``share_prefix`` (and a model that can), the rows' common prefix runs once (:func:`forward_shared`); the
    output then starts at the prefix's end. Returns the model output, the (N, V) logits scoring the N tokens of
    ``mask`` (row-major order, as ``mask[:, 1:]`` lists them) and those N token ids.
    """
    target = mask[:, 1:]  # (B, T-1): the logits at t-1 score token t
    cols = target.any(0).nonzero().squeeze(-1)  # positions some row scores
    prefix = shared_prefix_length(ids, mask) if share_prefix and can_share(model) else 0
    if prefix >= MIN_SHARED_PREFIX:
        out = forward_shared(model, ids, attn, prefix, logits_to_keep=cols - prefix, **kwargs)
    else:
        out = model(input_ids=ids, attention_mask=attn, logits_to_keep=cols, **{"use_cache": False, **kwargs})
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
        p = torch.softmax(z, -1)
        out.append(torch.logsumexp(z, -1) - torch.where(p > 0, p * z, 0.0).sum(-1))  # -inf logits (a kept set) add 0
    if not out:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(out).reshape(logits.shape[:-1])


def restrict_to_kept(logits: Tensor, kept: Tensor) -> Tensor:
    """(N, V) ``logits`` with every id outside each row's kept set (``kept`` (N, K), -1 padded) at -inf: the
    distribution a top-k / top-p sampler drew from. Rows without a kept set (all -1) stay whole."""
    has = (kept >= 0).any(-1)
    if not bool(has.any()):
        return logits
    # Padding points at the row's first kept id (a duplicate write of True): writing False for it instead could land
    # after a real id's True when that id is 0.
    index = torch.where(kept >= 0, kept, kept[:, :1]).clamp(min=0).long()
    allowed = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, index, True)
    allowed[~has] = True
    return logits.masked_fill(~allowed, float("-inf"))


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
          entropy: bool = False, hidden: bool = False, share_prefix: bool = False, kept: Tensor | None = None
          ) -> Scores:
    """Log-probs of ``ids`` at the positions of ``mask`` under ``model`` at ``temperature``; optionally the entropy
    there and the last hidden states (zeros on a shared prefix, where nothing is scored). With ``kept`` (B, T, K),
    each token is scored over the ids its sampler kept (the sampling-mask replay of top-k / top-p sampling). No
    (B, T, V) tensor is built."""
    kwargs = {"output_hidden_states": hidden} if hidden else {}
    out, logits, labels = scored_logits(model, ids, attn, mask, share_prefix=share_prefix, **kwargs)
    logits = logits / temperature  # (N, V)
    target = mask[:, 1:]
    if kept is not None:
        logits = restrict_to_kept(logits.float(), kept[:, 1:][target])
    states = None
    if hidden:
        states = out.hidden_states[-1]
        if states.shape[1] < ids.shape[1]:  # the prefix ran once: pad it back to (B, T, H)
            states = torch.cat([states.new_zeros(ids.shape[0], ids.shape[1] - states.shape[1], states.shape[2]),
                                states], 1)
    return Scores(logprobs=_spread(target, logprobs_from_logits(logits, labels)),
                  entropy=_spread(target, entropy_from_logits(logits)) if entropy else None, hidden=states)
