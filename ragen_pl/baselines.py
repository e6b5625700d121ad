"""Reference policies an evaluation is read against: the random and the optimal policy's success on the same seeds.

A success of 0.25 says little alone: on RAGEN's FrozenLake random play already succeeds about a fifth of the time,
and the best possible policy under slips only about half. Every evaluation logs both beside the model's success
(``val/<env>/random_success``, ``val/<env>/optimal_success``; computed once per run): :func:`random_success` plays
uniformly random actions of a discrete env, :func:`optimal_success` the env's ``expert_action()`` (a solver:
FrozenLake's value iteration, Sokoban's search), each with the run's per-episode action budget. Both are optional:
an env without named actions has no random policy here, one without ``expert_action()`` no optimal one.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable

from ragen_pl.envs.base import Env

__all__ = ["optimal_success", "random_success", "reference_success"]


def _success(env: Env, seeds: Iterable[int], budget: int, choose: Callable[[Env], str], repeats: int) -> float | None:
    """The share of episodes ``choose`` succeeds in: ``repeats`` plays of each seed, each at most ``budget`` actions,
    on a copy of ``env``. An episode whose env raises is left out, as the rollout leaves out a failed episode."""
    env = copy.deepcopy(env)
    wins, plays = 0, 0
    for s in seeds:
        for _ in range(repeats):
            try:
                env.reset(s)
                success = False
                for _ in range(budget):
                    _, _, done, info = env.step(choose(env))
                    success = success or bool(info.get("success"))
                    if done:
                        break
            except NotImplementedError:
                raise  # the policy is missing (no expert), not the env failing
            except Exception:  # noqa: BLE001 - the env's own failure: not a play of the policy
                continue
            finally:
                env.close()
            wins, plays = wins + success, plays + 1
    return wins / plays if plays else None


def random_success(env: Env, seeds: Iterable[int], budget: int, repeats: int = 4, seed: int = 0) -> float | None:
    """Uniformly random actions' success (:func:`_success`, ``repeats`` plays per seed). None for a free-text env (no
    action list), or when no episode could be played."""
    if env.actions is None:
        return None
    rng = random.Random(seed)
    return _success(env, seeds, budget, lambda e: rng.choice(e.actions), repeats)


def optimal_success(env: Env, seeds: Iterable[int], budget: int) -> float | None:
    """The expert's (``env.expert_action()``) success, one play per seed (an env's own randomness is fixed by its
    seed, so a deterministic expert plays each seed alike). None where the env ships no expert."""
    try:
        return _success(env, seeds, budget, lambda e: e.expert_action(), 1)
    except NotImplementedError:
        return None


def reference_success(env: Env, seeds: Iterable[int], budget: int) -> dict[str, float]:
    """``{"random_success": ..., "optimal_success": ...}`` for ``env`` on ``seeds``, leaving out what it lacks."""
    seeds = list(seeds)
    found = {"random_success": random_success(env, seeds, budget), "optimal_success": optimal_success(env, seeds, budget)}
    return {k: v for k, v in found.items() if v is not None}
