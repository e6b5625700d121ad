"""Reference policies an evaluation is read against: the random policy's success on the same evaluation seeds.

A success of 0.25 says little alone: on RAGEN's FrozenLake random play already succeeds about a fifth of the time.
``random_success`` plays uniformly random actions of a discrete env with the run's per-episode action budget, on the
fixed evaluation seeds, so the run's summary can print it beside the model's success.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable

from ragen_pl.envs.base import Env

__all__ = ["random_success"]


def random_success(env: Env, seeds: Iterable[int], budget: int, repeats: int = 4, seed: int = 0) -> float | None:
    """The share of episodes uniformly random actions succeed in, ``repeats`` plays of each of ``seeds``, each at most
    ``budget`` actions (the rollout's ``max_actions_per_episode``), on a copy of ``env``. An episode whose env raises
    is left out, as the rollout leaves out a failed episode. None for a free-text env (no action list), or when no
    episode could be played."""
    if env.actions is None:
        return None
    env = copy.deepcopy(env)
    rng, wins, plays = random.Random(seed), 0, 0
    for s in seeds:
        for _ in range(repeats):
            try:
                env.reset(s)
                success = False
                for _ in range(budget):
                    _, _, done, info = env.step(rng.choice(env.actions))
                    success = success or bool(info.get("success"))
                    if done:
                        break
            except Exception:  # noqa: BLE001 - the env's own failure: not a play of the random policy
                continue
            wins, plays = wins + success, plays + 1
    return wins / plays if plays else None
