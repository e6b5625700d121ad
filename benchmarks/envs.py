"""Env throughput: one line per env with episodes per second (one process).

An episode is a reset plus 10 random actions. Targets on the 2-core dev machine: Sokoban 6x6 with 1 box at least
1,000 episodes/s, FrozenLake 4x4 at least 5,000 episodes/s (rollouts reset hundreds of envs per iteration, so env
time must stay negligible next to generation).

    python benchmarks/envs.py [--episodes 3000]
"""

from __future__ import annotations

import argparse
import random
import time

from ragen_pl.envs.bandit import Bandit
from ragen_pl.envs.countdown import Countdown
from ragen_pl.envs.frozen_lake import FrozenLake
from ragen_pl.envs.sokoban import Sokoban

TARGETS = {"sokoban 6x6 1 box": 1000, "frozen_lake 4x4": 5000}


def episodes_per_second(env, episodes: int, actions: list[str]) -> float:
    rng = random.Random(0)
    start = time.perf_counter()
    for seed in range(episodes):
        env.reset(seed)
        for _ in range(10):
            env.step(rng.choice(actions))
    return episodes / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=3000)
    args = parser.parse_args()
    cases = [
        ("sokoban 6x6 1 box", Sokoban(), list(Sokoban.actions)),
        ("sokoban 8x8 2 boxes", Sokoban(dim_room=(8, 8), num_boxes=2), list(Sokoban.actions)),
        ("frozen_lake 4x4", FrozenLake(), list(FrozenLake.actions)),
        ("bandit", Bandit(), ["Phoenix", "Dragon"]),
        ("countdown", Countdown(), ["(1 + 2) * 3", "4 - 1", "x"]),
    ]
    print(f"{'env':<22}{'episodes/s':>12}{'target':>10}  ok")
    for name, env, actions in cases:
        n = args.episodes // 10 if "8x8" in name else args.episodes
        rate = episodes_per_second(env, n, actions)
        target = TARGETS.get(name)
        verdict = "" if target is None else ("yes" if rate >= target else "NO")
        print(f"{name:<22}{rate:>12,.0f}{target or '':>10}  {verdict}")


if __name__ == "__main__":
    main()
