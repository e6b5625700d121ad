"""Env throughput, and each env's difficulty beside RAGEN's own figures (issue 11).

Part 1, speed: episodes per second in one process, an episode being a reset plus 10 random actions. Targets on the
2-core dev machine: Sokoban 6x6 with 1 box at least 1,000 episodes/s, FrozenLake 4x4 at least 5,000 episodes/s
(rollouts reset hundreds of envs per iteration, so env time must stay negligible next to generation).

Part 2, distributions: the optimal-solution length over fixed seeds (Sokoban by breadth-first search, FrozenLake by
the shortest path of frozen tiles) as mean and histogram, and the success of a uniformly random policy within the
paper's 10-action budget, printed next to what RAGEN's own env code gives (measured on RAGEN v1 for issue 11).

    python benchmarks/envs.py [--episodes 3000] [--rooms 1000]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter

from ragen_pl.envs.bandit import Bandit
from ragen_pl.envs.countdown import Countdown
from ragen_pl.envs.frozen_lake import FrozenLake, shortest_path
from ragen_pl.envs.sokoban import Sokoban, solve

TARGETS = {"sokoban 6x6 1 box": 1000, "frozen_lake 4x4": 5000}
#: RAGEN v1's figures: (mean optimal solution moves, share solvable in <= 10, random-policy success in 10 actions)
RAGEN = {
    "sokoban 6x6 1 box": (3.98, 0.998, 0.161),
    "sokoban 8x8 2 boxes": (5.84, None, None),
    "frozen_lake 4x4 slippery": (2.78, None, 0.218),
}


def episodes_per_second(env, episodes: int, actions: list[str]) -> float:
    rng = random.Random(0)
    start = time.perf_counter()
    for seed in range(episodes):
        env.reset(seed)
        for _ in range(10):
            env.step(rng.choice(actions))
    return episodes / (time.perf_counter() - start)


def random_success(env, episodes: int, actions: tuple[str, ...]) -> float:
    rng = random.Random(1)
    wins = 0
    for seed in range(episodes):
        env.reset(seed)
        for _ in range(10):
            _, _, done, info = env.step(rng.choice(actions))
            if done:
                break
        wins += bool(info.get("success"))
    return wins / episodes


def optimal_lengths(env, rooms: int) -> list[int]:
    lengths = []
    for seed in range(rooms):
        env.reset(seed)
        if isinstance(env, Sokoban):
            plan = solve(env)
            lengths.append(len(plan) if plan is not None else -1)
        else:
            lengths.append(len(shortest_path(env)))
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=3000)
    parser.add_argument("--rooms", type=int, default=1000)
    args = parser.parse_args()
    cases = [
        ("sokoban 6x6 1 box", Sokoban(), list(Sokoban.actions)),
        ("sokoban 8x8 2 boxes", Sokoban(dim_room=(8, 8), num_boxes=2, search_depth=10), list(Sokoban.actions)),
        ("frozen_lake 4x4", FrozenLake(), list(FrozenLake.actions)),
        ("bandit", Bandit(), ["Phoenix", "Dragon"]),
        ("countdown", Countdown(), ["(1 + 2) * 3", "4 - 1", "x"]),
    ]
    print(f"{'env':<22}{'episodes/s':>12}{'target':>10}  ok")
    for name, env, actions in cases:
        n = args.episodes // 3 if "8x8" in name else args.episodes
        rate = episodes_per_second(env, n, actions)
        target = TARGETS.get(name)
        verdict = "" if target is None else ("yes" if rate >= target else "NO")
        print(f"{name:<22}{rate:>12,.0f}{target or '':>10}  {verdict}")

    print(f"\ndistributions over seeds 0..{args.rooms - 1} (random policy: {4 * args.rooms} episodes), ours | RAGEN's:")
    dists = [
        ("sokoban 6x6 1 box", Sokoban()),
        ("sokoban 8x8 2 boxes", Sokoban(dim_room=(8, 8), num_boxes=2, search_depth=10)),
        ("frozen_lake 4x4 slippery", FrozenLake()),
    ]
    for name, env in dists:
        lengths = optimal_lengths(env, args.rooms)
        mean = sum(lengths) / len(lengths)
        within = sum(0 <= n <= 10 for n in lengths) / len(lengths)
        rnd = random_success(env, 4 * args.rooms, env.actions)
        r_mean, r_within, r_rnd = RAGEN[name]

        def theirs(x, fmt):
            return format(x, fmt) if x is not None else "  n/a"

        print(f"{name:<26} mean optimal {mean:5.2f} | {theirs(r_mean, '5.2f')}   solvable in <= 10 {within:6.1%} | "
              f"{theirs(r_within, '6.1%')}   random policy {rnd:6.1%} | {theirs(r_rnd, '6.1%')}")
        histogram = Counter(lengths)
        print(f"{'':<26} optimal length: " + " ".join(f"{k}:{histogram[k]}" for k in sorted(histogram)))


if __name__ == "__main__":
    main()
