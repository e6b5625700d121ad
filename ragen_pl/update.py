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
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ragen_pl.advantages import GAE, Advantage
from ragen_pl.config import PPOConfig
from ragen_pl.lora import centred_unfitted, fit_centred_heads
from ragen_pl.losses import PolicyLoss, PPOClip, aggregate, kl_penalty, value_loss
from ragen_pl.ops import last_true, masked_mean
from ragen_pl.policy import Models, clip_grad_norm
from ragen_pl.rewards import RewardNorm
from ragen_pl.scoring import Scores, by_row, score, scored_slots, trunk_is_frozen
from ragen_pl.types import TrajectoryBatch

__all__ = ["MicroLoss", "StarPOUpdate", "entropy_metrics", "explained_variance", "micro_batches",
           "mismatch_metrics", "off_policy_correction"]

HEAD_REUSE_TOLERANCE = 0.05
"""The largest log-prob gap (nats) between the head run alone on what it read and the model's forward for which
:meth:`StarPOUpdate.reuses_head_inputs` keeps the head's inputs (bf16 rounding of a differently shaped matmul stays
far below it; a transform after the head does not)."""


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
    """The update's settings and state (the mini-batch shuffling generator, the count of skipped steps)."""

    def __init__(self, advantage: Advantage | None = None, ppo: PPOConfig | None = None,
                 reward_norm: RewardNorm | None = None, policy_loss: PolicyLoss | None = None, seed: int = 0) -> None:
        self.advantage = advantage if advantage is not None else GAE()
        self.ppo = ppo or PPOConfig()
        self.reward_norm = reward_norm or RewardNorm()
        self.policy_loss = policy_loss if policy_loss is not None else PPOClip()
        self.shuffle = torch.Generator().manual_seed(seed)
        self.skipped_steps = 0
        self.positions = 0
        """Trunk positions the policy's forwards ran over in the current ``step`` (for FLOP counts)."""
        self.scored = 0
        """Tokens through the policy's LM head in the current ``step``."""
        self._head_inputs: tuple[TrajectoryBatch, Tensor] | None = None
        """The batch ``prepare`` scored and, (B, K, H), what the LM head read at each row's K scored positions
        (:meth:`reuses_head_inputs`)."""
        self._head_checked: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------------------------------- scoring
    def scores_old_policy_in_update(self, models: Models, n: int) -> bool:
        """Whether the update's own first forward gives the old log-probs, so ``prepare`` skips the policy pass.

        With one optimiser step per iteration (one epoch, one mini-batch) the weights do not change before every
        micro-batch has been scored, so the detached log-probs of the update's forward are exactly the sampling
        policy's (TRL's GRPO does the same with ``num_iterations=1``). Not when a shared value head needs that
        forward's values first, or a KL reward needs the old log-probs before the advantages.
        """
        p = self.ppo
        return (p.ppo_epochs == 1 and p.mini_batch_size >= n and models.value_head is None
                and not (p.kl_coeff > 0 and p.kl_mode == "reward"))

    def reuses_head_inputs(self, models: Models) -> bool:
        """Whether the update's steps run only the LM head (and a value head on the policy's trunk), on what the LM
        head read when ``prepare`` scored the rollout: only the heads train (:func:`~ragen_pl.scoring.trunk_is_frozen`:
        a readout, ``--model.lora.target_modules=[lm_head]``), so the trunk's output is the same in every step. Each
        micro-batch then costs the heads' forward and backward instead of the whole model's; the log-probs and
        values are the same (checked on the first micro-batch a model scores: else it keeps the full forward)."""
        return trunk_is_frozen(models.policy) and self._head_checked.get(models.policy, True)

    def _head_reproduces(self, models: Models, s: Scores, ids: Tensor, attn: Tensor, mask: Tensor,
                         temperature: float, kept: Tensor | None) -> bool:
        """Once per model: whether the head alone, on what it read, gives the forward's log-probs (not for a model
        that transforms the logits after its head, as Gemma's soft-capping does), and whether it read the hidden
        states a value head reads (the states, not the values: a value head is 0 until its first step)."""
        model = models.policy
        if model not in self._head_checked:
            again = score(model, ids, attn, mask, temperature, kept=kept, head_inputs=s.head_inputs)
            gap = (again.logprobs - s.logprobs).abs().max() if bool(mask.any()) else torch.zeros(())
            same = True
            if models.value_head is not None and s.hidden is not None:
                states = s.hidden[:, :-1][mask[:, 1:]]
                same = states.shape == s.head_inputs.shape and torch.allclose(
                    states.float(), s.head_inputs.float(), rtol=1e-3, atol=1e-3)
            self._head_checked[model] = bool(gap < HEAD_REUSE_TOLERANCE) and same
        return self._head_checked[model]

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

        Old log-probs are left to the update when :meth:`scores_old_policy_in_update` holds, unless the steps
        reuse the head's inputs (:meth:`reuses_head_inputs`), which this forward keeps.
        """
        reuse = self.reuses_head_inputs(models)
        fit = centred_unfitted(models.policy)  # a centred head's directions come from every position this batch scores
        fit_values = getattr(models.value_head, "fitted", None) is not None and not bool(models.value_head.fitted)
        value_reads: list[Tensor] = []  # (N, H) the states a standardised value head reads, to fit it on
        collect = reuse or fit
        score_policy = collect or not self.scores_old_policy_in_update(models, len(batch))
        self._head_inputs = None
        reads: list[tuple[Tensor, Tensor]] = []  # (rows, (N, H) what the head read at their scored positions)
        filled: dict[str, Tensor] = {}

        def fill(name: str, rows: Tensor, x: Tensor) -> None:  # x: (len(rows), T') with T' <= T
            if name not in filled:
                filled[name] = torch.zeros_like(batch.rewards, dtype=x.dtype)  # (B, T)
            filled[name][rows, :x.shape[1]] = x

        for idx in micro_batches(torch.arange(len(batch), device=batch.input_ids.device), batch.attention_mask,
                                 self.ppo.micro_batch_size):
            part = batch.select(idx)
            T = int(part.attention_mask.sum(-1).max())
            ids, attn, mask = part.input_ids[:, :T], part.attention_mask[:, :T], part.loss_mask[:, :T]
            if score_policy:
                kept = self._kept(part, T)
                s = score(models.policy, ids, attn, mask, batch.temperature, hidden=models.value_head is not None,
                          share_prefix=self.ppo.share_prefix, kept=kept, pack=self.ppo.pack, keep_head_inputs=collect)
                fill("old_logprobs", idx, s.logprobs)
                reuse = reuse and self._head_reproduces(models, s, ids, attn, mask, batch.temperature, kept)
                if collect:
                    reads.append((idx, s.head_inputs))
                if s.hidden is not None:
                    fill("values", idx, models.shared_values(s.hidden))
                    if fit_values:  # the value of token t is read at position t - 1
                        value_reads.append(s.hidden[:, :-1][mask[:, 1:]])
            if models.critic is not None:
                fill("values", idx, models.critic_values(ids, attn, mask, self.ppo.share_prefix, self.ppo.pack))
            if self.ppo.kl_coeff > 0:
                fill("ref_logprobs", idx, self._reference_logprobs(models, ids, attn, mask, batch.temperature))
        for name, x in filled.items():
            setattr(batch, name, x)
        read = by_row(batch.loss_mask, reads) if reads else None  # (B, K, H)
        if fit and read is not None:  # (the adapter is 0 until the first step: the log-probs above do not depend on U)
            turns = batch.turn_ids[:, 1:][batch.loss_mask[:, 1:]]  # row-major, the order of each row's slots
            fit_centred_heads(models.policy, read[scored_slots(batch.loss_mask, read.shape[1])], turns)
        if fit_values and value_reads:  # (the value head is 0 until its first step: the values above do not depend on it)
            models.value_head.fit(torch.cat(value_reads))
        if reuse and read is not None:
            self._head_inputs = (batch, read)
        metrics: dict[str, Tensor] = {}
        if self.reward_norm.method != "identity":
            self._normalise_rewards(batch)
        if self.ppo.kl_coeff > 0 and self.ppo.kl_mode == "reward":
            kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, self.ppo.kl_estimator)
            batch.rewards = batch.rewards - self.ppo.kl_coeff * torch.where(batch.loss_mask, kl, 0.0)
            metrics["loss/kl_reward"] = masked_mean(kl, batch.loss_mask)
        batch.advantages, batch.returns = self.advantage(batch)
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

    def _kept(self, part: TrajectoryBatch, T: int) -> Tensor | None:
        """The sampler's kept sets of ``part`` (cut to T), when replayed."""
        if not self.ppo.replay_sampling_mask or part.sampling_masks is None:
            return None
        return part.sampling_masks[:, :T]

    # -------------------------------------------------------------------------------------------- update
    def loss_denominator(self, mask: Tensor) -> Tensor:
        """The denominator of the loss aggregation, over a whole mini-batch."""
        if self.policy_loss.aggregation(self.ppo) == "token-mean":
            return mask.sum().clamp(min=1)
        return mask.any(-1).sum().clamp(min=1)

    def micro_loss(self, part: TrajectoryBatch, models: Models, mini_count: Tensor,
                   head_inputs: Tensor | None = None) -> MicroLoss:
        """Actor loss and critic loss of one micro-batch, scaled so that micro-batches add up to the mini-batch.
        ``head_inputs`` (n, K, H): what the LM head read at each row's scored positions (:meth:`reuses_head_inputs`);
        only the head runs."""
        p = self.ppo
        T = int(part.attention_mask.sum(-1).max())
        ids, attn, mask = part.input_ids[:, :T], part.attention_mask[:, :T], part.loss_mask[:, :T]
        scale = self.loss_denominator(mask) / mini_count
        if head_inputs is not None:
            head_inputs = head_inputs[scored_slots(mask, head_inputs.shape[1])]
        s = score(models.policy, ids, attn, mask, part.temperature, entropy=True,
                  hidden=models.value_head is not None and head_inputs is None, share_prefix=p.share_prefix,
                  kept=self._kept(part, T), pack=p.pack, head_inputs=head_inputs, turns=part.turn_ids[:, :T])
        # No old log-probs yet: this forward is the sampling policy's (see `scores_old_policy_in_update`).
        old = part.old_logprobs[:, :T] if part.old_logprobs is not None else s.logprobs.detach()
        advantages, off_metrics = off_policy_correction(
            part.advantages[:, :T], mask, old, None if part.rollout_logprobs is None else part.rollout_logprobs[:, :T],
            p.tis_cap, p.mis_bound)
        pg, metrics = self.policy_loss(s.logprobs, old, advantages, mask, p)
        metrics.update(off_metrics)
        self.positions += s.positions
        self.scored += s.scored
        assert s.entropy is not None
        norm = p.loss_agg_norm or 1.0
        ent = aggregate(s.entropy, mask, p.loss_agg, norm)
        actor = pg - p.entropy_coeff * ent
        metrics["loss/policy"] = pg.detach()
        metrics["loss/entropy"] = ent.detach()
        if p.kl_coeff > 0 and p.kl_mode == "loss":
            kl = aggregate(kl_penalty(s.logprobs, part.ref_logprobs[:, :T], p.kl_estimator), mask, p.loss_agg, norm)
            actor = actor + p.kl_coeff * kl
            metrics["loss/kl"] = kl.detach()
        critic = None
        if models.has_critic:
            values = (models.critic_values(ids, attn, mask, p.share_prefix, p.pack) if models.critic is not None
                      else models.shared_values(s.hidden) if head_inputs is None else models.values_at(mask, head_inputs))
            vf, vm = value_loss(values, part.values[:, :T], part.returns[:, :T], mask, p.value_clip, p.loss_agg, norm)
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
        self.positions = self.scored = 0
        actor_params = [q for group in optimizers[0].param_groups for q in group["params"]]
        critic_params = [q for group in optimizers[1].param_groups for q in group["params"]] if len(optimizers) > 1 else []
        sums: dict[str, list[Tensor]] = {}
        n = len(batch)
        steps = 0
        scored: list[tuple[Tensor, Tensor]] = []  # (rows, old log-probs) when the update scores the old policy
        reads = self._head_inputs[1] if self._head_inputs is not None and self._head_inputs[0] is batch else None
        for _ in range(p.ppo_epochs):
            perm = torch.randperm(n, generator=self.shuffle).to(batch.input_ids.device)
            for start in range(0, n, p.mini_batch_size):
                idx = perm[start:start + p.mini_batch_size]
                mini_count = self.loss_denominator(batch.loss_mask[idx])
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                for micro in micro_batches(idx, batch.attention_mask, p.micro_batch_size):
                    reused = {} if reads is None else {"head_inputs": reads[micro]}
                    loss = self.micro_loss(batch.select(micro), models, mini_count, **reused)
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
        out["train/skipped_steps"] = torch.tensor(float(self.skipped_steps))
        out["throughput/update_positions"] = torch.tensor(float(self.positions))
        out["throughput/update_scored_tokens"] = torch.tensor(float(self.scored))
        out["train/optimizer_steps"] = torch.tensor(float(steps))
        return out

    # ---------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"shuffle": self.shuffle.get_state(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "shuffle" in state:
            self.shuffle.set_state(state["shuffle"])
        self.skipped_steps = state.get("skipped_steps", 0)


# ------------------------------------------------------------------------------------ off-policy correction
def off_policy_correction(advantages: Tensor, mask: Tensor, old_logprobs: Tensor, rollout_logprobs: Tensor | None,
                          tis_cap: float | None, mis_bound: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Correct the policy gradient for tokens sampled by an engine whose log-probs differ from the trainer's
    (``d = old_logprobs - rollout_logprobs``, the log of ``p_old / p_sampler``).

    Truncated importance sampling (``tis_cap``): each token's advantage is multiplied by ``min(exp(d), tis_cap)``,
    detached; a positive weight scales PPO's clipped term exactly as it scales the advantage. Masking
    (``mis_bound``): trajectories whose ``exp(mean_t d)`` is outside ``[1/mis_bound, mis_bound]`` get weight 0 (their
    tokens stay in the loss's denominator, as verl's rollout correction keeps them).

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
        has = mask.any(-1)
        seq = d.sum(-1) / mask.sum(-1).clamp(min=1)  # mean log-ratio per trajectory
        out = (seq.abs() > math.log(mis_bound)) & has
        advantages = torch.where(out[:, None], 0.0, advantages)
        metrics["offpolicy/masked_frac"] = out.float().sum() / has.sum().clamp(min=1)
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


def micro_batches(rows: Tensor, attention_mask: Tensor, size: int) -> list[Tensor]:
    """``rows`` split into micro-batches of ``size`` rows of similar length, longest first.

    A micro-batch is cut to its own longest row (sequences are right-padded), so grouping rows by length cuts the
    padding that forward and backward compute over; the mini-batch's gradient, a sum over its micro-batches, and
    every row's scores do not depend on the grouping.
    """
    lengths = attention_mask[rows].sum(-1)  # (len(rows),)
    return list(rows[torch.argsort(lengths, descending=True, stable=True)].split(size))
