"""One StarPO update, without Lightning: score the rollout, compute advantages, then ``ppo_epochs`` passes of
mini-batch optimiser steps with gradient accumulation over micro-batches.

:class:`StarPOUpdate` works on a :class:`~ragen_pl.policy.Models` view (any modules with the transformers calling
convention: ``model(input_ids=, attention_mask=, logits_to_keep=, use_cache=, output_hidden_states=)``) and plain
torch optimisers, so a test can drive it with a two-layer torch model. :class:`ragen_pl.module.RagenModule` wires it
into Lightning (manual optimisation, logging, checkpoints).

Reading order: :meth:`StarPOUpdate.prepare` (old log-probs, values, reference log-probs, shaped rewards,
advantages) -> :meth:`StarPOUpdate.step` (mini-batches, micro-batches, clipping, optimiser steps) ->
:meth:`StarPOUpdate.micro_loss` (the actor's :class:`~ragen_pl.losses.PolicyLoss`, entropy, KL, the value loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ragen_pl.advantages import GAE, Advantage
from ragen_pl.config import PPOConfig
from ragen_pl.losses import PolicyLoss, PPOClip, aggregate, kl_penalty, value_loss
from ragen_pl.ops import last_true, masked_mean
from ragen_pl.policy import Models, clip_grad_norm
from ragen_pl.rewards import RewardNorm
from ragen_pl.scoring import Scores, score
from ragen_pl.types import ROW_FIELDS, TrajectoryBatch

__all__ = ["DEFAULT_ADVANTAGE", "DEFAULT_POLICY_LOSS", "MicroLoss", "StarPOUpdate", "entropy_metrics",
           "explained_variance", "micro_batches", "mis_rejected", "mismatch_metrics", "off_policy_correction", "trimmed"]

DEFAULT_ADVANTAGE: type[Advantage] = GAE
"""The estimator of a run that names none (the paper's PPO: token-level GAE, gamma = lambda = 1)."""
DEFAULT_POLICY_LOSS: type[PolicyLoss] = PPOClip
"""The actor's objective of a run that names none (PPO's clip with ``--model.ppo``'s clip range)."""


class MicroLoss(NamedTuple):
    """One micro-batch's share of a mini-batch update (:meth:`StarPOUpdate.micro_loss`)."""

    actor: Tensor
    """The actor's loss (with a shared value head's value loss), scaled to add up over the mini-batch."""
    critic: Tensor | None
    """A separate critic's scaled value loss; None without one."""
    metrics: dict[str, Tensor]
    """Detached loss terms and statistics, averaged over the update."""
    old_logprobs: Tensor
    """(n, T) the old log-probs the ratio used: the batch's, or this forward's own (detached) when the update
    scores the old policy itself (:meth:`StarPOUpdate.scores_old_policy_in_update`)."""


class StarPOUpdate:
    """The update's settings and state (the mini-batch shuffling generator, the count of skipped steps).

    An extension point (``--model.updater``, entry-point group ``ragen_pl.updates``): a subclass changes how the
    policy is scored (:meth:`score_policy`, called by :meth:`prepare` and each micro-batch of :meth:`step`) or adds
    work around :meth:`prepare`. It takes no constructor arguments of its own beyond these, which
    :class:`~ragen_pl.module.RagenModule` passes from ``--model.*``; settings of its own come as further keyword
    arguments with defaults.
    """

    def __init__(self, advantage: Advantage | None = None, ppo: PPOConfig | None = None,
                 reward_norm: RewardNorm | None = None, policy_loss: PolicyLoss | None = None, seed: int = 0) -> None:
        self.advantage = advantage if advantage is not None else DEFAULT_ADVANTAGE()
        self.ppo = ppo or PPOConfig()
        self.reward_norm = reward_norm or RewardNorm()
        self.policy_loss = policy_loss if policy_loss is not None else DEFAULT_POLICY_LOSS()
        self.shuffle = torch.Generator().manual_seed(seed)
        self.skipped_steps = 0
        self.positions = 0
        """Trunk positions the policy's forwards ran over in the current ``step`` (for FLOP counts)."""
        self.scored = 0
        """Tokens the policy scored in the current ``step``."""
        self.head_positions = 0
        """Positions the policy's LM head computed logits at in the current ``step`` (for FLOP counts)."""

    # ------------------------------------------------------------------------------------------- scoring
    def scores_old_policy_in_update(self, models: Models, n: int) -> bool:
        """Whether the update's own first forward gives the old log-probs, so ``prepare`` skips the policy pass.

        With one optimiser step per iteration (one epoch, one mini-batch) the weights do not change before every
        micro-batch has been scored, so the detached log-probs of the update's forward are exactly the sampling
        policy's (TRL's GRPO does the same with ``num_iterations=1``). Not when a shared value head needs that
        forward's values first, a KL reward needs the old log-probs before the advantages, or masked importance
        sampling takes rejected trajectories out of the loss mask before the steps (``mis_rejected=excluded``).
        """
        p = self.ppo
        excludes = p.mis_bound is not None and p.mis_rejected == "excluded"
        return (p.ppo_epochs == 1 and p.mini_batch_size >= n and models.value_head is None
                and not (p.kl_coeff > 0 and p.kl_mode == "reward") and not excludes)

    def score_policy(self, models: Models, part: TrajectoryBatch, rows: Tensor, *, entropy: bool = False,
                     hidden: bool = False) -> Scores:
        """The policy's scores of ``part``, the batch's ``rows`` cut to their longest row: the old log-probs in
        :meth:`prepare` (``entropy`` False, ``torch.no_grad``) and each micro-batch's in :meth:`step` (``entropy``
        True, with gradients). ``hidden``: also the last hidden states, for a value head on the policy's trunk."""
        return score(models.policy, part.input_ids, part.attention_mask, part.loss_mask, part.temperature,
                     entropy=entropy, hidden=hidden, share_prefix=self.ppo.share_prefix, kept=self.kept(part),
                     pack=self.ppo.pack)

    def _reference_logprobs(self, models: Models, ids: Tensor, attn: Tensor, mask: Tensor, temperature: float
                            ) -> Tensor:
        layout = {"share_prefix": self.ppo.share_prefix, "pack": self.ppo.pack}
        if models.reference is not None:
            return score(models.reference, ids, attn, mask, temperature, **layout).logprobs
        with models.policy.disable_adapter():  # LoRA: the base model is the reference
            return score(models.policy, ids, attn, mask, temperature, **layout).logprobs

    @torch.no_grad()
    def prepare(self, batch: TrajectoryBatch, models: Models) -> dict[str, Tensor]:
        """Fill old log-probs, values, reference log-probs, shaped rewards, advantages and returns in place.

        Old log-probs are left to the update when :meth:`scores_old_policy_in_update` holds.
        """
        score_policy = not self.scores_old_policy_in_update(models, len(batch))
        filled: dict[str, Tensor] = {}

        def fill(name: str, rows: Tensor, x: Tensor) -> None:  # x: (len(rows), T') with T' <= T
            if name not in filled:
                filled[name] = torch.zeros_like(batch.rewards, dtype=x.dtype)  # (B, T)
            filled[name][rows, :x.shape[1]] = x

        for idx in micro_batches(torch.arange(len(batch), device=batch.input_ids.device), batch.attention_mask,
                                 self.ppo.micro_batch_size):
            part = trimmed(batch.select(idx))
            ids, attn, mask = part.input_ids, part.attention_mask, part.loss_mask
            if score_policy:
                s = self.score_policy(models, part, idx, hidden=models.value_head is not None)
                fill("old_logprobs", idx, s.logprobs)
                if s.hidden is not None:
                    fill("values", idx, models.shared_values(s.hidden))
            if models.critic is not None:
                fill("values", idx, models.critic_values(ids, attn, mask, self.ppo.share_prefix, self.ppo.pack))
            if self.ppo.kl_coeff > 0:
                fill("ref_logprobs", idx, self._reference_logprobs(models, ids, attn, mask, batch.temperature))
        for name, x in filled.items():
            setattr(batch, name, x)
        metrics: dict[str, Tensor] = {}
        if self.reward_norm.method != "identity":
            self._normalise_rewards(batch)
        if self.ppo.kl_coeff > 0 and self.ppo.kl_mode == "reward":
            kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, self.ppo.kl_estimator)
            batch.rewards = batch.rewards - self.ppo.kl_coeff * torch.where(batch.loss_mask, kl, 0.0)
            metrics["loss/kl_reward"] = masked_mean(kl, batch.loss_mask)
        batch.advantages, batch.returns = self.advantage(batch)
        metrics.update(self.advantage.metrics())
        if batch.loss_scale != 1.0:  # a filter's kept share (RAGEN-2's loss scaling), applied as RAGEN-2 does
            batch.advantages = batch.advantages * batch.loss_scale
        metrics["adv/mean"] = masked_mean(batch.advantages, batch.loss_mask)
        metrics["adv/abs_mean"] = masked_mean(batch.advantages.abs(), batch.loss_mask)
        if batch.values is not None:
            metrics["critic/values_mean"] = masked_mean(batch.values, batch.loss_mask)
            metrics["critic/returns_mean"] = masked_mean(batch.returns, batch.loss_mask)
            metrics["critic/explained_variance"] = explained_variance(batch.values, batch.returns, batch.loss_mask)
        return metrics

    def _normalise_rewards(self, batch: TrajectoryBatch) -> None:
        """The normalised trajectory score replaces the token rewards, on the trajectory's last sampled token
        (RAGEN's rule); statistics count each trajectory once, whatever its number of rows."""
        stats = batch.stats()
        inverse, first = batch.trajectory_index()
        scores = self.reward_norm(stats.scores, stats.group_ids, [batch.env_tags[i] for i in first.tolist()])
        last_row = torch.zeros_like(first).scatter_reduce(0, inverse, torch.arange(len(batch), device=first.device),
                                                          reduce="amax", include_self=False)
        rewards = torch.zeros_like(batch.rewards)
        rewards[last_row, last_true(batch.loss_mask[last_row])] = scores.to(rewards.dtype)
        batch.rewards = torch.where(batch.loss_mask, rewards, 0.0)

    def kept(self, part: TrajectoryBatch) -> Tensor | None:
        """The sampler's kept sets of ``part`` (B, T, K), when they are replayed (``--model.ppo.replay_sampling_mask``)."""
        return part.sampling_masks if self.ppo.replay_sampling_mask else None

    # -------------------------------------------------------------------------------------------- update
    def loss_denominator(self, mask: Tensor) -> Tensor:
        """The denominator of the loss aggregation, over a whole mini-batch."""
        if self.policy_loss.aggregation(self.ppo) == "token-mean":
            return mask.sum().clamp(min=1)
        return mask.any(-1).sum().clamp(min=1)

    def micro_loss(self, part: TrajectoryBatch, models: Models, mini_count: Tensor,
                   rows: Tensor | None = None) -> MicroLoss:
        """Actor loss and critic loss of one micro-batch (``part``, the batch's ``rows``), scaled so that
        micro-batches add up to the mini-batch."""
        p = self.ppo
        part = trimmed(part)
        ids, attn, mask = part.input_ids, part.attention_mask, part.loss_mask
        scale = self.loss_denominator(mask) / mini_count
        rows = rows if rows is not None else torch.arange(len(part), device=ids.device)
        s = self.score_policy(models, part, rows, entropy=True, hidden=models.value_head is not None)
        # No old log-probs yet: this forward is the sampling policy's (see `scores_old_policy_in_update`).
        old = part.old_logprobs if part.old_logprobs is not None else s.logprobs.detach()
        mis = p.mis_bound if p.mis_rejected == "zero_advantage" else None  # (excluded: gone from the mask already)
        advantages, off_metrics = off_policy_correction(part.advantages, mask, old, part.rollout_logprobs, p.tis_cap,
                                                        mis)
        pg, metrics = self.policy_loss(s.logprobs, old, advantages, mask, p)
        metrics.update(off_metrics)
        self.positions += s.positions
        self.scored += s.scored
        self.head_positions += s.head_positions
        assert s.entropy is not None
        norm = p.loss_agg_norm or 1.0
        ent = aggregate(s.entropy, mask, p.loss_agg, norm)
        actor = pg - p.entropy_coeff * ent
        metrics["loss/policy"] = pg.detach()
        metrics["loss/entropy"] = ent.detach()
        if p.kl_coeff > 0 and p.kl_mode == "loss":
            kl = aggregate(kl_penalty(s.logprobs, part.ref_logprobs, p.kl_estimator), mask, p.loss_agg, norm)
            actor = actor + p.kl_coeff * kl
            metrics["loss/kl"] = kl.detach()
        critic = None
        if models.has_critic:
            values = (models.critic_values(ids, attn, mask, p.share_prefix, p.pack) if models.critic is not None
                      else models.shared_values(s.hidden))
            vf, vm = value_loss(values, part.values, part.returns, mask, p.value_clip, p.loss_agg, norm)
            metrics.update(vm)
            metrics["loss/value"] = vf.detach()
            if models.critic is None:
                actor = actor + p.vf_coeff * vf
            else:
                critic = vf * scale
        return MicroLoss(actor * scale, critic, metrics, old)

    def step(self, batch: TrajectoryBatch, models: Models, optimizers: list[torch.optim.Optimizer],
             backward: Callable[[Tensor], Any] = Tensor.backward) -> dict[str, Tensor]:
        """``ppo_epochs`` passes of mini-batch optimiser steps over ``batch`` (prepared). ``optimizers[0]`` holds the
        actor's parameters (and a shared value head's), ``optimizers[1]`` a separate critic's. A step whose gradient
        norm is not finite is skipped and counted. The last mini-batch's gradients stay on the parameters."""
        p = self.ppo
        self.positions = self.scored = self.head_positions = 0
        batch, rejected = self._without_rejected(batch)
        actor_params = [q for group in optimizers[0].param_groups for q in group["params"]]
        critic_params = [q for group in optimizers[1].param_groups for q in group["params"]] if len(optimizers) > 1 else []
        sums: dict[str, list[Tensor]] = {}
        n = len(batch)
        steps = 0
        scored: list[tuple[Tensor, Tensor]] = []  # (rows, old log-probs) when the update scores the old policy
        for _ in range(p.ppo_epochs):
            perm = torch.randperm(n, generator=self.shuffle).to(batch.input_ids.device)
            for start in range(0, n, p.mini_batch_size):
                idx = perm[start:start + p.mini_batch_size]
                mini_count = self.loss_denominator(batch.loss_mask[idx])
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                for micro in micro_batches(idx, batch.attention_mask, p.micro_batch_size):
                    loss = self.micro_loss(batch.select(micro), models, mini_count, rows=micro)
                    backward(loss.actor if loss.critic is None else loss.actor + loss.critic)
                    if batch.old_logprobs is None:
                        scored.append((micro, loss.old_logprobs))
                    for k, v in loss.metrics.items():
                        sums.setdefault(k, []).append(v)
                norms = [clip_grad_norm([models.policy, models.value_head], actor_params, p.grad_clip)]
                if critic_params:
                    norms.append(clip_grad_norm([models.critic], critic_params, p.grad_clip))
                sums.setdefault("actor/grad_norm", []).append(norms[0])
                if critic_params:
                    sums.setdefault("critic/grad_norm", []).append(norms[1])
                if not all(torch.isfinite(x) for x in norms):
                    # A non-finite loss or gradient never reaches the weights: drop this step and count it.
                    self.skipped_steps += 1
                    from lightning.pytorch.utilities import rank_zero_info

                    rank_zero_info(f"skipping an optimiser step with non-finite gradient norm {norms}")
                    for opt in optimizers:
                        opt.zero_grad(set_to_none=True)
                    continue
                for opt in optimizers:
                    opt.step()
                steps += 1
        if scored:  # kept for metrics and for a reused rollout's importance ratio
            batch.old_logprobs = torch.zeros_like(batch.rewards, dtype=torch.float32)
            for rows, lp in scored:
                batch.old_logprobs[rows, :lp.shape[1]] = lp.float()
        out = {k: torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in v]).nanmean() for k, v in sums.items()}
        if rejected is not None:
            out["offpolicy/masked_frac"] = rejected
        out["train/skipped_steps"] = torch.tensor(float(self.skipped_steps))
        out["throughput/update_positions"] = torch.tensor(float(self.positions))
        out["throughput/update_scored_tokens"] = torch.tensor(float(self.scored))
        out["throughput/update_head_positions"] = torch.tensor(float(self.head_positions))
        out["train/optimizer_steps"] = torch.tensor(float(steps))
        return out

    def _without_rejected(self, batch: TrajectoryBatch) -> tuple[TrajectoryBatch, Tensor | None]:
        """``batch`` with the trajectories masked importance sampling rejects taken out of the loss mask (verl's
        semantics, ``--model.ppo.mis_rejected=excluded``: out of every loss term and of the denominators), and the
        share rejected; ``batch`` itself otherwise. The advantages were computed before, on the whole batch."""
        p = self.ppo
        if p.mis_bound is None or p.mis_rejected != "excluded":
            return batch, None
        if batch.rollout_logprobs is None or batch.old_logprobs is None:
            raise ValueError("`--model.ppo.mis_bound` needs the rollout engine's log-probs in the batch")
        out = mis_rejected(batch.loss_mask, batch.old_logprobs, batch.rollout_logprobs, p.mis_bound)
        share = out.float().sum() / batch.loss_mask.any(-1).sum().clamp(min=1)
        return replace(batch, loss_mask=batch.loss_mask & ~out[:, None]), share

    # ---------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"shuffle": self.shuffle.get_state(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "shuffle" in state:
            self.shuffle.set_state(state["shuffle"])
        self.skipped_steps = state.get("skipped_steps", 0)


# ------------------------------------------------------------------------------------ off-policy correction
def mis_rejected(mask: Tensor, old_logprobs: Tensor, rollout_logprobs: Tensor, mis_bound: float) -> Tensor:
    """(B,) the trajectories masked importance sampling rejects: those whose geometric-mean ratio
    ``exp(mean_t log(p_old / p_sampler))`` lies outside ``[1/mis_bound, mis_bound]`` (verl's sequence-level "geometric"
    rejection)."""
    d = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).clamp(-20.0, 20.0).detach()
    seq = d.sum(-1) / mask.sum(-1).clamp(min=1)  # mean log-ratio per trajectory
    return (seq.abs() > math.log(mis_bound)) & mask.any(-1)


def off_policy_correction(advantages: Tensor, mask: Tensor, old_logprobs: Tensor, rollout_logprobs: Tensor | None,
                          tis_cap: float | None, mis_bound: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Correct the policy gradient for tokens sampled by an engine whose log-probs differ from the trainer's
    (``d = old_logprobs - rollout_logprobs``, the log of ``p_old / p_sampler``).

    Truncated importance sampling (``tis_cap``): each token's advantage is multiplied by ``min(exp(d), tis_cap)``,
    detached; a positive weight scales PPO's clipped term exactly as it scales the advantage. Masking
    (``mis_bound``, :func:`mis_rejected`) here gives a rejected trajectory's tokens advantage 0 while they stay in
    the loss's denominator (``--model.ppo.mis_rejected=zero_advantage``). verl's rollout correction instead takes them
    out of the response mask, denominator included (``excluded``, the default), which :meth:`StarPOUpdate.step`
    applies to the loss mask before this is called; rejected rows then have no tokens left here.

    Returns:
        The weighted advantages and metrics (``offpolicy/tis_clipped_frac``: tokens whose ratio the cap cut;
        ``offpolicy/tis_weight_mean``; ``offpolicy/masked_frac``: trajectories masked).
    """
    if tis_cap is None and mis_bound is None:
        return advantages, {}
    if rollout_logprobs is None:
        raise ValueError("`--model.ppo.tis_cap` / `mis_bound` need the rollout engine's log-probs in the batch")
    d = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).clamp(-20.0, 20.0).detach()
    metrics: dict[str, Tensor] = {}
    if tis_cap is not None:
        ratio = d.exp()
        advantages = advantages * ratio.clamp(max=tis_cap)
        metrics["offpolicy/tis_clipped_frac"] = masked_mean((ratio > tis_cap).float(), mask)
        metrics["offpolicy/tis_weight_mean"] = masked_mean(ratio.clamp(max=tis_cap), mask)
    if mis_bound is not None:
        out = mis_rejected(mask, old_logprobs, rollout_logprobs, mis_bound)
        advantages = torch.where(out[:, None], 0.0, advantages)
        metrics["offpolicy/masked_frac"] = out.float().sum() / mask.any(-1).sum().clamp(min=1)
    return advantages, metrics


# ------------------------------------------------------------------------------------------ diagnostics
def entropy_metrics(batch: TrajectoryBatch, by_tag: bool | None = None) -> dict[str, Tensor]:
    """Sampled-token negative log-likelihood under the sampling policy: a Monte-Carlo estimate of its entropy, per
    token and summed over each trajectory (the paper's trajectory entropy); per token for each env too
    (``rollout/<tag>/token_entropy``), so that one env's narrowing is not averaged away by another's: when the
    batch holds several envs (``by_tag=None``), for every env it holds (``True``: a run of several envs, whose
    filtered batch may hold one) or never (``False``)."""
    assert batch.old_logprobs is not None
    nll = torch.where(batch.loss_mask, -batch.old_logprobs, 0.0)
    real = batch.loss_mask.any(-1)
    out = {"rollout/token_entropy": nll.sum() / batch.loss_mask.sum().clamp(min=1),
           "rollout/trajectory_entropy": nll.sum(-1)[real].mean() if bool(real.any()) else nll.new_zeros(())}
    tags = sorted(set(batch.env_tags))
    for tag in tags if (len(tags) > 1 if by_tag is None else by_tag) else ():
        rows = torch.tensor([t == tag for t in batch.env_tags], device=nll.device)
        if bool(batch.loss_mask[rows].any()):
            out[f"rollout/{tag}/token_entropy"] = nll[rows].sum() / batch.loss_mask[rows].sum()
    return out


def mismatch_metrics(batch: TrajectoryBatch) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's (``old_logprobs``) for
    the same weights: mean and max absolute difference, and the k3 estimate of KL(sampler || trainer). Near zero for
    the ``hf`` engine (the same modules, one forward batched otherwise); vLLM's kernels and precision differ."""
    if batch.rollout_logprobs is None or batch.old_logprobs is None or not bool(batch.loss_mask.any()):
        return {}
    mask = batch.loss_mask
    diff = torch.where(mask, batch.old_logprobs - batch.rollout_logprobs, 0.0).double()  # log(p_trainer / p_sampler)
    k3 = torch.where(mask, diff.exp() - 1 - diff, 0.0)
    count = mask.sum()
    return {"mismatch/logprob_abs_diff_mean": (diff.abs().sum() / count).float(),
            "mismatch/logprob_abs_diff_max": diff.abs().max().float(),
            "mismatch/kl_k3": (k3.sum() / count).float()}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, var_floor: float = 1e-8) -> Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over the sampled tokens: 1 is a perfect critic, <= 0 useless."""
    v, r = values[mask].double(), returns[mask].double()
    # Returns with (almost) no spread make the ratio meaningless (it logged -2e11 when Var was ~1e-13: issue 13).
    if r.numel() < 2 or float(r.var()) <= var_floor * max(1.0, float(r.abs().max()) ** 2):
        return torch.tensor(float("nan"))
    return (1 - (r - v).var() / r.var()).float()


def trimmed(part: TrajectoryBatch) -> TrajectoryBatch:
    """``part`` cut to its longest row (sequences are right-padded): no position past it is computed."""
    T = int(part.attention_mask.sum(-1).max())
    if part.input_ids.shape[1] == T:
        return part
    per_token = {f.name: x[:, :T] for f in fields(part)
                 if isinstance(x := getattr(part, f.name), Tensor) and f.name not in ROW_FIELDS}
    return replace(part, **per_token)


def micro_batches(rows: Tensor, attention_mask: Tensor, size: int) -> list[Tensor]:
    """``rows`` split into micro-batches of ``size`` rows of similar length, longest first.

    A micro-batch is cut to its own longest row (sequences are right-padded), so grouping rows by length cuts the
    padding that forward and backward compute over; the mini-batch's gradient, a sum over its micro-batches, and
    every row's scores do not depend on the grouping.
    """
    lengths = attention_mask[rows].sum(-1)  # (len(rows),)
    return list(rows[torch.argsort(lengths, descending=True, stable=True)].split(size))
