"""An env for the SIGTERM test: resets of seeds >= ``slow_from`` take a minute (a long rollout)."""

from __future__ import annotations

import time

from ragen_pl.envs.bandit import Bandit


class SlowBandit(Bandit):
    def __init__(self, slow_from: int = 2, tag: str | None = None) -> None:
        super().__init__(tag=tag)
        self.slow_from = slow_from

    def reset(self, seed: int) -> str:
        if seed >= self.slow_from:
            time.sleep(60)
        return super().reset(seed)
