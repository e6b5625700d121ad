"""Plain REINFORCE: every sampled token gets its trajectory's total reward (no baseline, no critic)."""

from __future__ import annotations

from torch import Tensor

from ragen_pl.advantages import Advantage
from ragen_pl.types import TrajectoryBatch


class Reinforce(Advantage):
    def __call__(self, batch: TrajectoryBatch) -> tuple[Tensor, None]:
        return batch.scores[:, None] * batch.loss_mask, None
