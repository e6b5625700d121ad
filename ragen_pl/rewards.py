"""Trajectory reward normalisation, as in RAGEN's reference code.

Scores (one per trajectory, env rewards plus format penalties: the penalty is added *before* normalising, so a
malformed answer stays worse than its group) are normalised inside a grouping: by initial state (``state``, the
group id), by env tag (``tag``), or over the whole batch (``batch``). Methods: ``identity``; ``mean_std``,
``(s - mean) / (std + eps)``; ``mean_std_clip``, the same clipped to ``[-1, 3]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ragen_pl.config import check_choice
from ragen_pl.ops import group_stats
from ragen_pl.types import RewardGrouping, RewardMethod

CLIP_RANGE = (-1.0, 3.0)


def normalize_scores(
    scores: Tensor,
    group_ids: Tensor,
    env_tags: Sequence[str],
    grouping: RewardGrouping = "state",
    method: RewardMethod = "identity",
    eps: float = 1e-6,
) -> Tensor:
    """Normalise (B,) trajectory scores. A group of one has std 0 and so normalises to 0.

    Raises:
        ValueError: an unknown ``grouping`` or ``method``, or inputs of different lengths.
    """
    check_choice("--model.reward_norm.grouping", grouping, RewardGrouping)
    check_choice("--model.reward_norm.method", method, RewardMethod)
    if not (scores.shape == group_ids.shape == (len(env_tags),)):
        raise ValueError(
            f"scores, group_ids and env_tags must all have length B, got {tuple(scores.shape)}, "
            f"{tuple(group_ids.shape)}, {len(env_tags)}"
        )
    if method == "identity":
        return scores
    if grouping == "state":
        keys = group_ids
    elif grouping == "tag":
        names = {t: i for i, t in enumerate(dict.fromkeys(env_tags))}
        keys = torch.tensor([names[t] for t in env_tags], device=scores.device)
    else:
        keys = torch.zeros_like(group_ids)
    mean, std, _ = group_stats(scores, keys)
    out = (scores - mean) / (std + eps)
    if method == "mean_std_clip":
        out = out.clamp(*CLIP_RANGE)
    return out.to(scores.dtype)


@dataclass
class RewardNorm:
    """How trajectory scores are normalised before advantages (RAGEN's ``reward_normalization``)."""

    grouping: RewardGrouping = "state"
    """Normalise inside groups of the same initial state, the same env tag, or the whole batch."""
    method: RewardMethod = "identity"
    """``identity`` (off), ``mean_std``, or ``mean_std_clip`` (clipped to [-1, 3])."""
    eps: float = 1e-6
    """Added to the std before dividing."""

    def __post_init__(self) -> None:
        normalize_scores(torch.zeros(1), torch.zeros(1, dtype=torch.long), ["x"], self.grouping, self.method)

    def __call__(self, scores: Tensor, group_ids: Tensor, env_tags: Sequence[str]) -> Tensor:
        return normalize_scores(scores, group_ids, env_tags, self.grouping, self.method, self.eps)
