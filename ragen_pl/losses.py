"""StarPO losses: clipped policy loss, entropy, KL to a reference, clipped value loss.

Pure functions over token-aligned ``(B, T)`` tensors (see :mod:`ragen_pl.types`). Each loss returns its scalar and a
dict of detached diagnostics whose keys are the metric names the module logs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ragen_pl.advantages import masked_mean
from ragen_pl.types import KLEstimator, LossAgg

__all__ = [
    "aggregate",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "policy_loss",
    "value_loss",
]

#: Bound on |log(p / p_old)| and |log(p / p_ref)| (verl's): exp(20) is large but finite.
LOG_RATIO_CLAMP = 20.0

_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def aggregate(loss: Tensor, mask: Tensor, mode: LossAgg = "token-mean") -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar over the tokens in ``mask``.

    ``token-mean``: mean over all valid tokens of the batch (long answers weigh more).
    ``seq-mean-token-sum``: sum over each sequence's tokens, mean over sequences (Dr. GRPO).
    ``seq-mean-token-mean``: mean inside each sequence, then mean over sequences (GRPO's original).
    Sequences without a valid token are left out of the sequence means.
    """
    m = mask.to(loss.dtype)
    loss = torch.where(mask, loss, 0.0)  # not loss * mask: nan * 0 is nan
    if mode == "token-mean":
        return loss.sum() / m.sum().clamp(min=1)
    has_tokens = mask.any(-1)
    per_seq = loss.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(-1).clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"`loss_agg_mode` must be one of {', '.join(_AGGS)}, got {mode!r}")
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    agg: LossAgg = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clipping ("clip-higher", StarPO-S: 0.2 / 0.28).

    Per token: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = exp(logprobs - old_logprobs)``.
    With ``dual_clip = c > 1``, tokens with ``A < 0`` are bounded by ``-A c`` (dual-clip PPO).

    Returns:
        The loss and diagnostics: ``loss/clipfrac_high`` (share of tokens whose gradient the upper bound cut off:
        ``A > 0`` and ``r > 1 + clip_high``), ``loss/clipfrac_low`` (``A < 0`` and ``r < 1 - clip_low``),
        ``loss/clipfrac_dual`` and ``loss/approx_kl`` (the k3 estimate of KL(old || new)).
    """
    if not (0 <= clip_low < 1) or clip_high < 0:
        raise ValueError(f"`clip_low` must be in [0, 1) and `clip_high` >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"`dual_clip` must be > 1 (or None), got {dual_clip}")
    # Masked first: positions outside the mask may hold anything, even inf or nan.
    # Clamped as in verl: one token whose log-ratio is ~100 would otherwise make the ratio inf and the loss NaN.
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(mask)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    with torch.no_grad():
        metrics = {
            "loss/clipfrac_high": masked_mean(((advantages > 0) & (ratio > 1 + clip_high)).float(), mask),
            "loss/clipfrac_low": masked_mean(((advantages < 0) & (ratio < 1 - clip_low)).float(), mask),
            "loss/clipfrac_dual": masked_mean(dual.float(), mask),
            "loss/approx_kl": masked_mean(ratio - 1 - log_ratio, mask),
        }
    return aggregate(loss, mask, agg), metrics


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


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs (Schulman's estimators).

    ``k1 = log r`` (unbiased, can be negative), ``k2 = (log r)^2 / 2``, ``k3 = 1/r - 1 + log r`` with
    ``r = p / p_ref``, so ``log r = logprobs - ref_logprobs`` (``k3`` is unbiased and always >= 0). ``k3`` is
    clamped to [-10, 10] as in verl, since a single token can otherwise blow it up.
    """
    # The log-ratio is clamped to +-20 (verl's rule for k3): a -inf log-prob would otherwise give inf - inf = NaN.
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.clamp(torch.exp(-log_ratio) - 1 + log_ratio, min=-10, max=10)
    raise ValueError(f"`kl_estimator` must be one of k1, k2, k3, got {kind!r}")


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.5,
    agg: LossAgg = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss: ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``.

    Returns:
        The loss and diagnostics ``loss/vf_clipfrac`` (share of tokens where the clipped term is larger).
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"`value_clip` must be > 0 (or None to turn clipping off), got {clip}")
    unclipped = (values - returns) ** 2
    if clip is None:
        loss, clipped_frac = 0.5 * unclipped, torch.zeros((), device=values.device)
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (v_clipped - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped, clipped)
        clipped_frac = masked_mean((clipped > unclipped).float(), mask).detach()
    return aggregate(loss, mask, agg), {"loss/vf_clipfrac": clipped_frac}
