"""Advantage estimators: pure functions plus thin configurable classes (entry-point group ``ragen_pl.advantages``).

Conventions (see :mod:`ragen_pl.types`): ``(B, T)`` tensors are token-aligned, ``mask`` is the loss mask (true on
sampled tokens). Positions outside the mask are *skipped*, not treated as time steps: in a multi-turn trajectory
the environment's tokens sit between two turns, and the next state value of a turn's last sampled token is the
value at the first sampled token of the next turn. Estimators return zeros outside the mask.

Owned by :class:`ragen_pl.module.RagenModule`, because GAE needs the critic's values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch
from torch import Tensor

from ragen_pl.ops import group_stats, masked_whiten
from ragen_pl.types import TrajectoryBatch

__all__ = [
    "GAE",
    "DrGRPO",
    "GRPO",
    "RLOO",
    "GiGPO",
    "Advantage",
    "BiLevelGAE",
    "ReinforcePP",
    "bilevel_gae",
    "discounted_step_returns",
    "gae",
    "gigpo",
    "grpo",
    "reinforce_pp",
    "rloo",
]


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}` must be in [0, 1], got {value}")


def _check_masks(rewards: Tensor, mask: Tensor, values: Tensor | None = None) -> None:
    if rewards.dim() != 2 or mask.shape != rewards.shape or (values is not None and values.shape != rewards.shape):
        shapes = {"rewards": tuple(rewards.shape), "mask": tuple(mask.shape)}
        if values is not None:
            shapes["values"] = tuple(values.shape)
        raise ValueError(f"rewards, mask (and values) must share one (B, T) shape, got {shapes}")


# ---------------------------------------------------------------------------------------- pure math
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Token-level generalised advantage estimation over a masked multi-turn sequence.

    ``delta_t = r_t + gamma * V(next valid token) - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    "next" skips positions outside ``mask`` and the value after the last valid token is 0 (the episode ends).
    Rewards outside ``mask`` are ignored.

    Returns:
        ``(advantages, returns)``, both (B, T), zero outside ``mask``; ``returns = advantages + values``.
    """
    _check_masks(rewards, mask, values)
    if gamma < 0 or lam < 0:
        raise ValueError(f"`gamma` and `lam` must be >= 0, got gamma={gamma}, lam={lam}")
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(B)
    last_gae = rewards.new_zeros(B)
    for t in reversed(range(T)):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        current = delta + gamma * lam * last_gae
        advantages[:, t] = torch.where(valid, current, 0.0)
        last_gae = torch.where(valid, current, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


def bilevel_gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    turn_ends: Tensor,
    gamma_turn: float = 0.95,
    lam_turn: float = 1.0,
    gamma_token: float = 1.0,
    lam_token: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Bi-level GAE (RAGEN's ``bi_level_gae``): GAE across turns, then GAE inside each turn.

    1. Turn level: on each turn's last sampled token ``e_k``,
       ``delta_k = r(e_k) + gamma_turn * V(e_{k+1}) - V(e_k)``, ``A_k = delta_k + gamma_turn * lam_turn * A_{k+1}``,
       and the turn's return is ``G_k = A_k + V(e_k)`` (``V(e_{K+1}) = 0``).
    2. Token level, inside each turn: the turn ends as if the episode did, with reward ``G_k`` on ``e_k`` and
       no bootstrap, so ``A(e_k) = G_k - V(e_k)``; earlier tokens use ordinary GAE with ``gamma_token`` and
       ``lam_token`` and their own token rewards.

    Returns:
        ``(advantages, returns)``, both (B, T), zero outside ``mask``.
    """
    _check_masks(rewards, mask, values)
    if turn_ends.shape != mask.shape or bool((turn_ends & ~mask).any()):
        raise ValueError("`turn_ends` must have the mask's shape and lie on sampled tokens")
    for name, v in (("gamma_turn", gamma_turn), ("lam_turn", lam_turn), ("gamma_token", gamma_token),
                    ("lam_token", lam_token)):
        if v < 0:
            raise ValueError(f"`{name}` must be >= 0, got {v}")
    # Turn level: plain GAE over the turn-end tokens only (the other positions are skipped), so G_k = A_k + V(e_k).
    _, turn_returns = gae(rewards, values, turn_ends, gamma_turn, lam_turn)
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(B)
    last_gae = rewards.new_zeros(B)
    for t in reversed(range(T)):
        valid, end = mask[:, t], turn_ends[:, t]
        reward = torch.where(end, turn_returns[:, t], rewards[:, t])
        bootstrap = torch.where(end, 0.0, next_value)
        carry = torch.where(end, 0.0, last_gae)
        current = reward + gamma_token * bootstrap - values[:, t] + gamma_token * lam_token * carry
        advantages[:, t] = torch.where(valid, current, 0.0)
        last_gae = torch.where(valid, current, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


def _check_groups(name: str, group_ids: Tensor, count: Tensor) -> None:
    if bool((count < 2).any()):
        lonely = group_ids[count < 2][:5].tolist()
        raise ValueError(
            f"`group_ids`: {name} needs at least 2 trajectories per group, got groups of size 1 (ids {lonely}); "
            f"set `data.group_size` >= 2"
        )


def grpo(
    scores: Tensor,
    group_ids: Tensor,
    scale: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative trajectory advantage: ``(score - group mean) / (std + eps)``.

    ``scale="group"`` divides by the group's unbiased std (GRPO), ``"batch"`` by the std of all scores,
    ``"none"`` does not divide (Dr. GRPO).

    Returns:
        (B,) advantages, one per trajectory.

    Raises:
        ValueError: a group of one trajectory (its advantage would be undefined), or an unknown ``scale``.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"`scale` must be one of 'group', 'batch', 'none', got {scale!r}")
    mean, std, count = group_stats(scores, group_ids)
    _check_groups("GRPO", group_ids, count)
    if scale == "group":
        denom = std + eps
    elif scale == "batch":
        denom = scores.to(torch.float64).std() + eps
    else:
        denom = torch.ones_like(mean)
    return ((scores - mean) / denom).to(scores.dtype)


def rloo(scores: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out: ``score_i - mean of the other scores in its group`` = ``n/(n-1) (s_i - mean)``.

    Returns:
        (B,) advantages.

    Raises:
        ValueError: a group of one trajectory (there is no one to leave out).
    """
    mean, _, count = group_stats(scores, group_ids)
    _check_groups("RLOO", group_ids, count)
    return (count / (count - 1) * (scores - mean)).to(scores.dtype)


def _grouped(fn, batch: TrajectoryBatch, **kwargs) -> Tensor:
    """Apply a group estimator to the trajectories that can have one; broadcast to their sampled tokens.

    Statistics count each trajectory once, however many rows (turns) it has. Trajectories without sampled tokens
    (padding between ranks) and trajectories left alone in their group (their group-mates' envs failed) get
    advantage 0: they carry no group-relative signal.
    """
    stats = batch.stats()
    inverse, _ = batch.trajectory_index()
    # Group sizes count only trajectories with sampled tokens: a group-mate without any has no score to compare.
    usable = stats.lengths > 0
    if bool(usable.any()):
        _, _, count = group_stats(stats.scores[usable], stats.group_ids[usable])
        usable[usable.clone()] = count > 1
    adv = torch.zeros_like(stats.scores)
    if bool(usable.any()):
        adv[usable] = fn(stats.scores[usable], stats.group_ids[usable], **kwargs)
    return adv[inverse][:, None] * batch.loss_mask


def discounted_step_returns(rewards: Tensor, episodes: Tensor, gamma: float) -> Tensor:
    """Each step's discounted return to the end of its episode: ``G_k = r_k + gamma * G_{k+1}`` (GiGPO's Eq. 5).

    Args:
        rewards: (N,) one reward per step.
        episodes: (N,) the episode of each step; an episode's steps are consecutive and in order.
    """
    out, running, after = [], 0.0, None
    for r, e in zip(reversed(rewards.tolist()), reversed(episodes.tolist())):
        running = r + (gamma * running if e == after else 0.0)
        out.append(running)
        after = e
    return torch.tensor(out[::-1], dtype=torch.float64, device=rewards.device)


def _relative(x: Tensor, keys: Tensor, mode: str, eps: float) -> Tensor:
    """``x`` minus the mean of its key's entries (``mean_norm``), or divided after by their std + eps
    (``mean_std_norm``). Keys with one entry give 0."""
    mean, std, count = group_stats(x, keys)
    centred = x.to(torch.float64) - mean
    if mode == "mean_std_norm":
        centred = centred / (std + eps)
    return torch.where(count > 1, centred, 0.0)


def gigpo(
    episode_scores: Tensor,
    group_ids: Tensor,
    episodes: Tensor,
    step_returns: Tensor,
    anchors: Tensor,
    mode: Literal["mean_norm", "mean_std_norm"] = "mean_norm",
    eps: float = 1e-6,
    compute_mean_std_cross_steps: bool = True,
) -> tuple[Tensor, Tensor]:
    """GiGPO's two relative advantages (Feng et al. 2025, arXiv 2505.10978), one per step (a model turn).

    * Episode level (Eq. 3): each step's episode score against its group's. With ``compute_mean_std_cross_steps``
      (verl-agent's default) the group's mean and std run over its steps, so an episode counts once per turn it
      played; without, over its episodes.
    * Step level (Eq. 6-7): each step's discounted return against those of the steps of its group that start in the
      same anchor state.

    ``mode="mean_norm"`` subtracts the mean; ``"mean_std_norm"`` divides the difference by the unbiased std + eps.
    A step alone in its anchor group has step advantage 0, and an episode alone in its group (its group-mates
    failed) episode advantage 0: there is nothing to compare it with.

    Args:
        episode_scores: (N,) each step's episode score.
        group_ids: (N,) each step's group (the initial state its episode started from).
        episodes: (N,) each step's episode.
        step_returns: (N,) each step's discounted return (:func:`discounted_step_returns`).
        anchors: (N,) the id of the state each step started in.

    Returns:
        ``(episode_advantages, step_advantages)``, (N,) float64 each.
    """
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"`mode` must be 'mean_norm' or 'mean_std_norm', got {mode!r}")
    if compute_mean_std_cross_steps:
        episode_adv = _relative(episode_scores, group_ids, mode, eps)
    else:
        first = torch.ones_like(episodes, dtype=torch.bool)
        first[1:] = episodes[1:] != episodes[:-1]
        which = torch.cumsum(first, 0) - 1  # each step's episode number 0..E-1
        per_episode = _relative(episode_scores[first], group_ids[first], mode, eps)
        episode_adv = per_episode[which]
    _, anchor_groups = torch.unique(torch.stack([group_ids, anchors], 1), dim=0, return_inverse=True)
    return episode_adv, _relative(step_returns, anchor_groups, mode, eps)


def reinforce_pp(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++: discounted reward-to-go over valid tokens, whitened over the batch's valid tokens.

    Returns:
        (B, T) advantages, zero outside ``mask``.
    """
    _check_masks(rewards, mask)
    if gamma < 0:
        raise ValueError(f"`gamma` must be >= 0, got {gamma}")
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t]
        running = torch.where(valid, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, 0.0)
    return masked_whiten(returns, mask)


# ------------------------------------------------------------------------------------------ plugins
class Advantage(ABC):
    """Base class of advantage estimators (entry-point group ``ragen_pl.advantages``)."""

    #: Whether the estimator reads ``batch.values``; the module builds a critic only when it does.
    needs_critic: ClassVar[bool] = False
    #: Whether it compares trajectories inside a group (then ``data.group_size`` must be >= 2).
    needs_groups: ClassVar[bool] = False

    @abstractmethod
    def __call__(self, batch: TrajectoryBatch) -> tuple[Tensor, Tensor | None]:
        """Return ``(advantages, returns)``: (B, T) each, zero outside the loss mask; returns None without critic."""

    def metrics(self) -> dict[str, Tensor]:
        """Diagnostics of the latest call, logged with the update's metrics (say, GiGPO's anchor group sizes)."""
        return {}


def _values_of(batch: TrajectoryBatch, name: str) -> Tensor:
    if batch.values is None:
        raise ValueError(f"{name} needs critic values (`batch.values`), but the batch has none")
    return batch.values


class GAE(Advantage):
    """Token-level GAE with a critic (PPO). The paper uses gamma = lambda = 1."""

    needs_critic = True

    def __init__(self, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> None:
        """
        Args:
            gamma: discount per sampled token.
            lam: GAE lambda.
            whiten: normalise advantages to zero mean and unit variance over the batch's sampled tokens.
        """
        _check_unit("gamma", gamma)
        _check_unit("lam", lam)
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def __call__(self, batch: TrajectoryBatch) -> tuple[Tensor, Tensor]:
        st = batch.stitch  # turns as rows: GAE runs over each trajectory's rows laid end to end
        adv, ret = gae(st(batch.rewards), st(_values_of(batch, "GAE")), st(batch.loss_mask), self.gamma, self.lam)
        adv, ret = batch.unstitch(adv), batch.unstitch(ret)
        return (masked_whiten(adv, batch.loss_mask) if self.whiten else adv), ret


class BiLevelGAE(Advantage):
    """Turn-level GAE across turns and token-level GAE inside a turn (the paper's bi-level variant).

    Where a turn ends is the one choice that differs between implementations:

    * ``segments="rewarded"`` (default, RAGEN's ``compute_bi_level_gae_advantage_return``): a turn ends at every
      sampled token with a non-zero reward, and one ``lam`` serves both levels. A turn whose reward is exactly 0
      therefore merges into the next one, and with a single reward on the last token this is token-level GAE. RAGEN's
      loop raises IndexError when the last sampled token has no reward; here that token simply ends the episode
      (the value after it is 0), as the last token does in plain GAE.
    * ``segments="turn_ids"``: a turn ends at the last sampled token of each model turn, whatever its reward, and
      ``lam_turn`` may differ from ``lam``.

    With turn rewards [1, 0, 2], zero values and ``gamma_turn=0.5``, ``rewarded`` gives the tokens of the three turns
    advantages 2, 2, 2 (turns 1 and 2 are one segment: 1 + 0.5 * 2), while ``turn_ids`` gives 1.5, 1, 2.
    """

    needs_critic = True

    def __init__(
        self,
        gamma_turn: float = 0.95,
        gamma_token: float = 1.0,
        lam: float = 1.0,
        segments: Literal["rewarded", "turn_ids"] = "rewarded",
        lam_turn: float | None = None,
        whiten: bool = True,
    ) -> None:
        """
        Args:
            gamma_turn: discount across turns (0.95 in the paper).
            gamma_token: discount across tokens inside a turn (1.0 in the paper).
            lam: GAE lambda inside a turn, and across turns unless ``lam_turn`` is set.
            segments: where turns end: ``rewarded`` tokens (RAGEN's rule) or the model's own ``turn_ids``.
            lam_turn: GAE lambda across turns (only with ``segments="turn_ids"``); None uses ``lam``.
            whiten: normalise advantages over the batch's sampled tokens.
        """
        for name, v in (("gamma_turn", gamma_turn), ("gamma_token", gamma_token), ("lam", lam)):
            _check_unit(name, v)
        if segments not in ("rewarded", "turn_ids"):
            raise ValueError(f"`segments` must be 'rewarded' or 'turn_ids', got {segments!r}")
        if lam_turn is not None:
            _check_unit("lam_turn", lam_turn)
            if segments == "rewarded":
                raise ValueError("`lam_turn` needs `segments: turn_ids` (RAGEN's rule uses one lambda, `lam`)")
        self.gamma_turn, self.gamma_token, self.lam = gamma_turn, gamma_token, lam
        self.segments, self.lam_turn, self.whiten = segments, lam_turn, whiten

    def __call__(self, batch: TrajectoryBatch) -> tuple[Tensor, Tensor]:
        st = batch.stitch
        rewards, mask = st(batch.rewards), st(batch.loss_mask)
        ends = (rewards != 0) & mask if self.segments == "rewarded" else st(batch.turn_ends)
        lam_turn = self.lam if self.lam_turn is None else self.lam_turn
        adv, ret = bilevel_gae(rewards, st(_values_of(batch, "BiLevelGAE")), mask, ends,
                               self.gamma_turn, lam_turn, self.gamma_token, self.lam)
        adv, ret = batch.unstitch(adv), batch.unstitch(ret)
        return (masked_whiten(adv, batch.loss_mask) if self.whiten else adv), ret


class GRPO(Advantage):
    """Group-normalised trajectory reward, broadcast to the trajectory's sampled tokens (no critic)."""

    needs_groups = True

    def __init__(self, scale: Literal["group", "batch", "none"] = "group", eps: float = 1e-6) -> None:
        """
        Args:
            scale: divide by the group's std (``group``, GRPO), the batch's std (``batch``), or not at all
                (``none``, the Dr. GRPO variant).
            eps: added to the std before dividing.
        """
        if scale not in ("group", "batch", "none"):
            raise ValueError(f"`scale` must be one of 'group', 'batch', 'none', got {scale!r}")
        self.scale, self.eps = scale, eps

    def __call__(self, batch: TrajectoryBatch) -> tuple[Tensor, None]:
        return _grouped(grpo, batch, scale=self.scale, eps=self.eps), None


class DrGRPO(Advantage):
    """Dr. GRPO's advantage (Liu et al. 2025): the reward minus its group's mean, with no division by the group's
    std (which up-weights the easiest and hardest prompts). Pair it with ``--model.ppo.loss_agg
    seq-mean-token-sum-norm`` (no per-sequence length normalisation): ``configs/variants/dr_grpo.yaml``."""

    needs_groups = True

    def __call__(self, batch: TrajectoryBatch) -> tuple[Tensor, None]:
        return _grouped(grpo, batch, scale="none"), None


class RLOO(Advantage):
    """REINFORCE with a leave-one-out group baseline (no critic)."""

    needs_groups = True

    def __call__(self, batch: TrajectoryBatch) -> tuple[Tensor, None]:
        return _grouped(rloo, batch), None


class ReinforcePP(Advantage):
    """REINFORCE++: token-level reward-to-go, normalised over the batch (no critic)."""

    def __init__(self, gamma: float = 1.0) -> None:
        """
        Args:
            gamma: discount per sampled token.
        """
        _check_unit("gamma", gamma)
        self.gamma = gamma

    def __call__(self, batch: TrajectoryBatch) -> tuple[Tensor, None]:
        st = batch.stitch
        return batch.unstitch(reinforce_pp(st(batch.rewards), st(batch.loss_mask), self.gamma)), None


class GiGPO(Advantage):
    """GiGPO (verl-agent): turn-level credit without a critic. Each turn's advantage is the episode-level relative
    advantage plus ``step_advantage_w`` times the step-level one, the turn's discounted return against the turns of
    its group that start in the same state (:func:`gigpo`); broadcast to the turn's sampled tokens.

    States come from the rollout (``batch.turn_states``: the env's ``state_key()``, else its observation text). A turn
    reward is the reward on the turn's sampled tokens (the env's reward plus any format penalty; with
    ``--data.rollout.reward_placement=last_turn`` all of it sits on the last turn). Groups never span processes: each
    rank plays whole groups (:class:`~ragen_pl.data.RolloutDataModule`), so the statistics are exact under DDP and
    FSDP.
    """

    needs_groups = True

    def __init__(
        self,
        step_advantage_w: float = 1.0,
        mode: Literal["mean_norm", "mean_std_norm"] = "mean_norm",
        gamma: float = 0.95,
        epsilon: float = 1e-6,
        compute_mean_std_cross_steps: bool = True,
    ) -> None:
        """
        Args:
            step_advantage_w: weight of the step-level advantage (0 leaves the episode-level one alone).
            mode: ``mean_norm`` subtracts each group's mean; ``mean_std_norm`` also divides by its std + epsilon.
            gamma: discount of the turn rewards in a turn's return.
            epsilon: added to the std before dividing.
            compute_mean_std_cross_steps: episode-level statistics over a group's turns (verl-agent's default) rather
                than over its episodes.
        """
        if mode not in ("mean_norm", "mean_std_norm"):
            raise ValueError(f"`mode` must be 'mean_norm' or 'mean_std_norm', got {mode!r}")
        _check_unit("gamma", gamma)
        if not step_advantage_w >= 0:
            raise ValueError(f"`step_advantage_w` must be >= 0, got {step_advantage_w}")
        if not epsilon >= 0:
            raise ValueError(f"`epsilon` must be >= 0, got {epsilon}")
        self.step_advantage_w, self.mode, self.gamma, self.epsilon = step_advantage_w, mode, gamma, epsilon
        self.compute_mean_std_cross_steps = compute_mean_std_cross_steps
        self._metrics: dict[str, Tensor] = {}

    def __call__(self, batch: TrajectoryBatch) -> tuple[Tensor, None]:
        if batch.turn_states is None:
            raise ValueError("GiGPO needs the state each turn started in (`batch.turn_states`), which the rollout "
                             "collector records; this batch has none")
        st = batch.stitch
        mask, turn_ids = st(batch.loss_mask), st(batch.turn_ids)
        out = torch.zeros(mask.shape, dtype=batch.rewards.dtype, device=mask.device)
        traj, pos = mask.nonzero(as_tuple=True)
        if len(traj) == 0:
            self._metrics = {}
            return batch.unstitch(out), None
        # One step per (trajectory, turn); torch.unique sorts them by trajectory, then turn.
        span = int(turn_ids[traj, pos].max()) + 1
        steps, step_of = torch.unique(traj * span + turn_ids[traj, pos], return_inverse=True)
        episodes = steps // span
        rewards = torch.zeros(len(steps), dtype=torch.float64, device=mask.device)
        rewards.index_add_(0, step_of, st(batch.rewards)[traj, pos].to(torch.float64))
        anchors = torch.zeros(len(steps), dtype=torch.long, device=mask.device)
        anchors[step_of] = st(batch.turn_states)[traj, pos]
        stats = batch.stats()
        episode_adv, step_adv = gigpo(
            stats.scores[episodes], stats.group_ids[episodes], episodes,
            discounted_step_returns(rewards, episodes, self.gamma), anchors,
            self.mode, self.epsilon, self.compute_mean_std_cross_steps)
        out[traj, pos] = (episode_adv + self.step_advantage_w * step_adv)[step_of].to(out.dtype)
        _, anchor_groups, sizes = torch.unique(torch.stack([stats.group_ids[episodes], anchors], 1), dim=0,
                                               return_inverse=True, return_counts=True)
        self._metrics = {
            "gigpo/anchor_group_size": sizes.double().mean(),
            "gigpo/grouped_turn_frac": (sizes[anchor_groups] > 1).double().mean(),
            "gigpo/step_adv_abs_mean": step_adv.abs().mean(),
        }
        return batch.unstitch(out), None

    def metrics(self) -> dict[str, Tensor]:
        return dict(self._metrics)
