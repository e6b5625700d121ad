"""The batch types the RL math works on. Light imports only (torch and the standard library).

Token-aligned convention: every ``(B, T)`` tensor is indexed by the position of a token in ``input_ids``.
``logprobs[b, t]`` is ``log p(input_ids[b, t] | input_ids[b, :t])``, so position 0 never carries a log-prob and is
never in ``loss_mask``. A trajectory is the whole multi-turn conversation (system prompt, env observations, the
model's answers); ``loss_mask`` is true exactly on the tokens the policy sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
from torch import Tensor

RewardGrouping = Literal["state", "tag", "batch"]
RewardMethod = Literal["identity", "mean_std", "mean_std_clip"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass
class TrajectoryStats:
    """The per-trajectory numbers filters and metrics need: small enough to all-gather across ranks."""

    scores: Tensor
    """(B,) trajectory reward."""
    group_ids: Tensor
    """(B,) long."""
    lengths: Tensor
    """(B,) sampled tokens per trajectory."""
    entropy: Tensor | None = None
    """(B,) mean of ``-log p`` over sampled tokens (a Monte-Carlo token-entropy estimate): the trainer's old
    log-probs once scored, else the rollout engine's; None if neither is known."""

    def __len__(self) -> int:
        return self.scores.shape[0]


ROW_FIELDS = ("group_ids", "traj_ids", "policy_versions")
"""The (B,) tensor fields of :class:`TrajectoryBatch`: one value per row; its other tensors are (B, T)."""


@dataclass
class TrajectoryBatch:
    """B multi-turn trajectories padded (on the right) to T tokens.

    Shapes and dtypes:
        input_ids: (B, T) long. Prompt, observations and sampled tokens, exactly as fed and sampled.
        attention_mask: (B, T) bool. True on real tokens, False on padding.
        loss_mask: (B, T) bool. True exactly on tokens the policy sampled.
        rewards: (B, T) float. Token-level rewards, on the last sampled token of a turn (or all on the last turn).
        turn_ids: (B, T) long. Turn index (0-based) of each sampled token, -1 elsewhere.
        group_ids: (B,) long. Trajectories from the same initial state (env seed) share a group id.
        env_tags: B strings. Which env (or env variant) each trajectory came from.
        old_logprobs: (B, T) float or None. Log-probs of the sampling policy (filled before the update).
        ref_logprobs: (B, T) float or None. Log-probs of the frozen reference policy (only with a KL term).
        values: (B, T) float or None. Critic values at sampling time (only with a critic).
        advantages: (B, T) float or None. Filled by the advantage estimator.
        returns: (B, T) float or None. Critic targets, filled by estimators that use a critic.
        traj_ids: (B,) long or None. With a context window each turn is its own row (its prompt holds only the
            last turns); rows of one trajectory share a traj id and follow each other in turn order. None means
            every row is a whole trajectory.
        rollout_logprobs: (B, T) float or None. The rollout engine's log-prob of each sampled token under the
            distribution it sampled from (0 elsewhere): the sampler's view of ``old_logprobs``.
        sampling_masks: (B, T, K) int or None. When sampling truncated the distribution (top-k, top-p): the
            vocabulary ids each sampled token was drawn from, -1 padded (all -1 where unknown: scored over the whole
            vocabulary).
        turn_states: (B, T) long or None. On each sampled token, the id of the env state its turn started in
            (:func:`ragen_pl.envs.base.state_id` of the env's ``state_key()``, else of the observation text): GiGPO's
            anchor states. None where the batch did not come from a rollout.
        policy_versions: (B,) long or None. The training step whose weights sampled each row (rollouts played
            ahead, ``--data.max_staleness``); None when the current weights did (the synchronous loop).
        temperature: the sampling temperature of the rollout; the update scores log-probs at it.
        loss_scale: what the advantages are multiplied by once computed (a filter's kept share: RAGEN-2's loss
            scaling); 1 leaves them as they are.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    rewards: Tensor
    turn_ids: Tensor
    group_ids: Tensor
    env_tags: tuple[str, ...]
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    traj_ids: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    sampling_masks: Tensor | None = None
    turn_states: Tensor | None = None
    policy_versions: Tensor | None = None
    temperature: float = 1.0
    loss_scale: float = 1.0

    def __post_init__(self) -> None:
        B, T = self.input_ids.shape
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ROW_FIELDS:
                if value is not None and value.shape != (B,):
                    raise ValueError(f"`{f.name}` must have shape ({B},), got {tuple(value.shape)}")
            elif f.name == "env_tags":
                if len(value) != B:
                    raise ValueError(f"`env_tags` must have {B} entries, got {len(value)}")
                self.env_tags = tuple(value)
            elif f.name == "loss_scale":
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                    raise ValueError(f"`loss_scale` must be a number in [0, 1], got {value!r}")
            elif f.name == "temperature":
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    raise ValueError(f"`temperature` must be a number > 0, got {value!r}")
            elif f.name == "sampling_masks":
                if value is not None and (value.dim() != 3 or value.shape[:2] != (B, T)):
                    raise ValueError(f"`sampling_masks` must have shape ({B}, {T}, K), got {tuple(value.shape)}")
            elif isinstance(value, Tensor) and value.shape != (B, T):
                raise ValueError(f"`{f.name}` must have shape ({B}, {T}), got {tuple(value.shape)}")
        if self.loss_mask.dtype != torch.bool or self.attention_mask.dtype != torch.bool:
            raise TypeError("`loss_mask` and `attention_mask` must be bool tensors")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def trajectory_index(self) -> tuple[Tensor, Tensor]:
        """``(inverse, first)``: each row's trajectory (0..n-1, in order of first row) and each trajectory's first row."""
        B = self.input_ids.shape[0]
        if self.traj_ids is None:
            ar = torch.arange(B, device=self.input_ids.device)
            return ar, ar
        _, inverse = torch.unique_consecutive(self.traj_ids, return_inverse=True)
        first = torch.ones(B, dtype=torch.bool, device=inverse.device)
        first[1:] = inverse[1:] != inverse[:-1]
        return inverse, first.nonzero().flatten()

    @property
    def row_scores(self) -> Tensor:
        """(B,) reward on each row's sampled tokens (rewards elsewhere are ignored)."""
        return torch.where(self.loss_mask, self.rewards, 0.0).sum(-1)

    @property
    def scores(self) -> Tensor:
        """(B,) the reward of each row's whole trajectory (the sum over its rows when turns are rows)."""
        row = self.row_scores
        if self.traj_ids is None:
            return row
        inverse, first = self.trajectory_index()
        total = torch.zeros(len(first), dtype=row.dtype, device=row.device).index_add_(0, inverse, row)
        return total[inverse]

    @property
    def response_lengths(self) -> Tensor:
        """(B,) number of sampled tokens per trajectory."""
        return self.loss_mask.sum(-1)

    @property
    def turn_ends(self) -> Tensor:
        """(B, T) bool: the last sampled token of each turn."""
        nxt = torch.full_like(self.turn_ids, -1)
        nxt[:, :-1] = self.turn_ids[:, 1:]
        return self.loss_mask & (nxt != self.turn_ids)

    def stats(self) -> TrajectoryStats:
        """One entry per trajectory (rows of one trajectory are merged); see :meth:`trajectory_index`."""
        inverse, first = self.trajectory_index()
        n = len(first)

        def per_traj(x: Tensor) -> Tensor:
            return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)

        lengths = per_traj(self.response_lengths)
        entropy = None
        logprobs = self.old_logprobs if self.old_logprobs is not None else self.rollout_logprobs
        if logprobs is not None:
            entropy = per_traj(torch.where(self.loss_mask, -logprobs, 0.0).sum(-1)) / lengths.clamp(min=1)
        return TrajectoryStats(self.scores[first], self.group_ids[first], lengths, entropy)

    def stitch(self, x: Tensor) -> Tensor:
        """(B, T) rows -> (n, K*T): each trajectory's rows laid end to end (K = most rows of a trajectory).

        Positions outside the loss mask are skipped by the estimators, so the padding in between is harmless.
        """
        if self.traj_ids is None:
            return x
        inverse, first = self.trajectory_index()
        k = torch.arange(len(inverse), device=x.device) - first[inverse]  # row number inside its trajectory
        out = x.new_zeros((len(first), int(k.max()) + 1, x.shape[1]))
        out[inverse, k] = x
        return out.reshape(len(first), -1)

    def unstitch(self, y: Tensor) -> Tensor:
        """Inverse of :meth:`stitch`."""
        if self.traj_ids is None:
            return y
        inverse, first = self.trajectory_index()
        T = self.input_ids.shape[1]
        k = torch.arange(len(inverse), device=y.device) - first[inverse]
        return y.reshape(len(first), -1, T)[inverse, k]

    def select(self, index: Tensor) -> TrajectoryBatch:
        """The trajectories at ``index`` (a (B,) bool mask or a long index tensor)."""
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        picked = {
            f.name: getattr(self, f.name)[index] if isinstance(getattr(self, f.name), Tensor) else None
            for f in fields(self)
        }
        picked["env_tags"] = tuple(self.env_tags[i] for i in index.tolist())
        picked["temperature"], picked["loss_scale"] = self.temperature, self.loss_scale
        return TrajectoryBatch(**picked)

    @staticmethod
    def cat(first: TrajectoryBatch, second: TrajectoryBatch) -> TrajectoryBatch:
        """The rows of ``first`` then those of ``second`` (same padded length T, same temperature); a field that
        either lacks is left out."""
        if first.temperature != second.temperature:
            raise ValueError(f"cannot join batches sampled at temperatures {first.temperature} and "
                             f"{second.temperature}")
        joined = {}
        for f in fields(TrajectoryBatch):
            a, b = getattr(first, f.name), getattr(second, f.name)
            joined[f.name] = torch.cat([a, b]) if isinstance(a, Tensor) and isinstance(b, Tensor) else None
        return TrajectoryBatch(**{**joined, "env_tags": first.env_tags + second.env_tags,
                                  "temperature": first.temperature, "loss_scale": first.loss_scale})

    def to(self, device: torch.device | str) -> TrajectoryBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in moved.items():
            if isinstance(v, Tensor):
                moved[k] = v.to(device)
        return replace(self, **moved)
