"""Two-armed bandit (single turn, stochastic), as in RAGEN.

Two arms whose names carry meaning (default ``Phoenix`` and ``Dragon``). The low-risk arm pays 0.1 always; the
high-risk arm pays 1.0 with probability 0.25, else 0 (expected 0.25, so it is the better arm). Which arm is shown
first is shuffled per seed. Success means choosing the high-risk arm. The episode ends after one valid choice.

The instructions are RAGEN's by default: they tell the model that each arm's payouts relate to its name and ask it
to reason about the names' symbolic meaning (the paper's experiment on prior knowledge); ``symbolic_hint=False``
gives neutral instructions instead.
"""

from __future__ import annotations

import random

from ragen_pl.envs.base import Env, StepResult, check_range


class Bandit(Env):
    def __init__(
        self,
        low_arm: str = "Phoenix",
        high_arm: str = "Dragon",
        low_reward: float = 0.1,
        high_reward: float = 1.0,
        high_prob: float = 0.25,
        symbolic_hint: bool = True,
        tag: str | None = None,
    ) -> None:
        """
        Args:
            low_arm: name of the low-risk arm (the test variant uses ``Trader``).
            high_arm: name of the high-risk arm (the test variant uses ``Librarian``).
            low_reward: what the low-risk arm always pays.
            high_reward: what the high-risk arm pays when it pays.
            high_prob: probability that the high-risk arm pays.
            symbolic_hint: RAGEN's instructions (payouts relate to the arms' names; reason about their meaning).
            tag: metrics tag (default ``Bandit``).
        """
        super().__init__(tag)
        for field, name in (("low_arm", low_arm), ("high_arm", high_arm)):
            if not isinstance(name, str) or not name.strip() or "||" in name:
                raise ValueError(f"`{field}` must be a non-empty name without '||', got {name!r}")
        if low_arm.strip().lower() == high_arm.strip().lower():
            raise ValueError(f"`low_arm` and `high_arm` must differ (case-insensitively), both are {low_arm!r}")
        check_range("high_prob", high_prob, 0.0, 1.0)
        if not isinstance(symbolic_hint, bool):
            raise TypeError(f"`symbolic_hint` must be true or false, got {symbolic_hint!r}")
        self.symbolic_hint = symbolic_hint
        self.low_arm, self.high_arm = low_arm.strip(), high_arm.strip()
        self.low_reward, self.high_reward, self.high_prob = float(low_reward), float(high_reward), float(high_prob)
        self._rng = random.Random(0)
        self.actions = (self.low_arm, self.high_arm)
        self._order = self.actions
        self._done = False
        self._chosen: str | None = None

    @property
    def instructions(self) -> str:
        a, b = self._order
        if self.symbolic_hint:  # RAGEN's wording
            return (
                "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull.\n"
                "Game Rules:\n"
                f"1. There are 2 arms, named {a} and {b}\n"
                "2. Each arm has its own reward distribution, related to their names.\n"
                "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might "
                "behave.\n"
                "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher "
                f"rewards on average? Choose between {a} and {b}, and output like <answer> {a} </answer> or "
                f"<answer> {b} </answer>."
            )
        return (
            "You are playing a bandit game. You pull one of two arms; each arm pays a reward drawn from its own "
            "distribution, and your goal is to maximise the reward.\n"
            f"Actions: {a}, {b} (answer with the name of the arm to pull)."
        )

    def reset(self, seed: int) -> str:
        self._rng = random.Random(seed)
        self._order = (self.low_arm, self.high_arm) if self._rng.random() < 0.5 else (self.high_arm, self.low_arm)
        self._done = False
        self._chosen = None
        return self.render()

    def state_key(self) -> tuple:
        """The order the arms are shown in and the arm pulled (None before the pull)."""
        return self._order, self._chosen

    def render(self) -> str:
        if self._chosen is not None:
            return f"You pulled {self._chosen}."
        return f"Two arms: {self._order[0]} and {self._order[1]}. Which arm do you pull?"

    def expert_action(self) -> str:
        return self.high_arm

    def step(self, action: str) -> StepResult:
        index = self.parse_action(action)
        if index is None or self._done:
            return self.invalid(self.render())
        high = index == 1
        if high:
            reward = self.high_reward if self._rng.random() < self.high_prob else 0.0
        else:
            reward = self.low_reward
        self._chosen = self.actions[index]
        self._done = True
        return self.render(), reward, True, {"success": high, "action_is_valid": True, "action_is_effective": True}
