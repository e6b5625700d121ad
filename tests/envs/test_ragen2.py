"""RAGEN-2's observation formats and FrozenLake (issue 59), side by side with a reference built the way RAGEN-2's env
code builds them (mll-lab-nu/RAGEN ragen/env/frozen_lake, 2025-11): its map generator over Gymnasium's seeding,
Gymnasium's own FrozenLakeEnv for moves and slips, and its grid / coordinate renders."""

from __future__ import annotations

import random

import gymnasium  # noqa: F401 - a dev dependency: RAGEN-2's FrozenLake is Gymnasium's
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv
from gymnasium.utils import seeding

from ragen_pl.envs.frozen_lake import FrozenLake, value_iteration
from ragen_pl.envs.sokoban import Sokoban


# ------------------------------------------------------------------ RAGEN-2's FrozenLake, as its code builds it
def ragen2_map(size: int, p: float, seed: int) -> list[str]:
    np_random, _ = seeding.np_random(seed)
    while True:
        board = np_random.choice(["F", "H"], (size, size), p=[p, 1 - p])
        start_r, start_c = np_random.integers(size, size=2)
        goal_r, goal_c = np_random.integers(size, size=2)
        if (start_r, start_c) != (goal_r, goal_c):
            board[start_r][start_c], board[goal_r][goal_c] = "S", "G"
            frontier, seen, found = [(start_r, start_c)], set(), False
            while frontier and not found:
                r, c = frontier.pop()
                if (r, c) in seen:
                    continue
                seen.add((r, c))
                for dr, dc in ((1, 0), (0, 1), (-1, 0), (0, -1)):
                    rr, cc = r + dr, c + dc
                    if 0 <= rr < size and 0 <= cc < size:
                        if board[rr][cc] == "G":
                            found = True
                        elif board[rr][cc] != "H":
                            frontier.append((rr, cc))
            if found:
                return ["".join(row) for row in board]


def ragen2_text(env: FrozenLakeEnv, fmt: str) -> str:
    desc = env.desc
    pr, pc = int(env.s) // env.ncol, int(env.s) % env.ncol
    lookup = {b"F": "_", b"S": "_", b"H": "O", b"G": "G"}
    rows = [[lookup[bytes(x)] for x in row] for row in desc]
    rows[pr][pc] = {b"H": "X", b"G": "√"}.get(bytes(desc[pr, pc]), "P")
    grid = "\n".join("".join(r) for r in rows)
    at = lambda letter: [(int(r), int(c)) for r, c in np.argwhere(desc == letter)]  # noqa: E731
    lines = [f"Board size: {desc.shape[0]} rows x {desc.shape[1]} cols (zero-indexed).",
             "Start: " + ", ".join(f"({r}, {c})" for r, c in at(b"S")),
             "Goal: " + ", ".join(f"({r}, {c})" for r, c in at(b"G"))]
    label = {b"G": "Player on goal", b"H": "Player in hole"}.get(bytes(desc[pr, pc]), "Player")
    lines.append(f"{label}: ({pr}, {pc})")
    if at(b"H"):
        lines.append("Holes: " + ", ".join(f"({r}, {c})" for r, c in at(b"H")))
    coord = "\n".join(lines)
    return {"grid": grid, "coord": coord, "grid_coord": f"Coordinates: \n{coord}\nGrid Map: \n{grid}"}[fmt]


def ragen2_env(seed: int, p: float, slippery: bool, success_rate: float) -> FrozenLakeEnv:
    env = FrozenLakeEnv(desc=ragen2_map(4, p, seed), is_slippery=slippery, success_rate=success_rate)
    env.reset(seed=seed)
    return env


CASES = [("grid_coord", True, 0.8), ("grid_coord", True, 1.0), ("coord", False, 0.8), ("grid", True, 1 / 3)]


@pytest.mark.parametrize("fmt, slippery, success_rate", CASES)
def test_ragen2s_frozen_lake_seed_for_seed(fmt, slippery, success_rate):
    """The same map, start, goal, slips, text, rewards and ends as RAGEN-2's env for the same seed and actions."""
    for seed in range(25):
        ours = FrozenLake(frozen_prob=0.9, slippery=slippery, success_rate=success_rate, observation_format=fmt,
                          generator="ragen2")
        theirs = ragen2_env(seed, 0.9, slippery, success_rate)
        assert ours.reset(seed) == ragen2_text(theirs, fmt)
        rng = random.Random(seed)
        for _ in range(10):
            a = rng.randrange(4)
            text, reward, done, info = ours.step(FrozenLake.actions[a])
            before = int(theirs.s)
            _, r, terminated, _, _ = theirs.step(a)
            assert text == ragen2_text(theirs, fmt)
            assert (reward, done, info["success"]) == (r, terminated, bytes(theirs.desc.flat[theirs.s]) == b"G")
            assert info["action_is_effective"] == (before != int(theirs.s))
            if done:
                break


def test_ragen2_maps_have_ragen2s_frozen_share():
    """Over 400 seeds, the share of frozen tiles away from start and goal is about 0.9 (RAGEN-2's p), not 0.8."""
    env = FrozenLake(frozen_prob=0.9, generator="ragen2")
    holes = 0
    for seed in range(400):
        env.reset(seed)
        holes += len(env.holes)
    assert 0.075 < holes / (400 * 14) < 0.115  # ~0.1, shaded down by the redraws of maps without a path


def test_success_rate_sets_the_slips_and_the_optimal_values():
    """Intended move with success_rate, each perpendicular with half the rest; 1 is deterministic; value iteration
    follows (here: a start from which one slip sideways drops into a hole)."""
    env = FrozenLake(success_rate=0.8)
    env.reset(0)
    env.holes, env.start, env.goal, env.pos = frozenset({(1, 0)}), (0, 0), (0, 3), (0, 0)
    turns = {}
    for k in range(4000):
        probe = FrozenLake(success_rate=0.8)
        probe.reset(k)
        probe.holes, probe.start, probe.goal, probe.pos = env.holes, env.start, env.goal, (1, 1)
        probe.step("Right")
        turns[probe.pos] = turns.get(probe.pos, 0) + 1
    assert abs(turns[(1, 2)] / 4000 - 0.8) < 0.03 and abs(turns[(0, 1)] / 4000 - 0.1) < 0.02
    assert abs(turns[(2, 1)] / 4000 - 0.1) < 0.02
    sure = FrozenLake(success_rate=1.0)
    sure.reset(0)
    sure.holes, sure.start, sure.goal, sure.pos = env.holes, env.start, env.goal, (0, 0)
    assert value_iteration(sure)[0][(0, 0)] == pytest.approx(1.0)
    assert value_iteration(env)[0][(0, 0)] < 1.0  # slips can drop the player into (1, 0)


def test_frozen_lake_settings_are_checked():
    with pytest.raises(ValueError, match="`observation_format` must be 'grid', 'coord' or 'grid_coord'"):
        FrozenLake(observation_format="coords")
    with pytest.raises(ValueError, match=r"`success_rate` must be in \[0.0, 1.0\]"):
        FrozenLake(success_rate=1.5)
    with pytest.raises(ValueError, match="needs `layout: random`"):
        FrozenLake(generator="ragen2", layout="corners")


# ------------------------------------------------------------------ RAGEN-2's Sokoban texts, from gym-sokoban arrays
def gym_sokoban_arrays(env: Sokoban) -> tuple[np.ndarray, np.ndarray]:
    """ragen-pl's state as gym-sokoban's room_fixed (0 wall, 1 floor, 2 target) and room_state (... 3 box on target,
    4 box, 5 player)."""
    fixed = np.array(env.fixed).reshape(env.rows, env.cols)
    state = np.where(fixed == 2, 2, fixed).copy()
    for b in env.boxes:
        state[divmod(b, env.cols)] = 3 if env.fixed[b] == 2 else 4
    state[divmod(env.player, env.cols)] = 5
    return fixed, state


def ragen2_sokoban_text(env: Sokoban, fmt: str) -> str:
    """RAGEN-2's SokobanEnv._render_text and its coordinate helpers, on those arrays."""
    fixed, state = gym_sokoban_arrays(env)
    lookup = {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}
    room = np.where((state == 5) & (fixed == 2), 6, state)
    grid = "\n".join("".join(lookup[int(cell)] for cell in row) for row in room.tolist())
    pairs = lambda a: [(int(r), int(c)) for r, c in a]  # noqa: E731
    coords = {"targets": pairs(np.argwhere(fixed == 2)), "boxes_on_target": pairs(np.argwhere(state == 3)),
              "boxes": pairs(np.argwhere(state == 4)), "player": [], "player_on_target": []}
    for r, c in pairs(np.argwhere(state == 5)):
        coords["player_on_target" if fixed[r, c] == 2 else "player"].append((r, c))
    lines = [f"Board size: {env.rows} rows x {env.cols} cols (zero-indexed)."]
    for key, label in (("targets", "Targets"), ("boxes", "Boxes"), ("boxes_on_target", "Boxes on target"),
                       ("player", "Player"), ("player_on_target", "Player on target")):
        if coords[key]:
            lines.append(f"{label}: " + ", ".join(f"({r}, {c})" for r, c in coords[key]))
    coord = "\n".join(lines)
    return {"grid": grid, "coord": coord, "grid_coord": f"Coordinates: \n{coord}\nGrid Map: \n{grid}"}[fmt]


@pytest.mark.parametrize("fmt", ["grid", "coord", "grid_coord"])
@pytest.mark.parametrize("room", [((6, 6), 1), ((8, 8), 2)])
def test_sokoban_writes_each_state_as_ragen2_does(fmt, room):
    """Every state of random play (boxes pushed onto and off targets, the player on a target) in RAGEN-2's text. The
    rooms themselves come from ragen-pl's generator: RAGEN's algorithm, another random stream (docs: fidelity)."""
    dim, boxes = room
    seen = set()
    for seed in range(30):
        env = Sokoban(dim_room=dim, num_boxes=boxes, search_depth=10, observation_format=fmt)
        assert env.reset(seed) == ragen2_sokoban_text(env, fmt)
        rng = random.Random(seed)
        for _ in range(20):
            text, _, done, _ = env.step(rng.choice(Sokoban.actions))
            assert text == ragen2_sokoban_text(env, fmt)
            seen.add("Player on target" in ragen2_sokoban_text(env, "coord"))
            seen.add("Boxes on target" in ragen2_sokoban_text(env, "coord"))
            if done:
                break
    assert seen == {True, False}  # the rarer states did occur
