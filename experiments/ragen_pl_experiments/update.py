"""ReadoutUpdate (``--model.updater=ragen_pl_experiments.update.ReadoutUpdate``): the StarPO update for a readout.

It subclasses :class:`ragen_pl.update.StarPOUpdate` through its public seams only (:meth:`score_policy`,
:meth:`prepare`, :meth:`step`, :meth:`scores_old_policy_in_update`) and does two things:

* fits the statistics of the :mod:`ragen_pl_experiments.readout` hooks (the centred head's directions and scales, the
  standardised value head's mean and scale) from every position the first batch scores, before the first update;
* when only the output head trains (a readout: ``--model.lora.target_modules=[lm_head]``, the trunk frozen), runs
  the head alone in the update's steps, on what it read when the rollout was scored: the trunk's output cannot
  change, so each micro-batch costs the head's forward and backward instead of the whole model's. The log-probs and
  values are those of the full forward (checked once per model on the first micro-batch: else the full forward
  stays).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ragen_pl.advantages import Advantage
from ragen_pl.config import PPOConfig
from ragen_pl.dist import is_sharded
from ragen_pl.losses import PolicyLoss
from ragen_pl.policy import Models
from ragen_pl.rewards import RewardNorm
from ragen_pl.scoring import Scores, scored_positions, scores_from_logits
from ragen_pl.types import TrajectoryBatch
from ragen_pl.update import StarPOUpdate
from ragen_pl_experiments.readout import fit_readout_heads, readout_unfitted

__all__ = ["HEAD_REUSE_TOLERANCE", "ReadoutUpdate", "by_row", "scored_slots", "trunk_is_frozen"]

HEAD_REUSE_TOLERANCE = 0.05
"""The largest log-prob gap (nats) between the head run alone on what it read and the model's forward for which the
head's inputs are reused (bf16 rounding of a differently shaped matmul stays far below it; a transform after the
head, as Gemma's soft-capping, does not)."""


class ReadoutUpdate(StarPOUpdate):
    """The update of a readout: fits the readout hooks' statistics, reuses the head's inputs on a frozen trunk.

    Args:
        reuse_head_inputs: run the head alone in the update's steps when the trunk is frozen (false: the full forward
            every micro-batch, e.g. to time or check it).
    """

    def __init__(self, advantage: Advantage | None = None, ppo: PPOConfig | None = None,
                 reward_norm: RewardNorm | None = None, policy_loss: PolicyLoss | None = None, seed: int = 0,
                 reuse_head_inputs: bool = True) -> None:
        super().__init__(advantage, ppo, reward_norm, policy_loss, seed)
        self.reuse_head_inputs = reuse_head_inputs
        self._checked: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        self._reads: list[tuple[Tensor, Tensor, Tensor | None]] | None = None  # prepare: (rows, (N, H), states)
        self._prepared: tuple[TrajectoryBatch, Tensor] | None = None  # the batch prepare scored, (B, K, H) reads
        self._active: Tensor | None = None  # step: the (B, K, H) reads of the batch being updated

    def reuses_head_inputs(self, models: Models) -> bool:
        """Whether the update's steps run only the LM head (and a value head on the policy's trunk) on what the head
        read when :meth:`prepare` scored the rollout."""
        return (self.reuse_head_inputs and trunk_is_frozen(models.policy)
                and self._checked.get(models.policy, True))

    def _needs_fit(self, models: Models) -> bool:
        value_head = models.value_head
        return readout_unfitted(models.policy) or (
            getattr(value_head, "fitted", None) is not None and not bool(value_head.fitted))

    def scores_old_policy_in_update(self, models: Models, n: int) -> bool:
        if self.reuses_head_inputs(models) or self._needs_fit(models):
            return False  # prepare's forward is needed: it keeps what the head read
        return super().scores_old_policy_in_update(models, n)

    @torch.no_grad()
    def prepare(self, batch: TrajectoryBatch, models: Models) -> dict[str, Tensor]:
        fit, reuse = self._needs_fit(models), self.reuses_head_inputs(models)
        self._reads = [] if fit or reuse else None
        self._prepared = None
        try:
            metrics = super().prepare(batch, models)
            reads = self._reads
        finally:
            self._reads = None  # score_policy collects only inside prepare
        if not reads:
            return metrics
        read = by_row(batch.loss_mask, [(rows, h) for rows, h, _ in reads])  # (B, K, H)
        if fit:  # the adapters and the value head are 0 until the first step: nothing above depended on them
            scored = read[scored_slots(batch.loss_mask, read.shape[1])]
            turns = batch.turn_ids[:, 1:][batch.loss_mask[:, 1:]]  # row-major, the order of each row's slots
            fit_readout_heads(models.policy, scored, turns)
            value_head = models.value_head
            if getattr(value_head, "fitted", None) is not None and not bool(value_head.fitted):
                value_head.fit(torch.cat([states for _, _, states in reads if states is not None]))
        if reuse and self.reuses_head_inputs(models):
            self._prepared = (batch, read)
        return metrics

    def step(self, batch: TrajectoryBatch, models: Models, optimizers: list[torch.optim.Optimizer],
             backward: Callable[[Tensor], Any] = Tensor.backward) -> dict[str, Tensor]:
        self._active = self._prepared[1] if self._prepared is not None and self._prepared[0] is batch else None
        try:
            return super().step(batch, models, optimizers, backward)
        finally:
            self._active = None

    def score_policy(self, models: Models, part: TrajectoryBatch, rows: Tensor, *, entropy: bool = False,
                     hidden: bool = False) -> Scores:
        if self._active is not None:
            return self._head_alone(models, part, self._active[rows], entropy, hidden)
        if self._reads is None:
            return super().score_policy(models, part, rows, entropy=entropy, hidden=hidden)
        with _head_reads(models.policy.get_output_embeddings()) as seen:
            s = super().score_policy(models, part, rows, entropy=entropy, hidden=hidden)
        mask = part.loss_mask
        h = seen[-1][0] if self.ppo.pack else seen[-1][scored_positions(mask)[1]]  # (N, H), row-major
        states = s.hidden[:, :-1][mask[:, 1:]] if s.hidden is not None else None  # what a value head reads
        self._reads.append((rows, h, states))
        if models.policy not in self._checked and self.reuses_head_inputs(models):
            self._checked[models.policy] = self._reproduces(models, part, s, h, states)
        return s

    def _head_alone(self, models: Models, part: TrajectoryBatch, reads: Tensor, entropy: bool,
                    hidden: bool) -> Scores:
        """The scores of ``part`` from the head run on ``reads`` (n, K, H), each row's inputs in its first slots;
        with ``hidden``, (B, T, H) states that hold them before each scored token (what the value head reads)."""
        mask = part.loss_mask
        target = mask[:, 1:]
        h = reads[scored_slots(mask, reads.shape[1])]  # (N, H)
        logits = models.policy.get_output_embeddings()(h[None])[0]
        s = scores_from_logits(logits, part.input_ids[:, 1:][target], mask, part.temperature, kept=self.kept(part),
                               entropy=entropy)
        if hidden:
            s.hidden = h.new_zeros(*mask.shape, h.shape[-1])
            s.hidden[:, :-1][target] = h
        return s

    def _reproduces(self, models: Models, part: TrajectoryBatch, s: Scores, h: Tensor, states: Tensor | None) -> bool:
        """Whether the head alone on what it read gives the forward's log-probs, and read the states a value head
        reads (the states, not the values: a value head is 0 until its first step)."""
        mask = part.loss_mask
        slots = torch.zeros(len(part), int(mask[:, 1:].sum(-1).max()), h.shape[-1], dtype=h.dtype, device=h.device)
        slots[scored_slots(mask, slots.shape[1])] = h
        again = self._head_alone(models, part, slots, entropy=False, hidden=False)
        gap = (again.logprobs - s.logprobs).abs().max() if bool(mask.any()) else torch.zeros(())
        same = states is None or (states.shape == h.shape and torch.allclose(states.float(), h.float(), rtol=1e-3,
                                                                              atol=1e-3))
        return bool(gap < HEAD_REUSE_TOLERANCE) and same


@contextmanager
def _head_reads(head: nn.Module) -> Iterator[list[Tensor]]:
    """Within: the inputs of every call of ``head``, detached (the last is the scoring forward's: a shared prefix's
    forward and the packing check run before it)."""
    seen: list[Tensor] = []
    handle = head.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        yield seen
    finally:
        handle.remove()


def trunk_is_frozen(model: nn.Module) -> bool:
    """Whether every trainable parameter of ``model`` is in its LM head (its output embeddings, with any adapter on
    them), so that what the head reads stays the same while the head learns: a transformers causal LM with no part
    sharded (a sharded head's weights exist only inside its unit's forward), no dropout before the head."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module) or any(is_sharded(m) for m in model.modules()):
        return False
    in_head = {id(q) for q in head.parameters()}
    if any(q.requires_grad and id(q) not in in_head for q in model.parameters()):
        return False
    config = getattr(model, "config", None)
    head_modules = {id(m) for m in head.modules()}
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 and id(m) not in head_modules for m in model.modules())
    return not dropout and not float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0


def scored_slots(mask: Tensor, K: int) -> Tensor:
    """(B, K) bool: the first ``mask[:, 1:].sum(-1)`` of each row's K slots (its scored positions, in order)."""
    counts = mask[:, 1:].sum(-1)
    return torch.arange(K, device=mask.device) < counts[:, None]


def by_row(loss_mask: Tensor, reads: list[tuple[Tensor, Tensor]]) -> Tensor:
    """(B, K, H) each row's (N, H) head inputs of ``reads`` (rows, inputs) in its first slots (K: the most any row
    scores), zeros after."""
    K = int(loss_mask[:, 1:].sum(-1).max())
    H = reads[0][1].shape[-1]
    out = reads[0][1].new_zeros(loss_mask.shape[0], K, H)
    for rows, x in reads:
        part = out[rows]
        part[scored_slots(loss_mask[rows], K)] = x
        out[rows] = part
    return out
