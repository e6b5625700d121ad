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
    "GSPO",
    "PPOClip",
    "PolicyLoss",
    "aggregate",
    "gspo",
    "kl_penalty",
    "policy_loss",
    "ppo_clip",
    "value_loss",
]

#: Bound on |log(p / p_old)| and |log(p / p_ref)| (verl's): exp(20) is large but finite.
LOG_RATIO_CLAMP = 20.0


def aggregate(loss: Tensor, mask: Tensor, mode: LossAgg = "token-mean", norm: float = 1.0) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar over the tokens in ``mask``.

    ``token-mean``: mean over all valid tokens of the batch (long answers weigh more; DAPO).
    ``seq-mean-token-sum``: sum over each sequence's tokens, mean over sequences.
    ``seq-mean-token-sum-norm``: the same divided by the constant ``norm`` (Dr. GRPO: the generation budget, so no
    sequence's length rescales its tokens and the loss keeps a sane scale).
    ``seq-mean-token-mean``: mean inside each sequence, then mean over sequences (GRPO's original, GSPO).
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
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / norm
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
    norm: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`ppo_clip` reduced to a scalar by :func:`aggregate`."""
    loss, metrics = ppo_clip(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip)
    return aggregate(loss, mask, agg, norm), metrics


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
    norm: float = 1.0,
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
    return aggregate(loss, mask, agg, norm), {"loss/vf_clipfrac": clipped_frac}


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
                           ppo.loss_agg, ppo.loss_agg_norm)


def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO's clipped objective with a sequence-level ratio (Zheng et al. 2025, the GSPO-token form).

    Each sequence's ratio is the geometric mean of its tokens' ratios, ``s_i = exp(mean_t log(p / p_old))``. Token
    t uses ``s_it = sg(s_i) * p_t / sg(p_t)``: its value is ``s_i`` and its gradient that of ``s_i`` spread over the
    sequence's tokens, so with one advantage per sequence the gradient is GSPO's, and token-level advantages (GAE)
    also work. Per token ``max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high))``, averaged inside each sequence
    and then over sequences (GSPO's length normalisation).

    Returns:
        The loss and diagnostics: ``loss/clipfrac_high`` and ``loss/clipfrac_low`` (shares of *sequences* whose
        ratio the clip cut off, for their advantage's sign), ``loss/seq_ratio_mean`` and ``loss/approx_kl``.
    """
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    count = mask.sum(-1).clamp(min=1)
    seq_log_ratio = log_ratio.sum(-1) / count  # (B,)
    token_log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    with torch.no_grad():
        seq_ratio = seq_log_ratio.exp()
        has = mask.any(-1)
        seq_adv = torch.where(mask, advantages, 0.0).sum(-1) / count
        high = ((seq_adv > 0) & (seq_ratio > 1 + clip_high) & has).double().sum() / has.sum().clamp(min=1)
        low = ((seq_adv < 0) & (seq_ratio < 1 - clip_low) & has).double().sum() / has.sum().clamp(min=1)
        metrics = {"loss/clipfrac_high": high.float(), "loss/clipfrac_low": low.float(),
                   "loss/seq_ratio_mean": seq_ratio[has].mean() if bool(has.any()) else seq_ratio.new_ones(()),
                   "loss/approx_kl": masked_mean(log_ratio.exp() - 1 - log_ratio, mask)}
    return aggregate(loss, mask, "seq-mean-token-mean"), metrics


class GSPO(PolicyLoss):
    """GSPO: PPO's clip on a sequence-level ratio (the geometric mean of the token ratios), with its own, much
    smaller clip range (the paper's 3e-4 / 4e-4), each sequence's tokens averaged (``seq-mean-token-mean``)."""

    def __init__(self, clip_low: float = 3e-4, clip_high: float = 4e-4) -> None:
        """
        Args:
            clip_low: clip of the sequence ratio below 1.
            clip_high: clip of the sequence ratio above 1.
        """
        if not 0 <= clip_low < 1 or clip_high < 0:
            raise ValueError(f"`--model.policy_loss.clip_low` must be in [0, 1) and `clip_high` >= 0, got "
                             f"{clip_low}, {clip_high}")
        self.clip_low, self.clip_high = clip_low, clip_high

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, ppo: PPOConfig
                 ) -> tuple[Tensor, dict[str, Tensor]]:
        return gspo(logprobs, old_logprobs, advantages, mask, self.clip_low, self.clip_high)

    def aggregation(self, ppo: PPOConfig) -> LossAgg:
        return "seq-mean-token-mean"
