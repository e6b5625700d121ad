"""Env throughput, and each env's difficulty beside RAGEN's own figures (issue 11).

Part 1, speed: episodes per second in one process, an episode being a reset plus 10 random actions. Targets on the
2-core dev machine: Sokoban 6x6 with 1 box at least 1,000 episodes/s, FrozenLake 4x4 at least 5,000 episodes/s
(rollouts reset hundreds of envs per iteration, so env time must stay negligible next to generation).

Part 2, distributions: the optimal-solution length over fixed seeds (Sokoban by breadth-first search, FrozenLake by
the shortest path of frozen tiles) as mean and histogram, and the success of a uniformly random policy within the
paper's 10-action budget, printed next to what RAGEN's own env code gives (measured on RAGEN v1 for issue 11).

Part 3, OpenEnv (``--openenv``, needs ``pip install 'ragen-pl[openenv]'``): FrozenLake served by ``ragen-pl serve`` on
127.0.0.1, played by 128 sessions at once (a rollout's 128 trajectories, each in its own session, stepped turn by
turn as the collector does), beside the same play in-process, in env steps per second; then what the server path
adds to one SmolLM2 FrozenLake iteration (32 trajectories of up to 10 one-action turns: 32 resets and 320 steps) as
a share of its time (``--iteration-s``: 31 s, the fastest such iteration recorded on this machine,
docs/experiments/smollm2_multiturn.md, 2026-12-03). Goal: under 10%.

    python benchmarks/envs.py [--episodes 3000] [--rooms 1000] [--openenv | --openenv-only] [--iteration-s 31]
"""

from __future__ import annotations

import argparse
import copy
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


def play_sessions(envs: list, rounds: int, seed: int = 0) -> tuple[float, int]:
    """Reset every env, then ``rounds`` turns of one random action each over the live ones, as the collector steps
    a rollout; return (seconds, env calls)."""
    rng = random.Random(seed)
    start, calls = time.perf_counter(), 0
    for i, env in enumerate(envs):
        env.reset(seed + i)
        calls += 1
    live = list(envs)
    for _ in range(rounds):
        still = []
        for env in live:
            _, _, done, _ = env.step(rng.choice(FrozenLake.actions))
            calls += 1
            if not done:
                still.append(env)
        live = still
    for env in envs:
        env.close()
    return time.perf_counter() - start, calls


def openenv_rates(sessions: int, rounds: int) -> tuple[float, float]:
    """Env calls per second through ``ragen-pl serve`` over loopback and in-process, ``sessions`` at once."""
    from ragen_pl.envs.openenv import OpenEnvClient, served

    with served("frozen_lake", max_sessions=sessions + 1) as (url, _):  # + the client's probe
        client = OpenEnvClient(url)
        remote = [[copy.deepcopy(client) for _ in range(sessions)] for _ in range(3)]
        local = [[FrozenLake() for _ in range(sessions)] for _ in range(3)]
        seconds_remote = min(play_sessions(envs, rounds, 1000 * k) for k, envs in enumerate(remote))
        seconds_local = min(play_sessions(envs, rounds, 1000 * k) for k, envs in enumerate(local))
    return seconds_remote[1] / seconds_remote[0], seconds_local[1] / seconds_local[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=3000)
    parser.add_argument("--rooms", type=int, default=1000)
    parser.add_argument("--openenv", action="store_true", help="also measure FrozenLake through `ragen-pl serve`")
    parser.add_argument("--sessions", type=int, default=128)
    parser.add_argument("--iteration-s", type=float, default=31.0,
                        help="seconds of one SmolLM2 FrozenLake iteration, the yardstick of the server's cost")
    parser.add_argument("--openenv-only", action="store_true", help="measure only the OpenEnv part")
    args = parser.parse_args()
    if args.openenv or args.openenv_only:
        remote, local = openenv_rates(args.sessions, 10)
        calls = 32 + 320  # one SmolLM2 FrozenLake iteration: 32 resets, 32 x 10 one-action turns at most
        share = calls / remote / args.iteration_s
        print(f"FrozenLake, {args.sessions} sessions at once: {remote:,.0f} env calls/s through `ragen-pl serve` "
              f"over loopback, {local:,.0f} in-process ({local / remote:,.0f}x); one SmolLM2 FrozenLake iteration's "
              f"{calls} calls take {calls / remote:.2f} s through the server, {share:.1%} of a {args.iteration_s:.0f} s "
              f"iteration (goal: under 10%): {'yes' if share < 0.10 else 'NO'}\n")
        if args.openenv_only:
            return
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
