"""LineWorld: walk along a corridor to the goal. A minimal multi-turn env written against ragen-pl's Env API."""

from __future__ import annotations

import random

from ragen_pl.envs.base import Env, StepResult, check_int


class LineWorld(Env):
    actions = ("Left", "Right")

    def __init__(self, length: int = 6, max_steps: int = 20, tag: str | None = None) -> None:
        """
        Args:
            length: number of cells in the corridor.
            max_steps: the episode ends after this many steps.
            tag: metrics tag.
        """
        super().__init__(tag)
        check_int("length", length, 2)
        check_int("max_steps", max_steps, 1)
        self.length, self.max_steps = length, max_steps
        self.pos = self.goal = self.steps = 0

    @property
    def instructions(self) -> str:
        return "Walk along the corridor to the goal. Symbols: P player, G goal, _ floor. Actions: Left, Right."

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.pos, self.goal = rng.sample(range(self.length), 2)
        self.steps = 0
        return self.render()

    def render(self) -> str:
        return "".join("P" if i == self.pos else "G" if i == self.goal else "_" for i in range(self.length))

    def expert_action(self) -> str:
        return "Right" if self.goal > self.pos else "Left"

    def step(self, action: str) -> StepResult:
        index = self.parse_action(action)
        if index is None or self.pos == self.goal or self.steps >= self.max_steps:
            return self.invalid(self.render())
        new = min(max(self.pos + (1 if index else -1), 0), self.length - 1)
        moved, self.pos = new != self.pos, new
        self.steps += 1
        success = self.pos == self.goal
        info = {"success": success, "action_is_valid": True, "action_is_effective": moved}
        return self.render(), float(success), success or self.steps >= self.max_steps, info
