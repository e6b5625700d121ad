"""StarPO losses: the actor's surrogate (a :class:`PolicyLoss` plugin, PPO's clip by default), KL to a reference,
the clipped value loss.

Pure functions over token-aligned ``(B, T)`` tensors (see :mod:`ragen_pl.types`) with thin classes on top. Each
loss returns its scalar and a dict of detached diagnostics whose keys are the metric names the module logs.
:mod:`ragen_pl.update` calls the configured :class:`PolicyLoss` once per micro-batch, so a new objective (a
sequence-level ratio, another clip) is a new subclass, registered under the ``ragen_pl.policy_losses`` entry points,
not a branch inside the update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from ragen_pl.config import PPOConfig, check_choice
from ragen_pl.ops import masked_mean
from ragen_pl.types import KLEstimator, LossAgg

__all__ = [
    "PPOClip",
    "PolicyLoss",
    "aggregate",
    "kl_penalty",
    "policy_loss",
    "ppo_clip",
    "value_loss",
]

#: Bound on |log(p / p_old)| and |log(p / p_ref)| (verl's): exp(20) is large but finite.
LOG_RATIO_CLAMP = 20.0


def aggregate(loss: Tensor, mask: Tensor, mode: LossAgg = "token-mean") -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar over the tokens in ``mask``.

    ``token-mean``: mean over all valid tokens of the batch (long answers weigh more).
    ``seq-mean-token-sum``: sum over each sequence's tokens, mean over sequences (Dr. GRPO).
    ``seq-mean-token-mean``: mean inside each sequence, then mean over sequences (GRPO's original).
    Sequences without a valid token are left out of the sequence means.
    """
    check_choice("loss_agg", mode, LossAgg)
    m = mask.to(loss.dtype)
    loss = torch.where(mask, loss, 0.0)  # not loss * mask: nan * 0 is nan
    if mode == "token-mean":
        return loss.sum() / m.sum().clamp(min=1)
    has_tokens = mask.any(-1)
    per_seq = loss.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(-1).clamp(min=1)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate per token, with asymmetric clipping ("clip-higher", StarPO-S: 0.2 / 0.28).

    Per token: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = exp(logprobs - old_logprobs)``.
    With ``dual_clip = c > 1``, tokens with ``A < 0`` are bounded by ``-A c`` (dual-clip PPO).

    Returns:
        The (B, T) loss and diagnostics: ``loss/clipfrac_high`` (share of tokens whose gradient the upper bound cut
        off: ``A > 0`` and ``r > 1 + clip_high``), ``loss/clipfrac_low`` (``A < 0`` and ``r < 1 - clip_low``),
        ``loss/clipfrac_dual`` and ``loss/approx_kl`` (the k3 estimate of KL(old || new)).
    """
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
    return loss, metrics


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
    """:func:`ppo_clip` reduced to a scalar by :func:`aggregate`."""
    loss, metrics = ppo_clip(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip)
    return aggregate(loss, mask, agg), metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs (Schulman's estimators).

    ``k1 = log r`` (unbiased, can be negative), ``k2 = (log r)^2 / 2``, ``k3 = 1/r - 1 + log r`` with
    ``r = p / p_ref``, so ``log r = logprobs - ref_logprobs`` (``k3`` is unbiased and always >= 0). ``k3`` is
    clamped to [-10, 10] as in verl, since a single token can otherwise blow it up.
    """
    check_choice("kl_estimator", kind, KLEstimator)
    # The log-ratio is clamped to +-20 (verl's rule for k3): a -inf log-prob would otherwise give inf - inf = NaN.
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return torch.clamp(torch.exp(-log_ratio) - 1 + log_ratio, min=-10, max=10)


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
    unclipped = (values - returns) ** 2
    if clip is None:
        loss, clipped_frac = 0.5 * unclipped, torch.zeros((), device=values.device)
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (v_clipped - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped, clipped)
        clipped_frac = masked_mean((clipped > unclipped).float(), mask).detach()
    return aggregate(loss, mask, agg), {"loss/vf_clipfrac": clipped_frac}


class PolicyLoss(ABC):
    """Base class of actor objectives (entry-point group ``ragen_pl.policy_losses``).

    Called once per micro-batch with the new and old log-probs of its sampled tokens, their advantages and the
    update's settings (``ppo``: its clip range and loss aggregation, which an objective may use or replace).
    """

    @abstractmethod
    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, ppo: PPOConfig
                 ) -> tuple[Tensor, dict[str, Tensor]]:
        """The scalar loss over ``mask`` (all (B, T)) and its detached diagnostics (``loss/...`` keys)."""

    def aggregation(self, ppo: PPOConfig) -> LossAgg:
        """How this loss reduces tokens (the update weighs micro-batches by it so they add up to the mini-batch)."""
        return ppo.loss_agg


class PPOClip(PolicyLoss):
    """PPO's clipped surrogate with ``--model.ppo.clip_low / clip_high / dual_clip`` and ``loss_agg`` (StarPO)."""

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, ppo: PPOConfig
                 ) -> tuple[Tensor, dict[str, Tensor]]:
        return policy_loss(logprobs, old_logprobs, advantages, mask, ppo.clip_low, ppo.clip_high, ppo.dual_clip,
                           ppo.loss_agg)
