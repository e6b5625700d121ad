"""Trajectory filters (entry-point group ``ragen_pl.filters``): StarPO-S's variance-based group selection, and
RAGEN-2's SNR-adaptive family (:class:`SNR`).

A filter looks at groups (trajectories that share an initial state) and keeps whole groups. Each returns a (B,)
bool mask of kept trajectories plus diagnostics: the kept fraction of groups and the mean in-group reward std before
and after filtering (the paper's early-warning signal for the Echo Trap).

Owned by :class:`ragen_pl.data.RolloutDataModule`: filters decide which trajectories reach the update.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ragen_pl.ops import group_stats
from ragen_pl.types import TrajectoryBatch, TrajectoryStats

__all__ = [
    "SNR",
    "AdaptiveVariance",
    "DropZeroVariance",
    "Filter",
    "FilterResult",
    "NoFilter",
    "VarianceTopP",
    "group_metric",
    "select_groups",
]

RankBy = Literal["reward_std", "reward_mean", "length", "sampled_nll"]
KeepMode = Literal["top_p", "top_k", "min_value"]


@dataclass
class FilterResult:
    keep: Tensor
    """(B,) bool: trajectories that go on to the update."""
    metrics: dict[str, Tensor]


def _group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Sorted unique group ids and each trajectory's position among them."""
    return torch.unique(group_ids, return_inverse=True)


def _stats(x: TrajectoryBatch | TrajectoryStats) -> TrajectoryStats:
    return x.stats() if isinstance(x, TrajectoryBatch) else x


def group_metric(batch: TrajectoryBatch | TrajectoryStats, rank_by: RankBy = "reward_std") -> Tensor:
    """(G,) per-group statistic, groups in ascending group-id order.

    ``reward_std``: unbiased std of the trajectory rewards inside the group; ``reward_mean``: their mean;
    ``length``: mean number of sampled tokens; ``sampled_nll``: mean of ``-old_logprobs`` over sampled tokens, the
    Monte-Carlo estimate of the policy's token entropy.
    """
    stats = _stats(batch)
    _, inverse = _group_index(stats.group_ids)
    G = int(inverse.max()) + 1
    if rank_by in ("reward_std", "reward_mean"):
        mean, std, _ = group_stats(stats.scores, stats.group_ids)
        per_traj = std if rank_by == "reward_std" else mean
    elif rank_by == "length":
        per_traj = stats.lengths.double()
    elif rank_by == "sampled_nll":
        if stats.entropy is None:
            raise ValueError("rank_by='sampled_nll' needs `old_logprobs` in the batch")
        per_traj = stats.entropy.double()
    else:
        raise ValueError(f"`rank_by` must be one of reward_std, reward_mean, length, sampled_nll, got {rank_by!r}")
    total = torch.zeros(G, dtype=torch.float64, device=per_traj.device).index_add_(0, inverse, per_traj.double())
    count = torch.zeros_like(total).index_add_(0, inverse, torch.ones_like(per_traj, dtype=torch.float64))
    return total / count


def select_groups(stat: Tensor, mode: KeepMode, value: float, reverse: bool = False) -> Tensor:
    """(G,) bool mask of kept groups.

    ``top_p``: keep ``ceil(value * G)`` groups (at least one) with the highest statistic (lowest if ``reverse``).
    ``top_k``: keep ``min(value, G)`` such groups. ``min_value``: keep groups with ``stat >= value``
    (``<= value`` if ``reverse``). Ties break towards the lower group id, so the result is deterministic.
    """
    G = stat.numel()
    if mode == "min_value":
        return stat <= value if reverse else stat >= value
    if mode == "top_p":
        # The tolerance keeps float noise (0.25 * 8 = 2.0000000001) from adding a group.
        k = max(1, math.ceil(value * G - 1e-9))
    elif mode == "top_k":
        k = min(int(value), G)
    else:
        raise ValueError(f"`mode` must be one of top_p, top_k, min_value, got {mode!r}")
    order = torch.sort(stat if reverse else -stat, stable=True).indices
    keep = torch.zeros(G, dtype=torch.bool, device=stat.device)
    keep[order[:k]] = True
    return keep


class Filter(ABC):
    """Base class of trajectory filters (entry-point group ``ragen_pl.filters``).

    ``loss_scale(kept_frac)`` is what the data module multiplies the kept trajectories' advantages by (1: none);
    ``empty_stop_steps`` ends training after that many iterations in a row kept nothing (None: never).
    """

    empty_stop_steps: int | None = None

    def loss_scale(self, kept_frac: float) -> float:
        return 1.0

    def ranks_by_spread(self) -> bool:
        """Whether the filter ranks groups by how their trajectories differ (reward or entropy spread): with one
        trajectory a group every spread is 0, and the groups kept would be arbitrary."""
        return False

    def __call__(self, batch: TrajectoryBatch | TrajectoryStats) -> FilterResult:
        """Select groups. ``keep`` is over the batch's rows, or over the entries of :class:`TrajectoryStats` (pass
        all-gathered stats to select across ranks)."""
        rows = batch.trajectory_index()[0] if isinstance(batch, TrajectoryBatch) else None
        batch = _stats(batch)
        _, inverse = _group_index(batch.group_ids)
        keep_groups = self.select(batch)
        keep = keep_groups[inverse]
        if rows is not None:
            keep = keep[rows]
        std = group_metric(batch, "reward_std")
        kept_std = std[keep_groups]
        metrics = {
            "filter/kept_frac": keep_groups.double().mean(),
            "filter/reward_std_before": std.mean(),
            "filter/reward_std_after": kept_std.mean() if kept_std.numel() else std.new_zeros(()),
        }
        return FilterResult(keep, metrics)

    @abstractmethod
    def select(self, batch: TrajectoryStats) -> Tensor:
        """(G,) bool mask over the batch's groups, in ascending group-id order."""


class NoFilter(Filter):
    """Keep every group (vanilla StarPO)."""

    def select(self, batch: TrajectoryStats) -> Tensor:
        return torch.ones(batch.group_ids.unique().numel(), dtype=torch.bool, device=batch.group_ids.device)


class VarianceTopP(Filter):
    """Keep the groups whose in-group reward std is highest (StarPO-S keeps the top 25%).

    Other statistics and keep rules are options, so the paper's ablations are configs.
    """

    def __init__(
        self,
        top_p: float = 0.25,
        rank_by: RankBy = "reward_std",
        mode: KeepMode = "top_p",
        top_k: int | None = None,
        min_value: float | None = None,
        reverse: bool = False,
    ) -> None:
        """
        Args:
            top_p: share of groups to keep with ``mode="top_p"``, in (0, 1].
            rank_by: per-group statistic to rank by.
            mode: keep a share (``top_p``), a count (``top_k``) or every group above a value (``min_value``).
            top_k: number of groups to keep with ``mode="top_k"``.
            min_value: threshold with ``mode="min_value"``.
            reverse: keep the lowest-ranked groups instead (an ablation in the paper).
        """
        if mode not in ("top_p", "top_k", "min_value"):
            raise ValueError(f"`mode` must be one of top_p, top_k, min_value, got {mode!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {top_p}")
        if mode == "top_k" and (top_k is None or top_k < 1):
            raise ValueError(f"`top_k` must be an integer >= 1 with mode='top_k', got {top_k!r}")
        if mode == "min_value" and min_value is None:
            raise ValueError("`min_value` must be set with mode='min_value'")
        if rank_by not in ("reward_std", "reward_mean", "length", "sampled_nll"):
            raise ValueError(f"`rank_by` must be one of reward_std, reward_mean, length, sampled_nll, got {rank_by!r}")
        self.top_p, self.rank_by, self.mode = top_p, rank_by, mode
        self.top_k, self.min_value, self.reverse = top_k, min_value, reverse

    def ranks_by_spread(self) -> bool:
        return self.rank_by == "reward_std"

    def select(self, batch: TrajectoryStats) -> Tensor:
        value = {"top_p": self.top_p, "top_k": self.top_k, "min_value": self.min_value}[self.mode]
        return select_groups(group_metric(batch, self.rank_by), self.mode, value, self.reverse)  # type: ignore[arg-type]


class DropZeroVariance(Filter):
    """Keep only groups whose rewards differ (std > ``eps``): a group with equal rewards has no GRPO signal."""

    def __init__(self, eps: float = 1e-6) -> None:
        """
        Args:
            eps: groups with in-group reward std at or below this are dropped.
        """
        if eps < 0:
            raise ValueError(f"`eps` must be >= 0, got {eps}")
        self.eps = eps

    def select(self, batch: TrajectoryStats) -> Tensor:
        return group_metric(batch, "reward_std") > self.eps

    def ranks_by_spread(self) -> bool:
        return True


class AdaptiveVariance(Filter):
    """Keep a share of groups set each iteration by how the in-group reward std is spread.

    The paper keeps a fixed 25% and calls the ratio empirical; it suggests adapting it. The rule here: a group is
    *informative* when its std is at least ``rel_threshold`` times the largest std in the batch. The kept share
    is the informative share, clamped to ``[min_p, max_p]``, and the top groups by std are kept. When a few groups
    carry all the signal (the Echo Trap's onset, most stds near zero) few are kept; when signal is spread evenly
    most are kept, so no informative group is thrown away for a fixed quota. If every std is 0 there is no signal
    and ``min_p`` is kept.
    """

    def __init__(self, min_p: float = 0.25, max_p: float = 1.0, rel_threshold: float = 0.5) -> None:
        """
        Args:
            min_p: smallest share of groups kept, in (0, 1].
            max_p: largest share of groups kept, in [min_p, 1].
            rel_threshold: a group is informative when its std >= this times the batch's largest std, in (0, 1].
        """
        if not 0 < min_p <= max_p <= 1:
            raise ValueError(f"need 0 < `min_p` <= `max_p` <= 1, got min_p={min_p}, max_p={max_p}")
        if not 0 < rel_threshold <= 1:
            raise ValueError(f"`rel_threshold` must be in (0, 1], got {rel_threshold}")
        self.min_p, self.max_p, self.rel_threshold = min_p, max_p, rel_threshold

    def ranks_by_spread(self) -> bool:
        return True

    def kept_share(self, std: Tensor) -> float:
        top = float(std.max()) if std.numel() else 0.0
        informative = float((std >= self.rel_threshold * top).double().mean()) if top > 0 else 0.0
        return min(max(informative, self.min_p), self.max_p)

    def select(self, batch: TrajectoryStats) -> Tensor:
        std = group_metric(batch, "reward_std")
        return select_groups(std, "top_p", self.kept_share(std))


GroupScore = Literal["reward_variance", "reward", "reward_sum", "sampled_nll", "sampled_nll_variance", "length"]
"""RAGEN-2's group scores. Its ``entropy`` / ``entropy_variance`` read the exact token entropy from the logits; the
figure here is each trajectory's mean negative log-likelihood of its sampled tokens (a Monte-Carlo estimate of that
entropy, from the log-probs the batch carries), so it is named ``sampled_nll`` / ``sampled_nll_variance``."""


def group_scores(stats: TrajectoryStats, metric: GroupScore) -> Tensor:
    """(G,) RAGEN-2's per-group score, groups in ascending id order: ``reward_variance`` is the in-group reward std
    (RAGEN-2's name, its value), ``reward`` / ``reward_sum`` the in-group mean / sum of rewards, ``sampled_nll`` the
    in-group mean of each trajectory's mean sampled-token negative log-likelihood (a Monte-Carlo estimate of its token
    entropy) and ``sampled_nll_variance`` its in-group std, ``length`` the
    in-group mean of sampled tokens."""
    _, inverse = _group_index(stats.group_ids)
    G = int(inverse.max()) + 1

    def per_group(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # (G,) sum, mean, unbiased std
        x = x.double()
        count = torch.zeros(G, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(x))
        total = torch.zeros(G, dtype=torch.float64).index_add_(0, inverse, x)
        mean = total / count
        sq = torch.zeros(G, dtype=torch.float64).index_add_(0, inverse, (x - mean[inverse]) ** 2)
        return total, mean, (sq / (count - 1).clamp(min=1)).sqrt()

    if metric in ("sampled_nll", "sampled_nll_variance"):
        if stats.entropy is None:
            raise ValueError(f"`metric: {metric}` needs the rollout's log-probs (the engine reports them)")
        _, mean, std = per_group(stats.entropy)
        return mean if metric == "sampled_nll" else std
    if metric == "length":
        return per_group(stats.lengths)[1]
    total, mean, std = per_group(stats.scores)
    return {"reward_variance": std, "reward": mean, "reward_sum": total}[metric]


def snr_select(scores: Tensor, strategy: str, value: float, keep: str = "largest", include_zero: bool = True,
               top_p_mode: str = "linear", selection_eps: float = 0.01) -> Tensor:
    """(G,) bool mask of the groups RAGEN-2's rollout filter keeps, given their (G,) ``scores``.

    Candidates: every group, or (``include_zero=False``) those whose score is not 0. Then ``top_p``: ``value >= 1``
    keeps every candidate; ``linear`` takes candidates in score order (largest or smallest first) until their summed
    score reaches ``value * sum - selection_eps`` (stopping at a score <= 0) and keeps none if it never does;
    ``softmax`` keeps the fewest whose softmax mass (of the scores, negated for ``smallest``) reaches ``value``.
    ``top_k``: the best ``int(value * G)`` (at least 1); ``top_k_abs``: the best ``int(value)``; ``min_p``: scores
    >= ``value`` x the best (``smallest``: <= the least / ``value``). Ties go to the lower group id.
    """
    G = scores.numel()
    scores = scores.double()
    index = torch.arange(G)
    if not include_zero:
        index = index[scores.abs() > 1e-10]
    cand = scores[index]
    keep_mask = torch.zeros(G, dtype=torch.bool)
    if index.numel() == 0:
        return keep_mask
    order = torch.sort(-cand if keep == "largest" else cand, stable=True).indices  # best first
    if strategy == "top_p":
        if value >= 1.0:
            chosen = index
        elif top_p_mode == "softmax":
            probs = torch.softmax(cand if keep == "largest" else -cand, 0)
            sorted_probs, by_prob = torch.sort(probs, descending=True, stable=True)
            k = min(int(torch.searchsorted(torch.cumsum(sorted_probs, 0), torch.tensor(value, dtype=torch.float64))) + 1,
                    index.numel())
            chosen = index[by_prob[:k]]
        else:
            threshold = value * float(cand.sum()) - selection_eps
            total, count = 0.0, 0
            for score in cand[order].tolist():
                if total >= threshold or score <= 0:
                    break
                total, count = total + score, count + 1
            chosen = index[order[:count]] if total >= threshold else index[:0]
    elif strategy in ("top_k", "top_k_abs"):
        k = int(value * G) if strategy == "top_k" else int(value)
        chosen = index[order[:max(min(k, index.numel()), 1)]]
    elif strategy == "min_p":
        if keep == "largest":
            chosen = index[cand >= float(cand.max()) * value - 1e-10]
        else:
            chosen = index[cand <= float(cand.min()) / (value + 1e-10) + 1e-10]
    else:
        raise ValueError(f"`strategy` must be one of top_p, top_k, top_k_abs, min_p, got {strategy!r}")
    keep_mask[chosen] = True
    return keep_mask


class SNR(Filter):
    """RAGEN-2's SNR-adaptive rollout filter: rank groups by a score (reward std by default) and keep them by one of
    four rules (see :func:`snr_select`); RAGEN-2 recommends ``top_p`` 0.9, ``linear``, ``include_zero: false``.

    Its ``loss_scaling`` multiplies the kept trajectories' advantages by the kept share of groups (``linear``) or
    its square root (``sqrt``), as RAGEN-2 does after computing advantages. An iteration whose filter keeps nothing
    is skipped (no update); ``empty_stop_steps`` of those in a row end training.
    """

    def __init__(
        self,
        strategy: Literal["top_p", "top_k", "top_k_abs", "min_p"] = "top_p",
        value: float = 1.0,
        metric: GroupScore = "reward_variance",
        keep: Literal["largest", "smallest"] = "largest",
        include_zero: bool = True,
        top_p_mode: Literal["linear", "softmax"] = "linear",
        selection_eps: float = 0.01,
        loss_scaling: Literal["none", "linear", "sqrt"] = "none",
        empty_stop_steps: int | None = 5,
    ) -> None:
        """
        Args:
            strategy: ``top_p`` (score or softmax mass), ``top_k`` (a share of groups), ``top_k_abs`` (a count) or
                ``min_p`` (a share of the best score).
            value: the strategy's parameter: the mass share, group share, count or score share.
            metric: the per-group score ranked.
            keep: keep the ``largest`` scores or the ``smallest``.
            include_zero: whether groups whose score is 0 are candidates.
            top_p_mode: ``top_p``'s rule: ``linear`` score sums or ``softmax`` mass.
            selection_eps: subtracted from ``linear`` top-p's threshold.
            loss_scaling: scale advantages by the kept share (``linear``), its square root, or not.
            empty_stop_steps: stop training after this many iterations in a row that kept nothing (null: never).
        """
        from ragen_pl.config import check_choice

        check_choice("--data.filter.strategy", strategy, ("top_p", "top_k", "top_k_abs", "min_p"))
        check_choice("--data.filter.metric", metric, GroupScore)
        check_choice("--data.filter.keep", keep, ("largest", "smallest"))
        check_choice("--data.filter.top_p_mode", top_p_mode, ("linear", "softmax"))
        check_choice("--data.filter.loss_scaling", loss_scaling, ("none", "linear", "sqrt"))
        if strategy == "top_k_abs":
            if value < 1 or value != int(value):
                raise ValueError(f"`--data.filter.value` must be a whole number >= 1 for top_k_abs, got {value}")
        elif not 0 < value <= (1e9 if strategy == "top_p" else 1):
            raise ValueError(f"`--data.filter.value` must be in (0, 1] for {strategy}, got {value}")
        if selection_eps < 0:
            raise ValueError(f"`--data.filter.selection_eps` must be >= 0, got {selection_eps}")
        if empty_stop_steps is not None and empty_stop_steps < 1:
            raise ValueError(f"`--data.filter.empty_stop_steps` must be >= 1 or null, got {empty_stop_steps}")
        self.strategy, self.value, self.metric, self.keep = strategy, value, metric, keep
        self.include_zero, self.top_p_mode, self.selection_eps = include_zero, top_p_mode, selection_eps
        self.loss_scaling, self.empty_stop_steps = loss_scaling, empty_stop_steps

    def ranks_by_spread(self) -> bool:
        return self.metric in ("reward_variance", "sampled_nll_variance")

    def select(self, batch: TrajectoryStats) -> Tensor:
        return snr_select(group_scores(batch, self.metric), self.strategy, self.value, self.keep, self.include_zero,
                          self.top_p_mode, self.selection_eps)

    def loss_scale(self, kept_frac: float) -> float:
        if self.loss_scaling == "linear":
            return kept_frac
        if self.loss_scaling == "sqrt":
            return math.sqrt(kept_frac)
        return 1.0

