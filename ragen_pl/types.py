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
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
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
    """(B,) mean of ``-old_logprobs`` over sampled tokens (a Monte-Carlo token-entropy estimate), if known."""

    def __len__(self) -> int:
        return self.scores.shape[0]


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

    def __post_init__(self) -> None:
        B, T = self.input_ids.shape
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "group_ids":
                if value.shape != (B,):
                    raise ValueError(f"`group_ids` must have shape ({B},), got {tuple(value.shape)}")
            elif f.name == "env_tags":
                if len(value) != B:
                    raise ValueError(f"`env_tags` must have {B} entries, got {len(value)}")
                self.env_tags = tuple(value)
            elif isinstance(value, Tensor) and value.shape != (B, T):
                raise ValueError(f"`{f.name}` must have shape ({B}, {T}), got {tuple(value.shape)}")
        if self.loss_mask.dtype != torch.bool or self.attention_mask.dtype != torch.bool:
            raise TypeError("`loss_mask` and `attention_mask` must be bool tensors")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def scores(self) -> Tensor:
        """(B,) trajectory reward: the sum of token rewards on sampled tokens (rewards elsewhere are ignored)."""
        return (self.rewards * self.loss_mask).sum(-1)

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
        entropy = None
        if self.old_logprobs is not None:
            m = self.loss_mask
            entropy = torch.where(m, -self.old_logprobs, 0.0).sum(-1) / m.sum(-1).clamp(min=1)
        return TrajectoryStats(self.scores, self.group_ids, self.response_lengths, entropy)

    def select(self, index: Tensor) -> TrajectoryBatch:
        """The trajectories at ``index`` (a (B,) bool mask or a long index tensor)."""
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        picked = {
            f.name: getattr(self, f.name)[index] if isinstance(getattr(self, f.name), Tensor) else None
            for f in fields(self)
        }
        picked["env_tags"] = tuple(self.env_tags[i] for i in index.tolist())
        return TrajectoryBatch(**picked)

    def to(self, device: torch.device | str) -> TrajectoryBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in moved.items():
            if isinstance(v, Tensor):
                moved[k] = v.to(device)
        return replace(self, **moved)
