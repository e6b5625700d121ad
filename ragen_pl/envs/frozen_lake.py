"""FrozenLake (multi-turn, stochastic), as in RAGEN / Gymnasium.

A square map; each tile is frozen with probability ``frozen_prob`` (0.8), the rest are holes. RAGEN's generator (the
default, ``layout="random"``) then draws the start and the goal as two distinct random tiles; Gymnasium's
(``layout="corners"``) puts them in the top-left and bottom-right corners. Maps are redrawn until a path of frozen
tiles joins start and goal. With ``slippery`` the intended move happens with probability ``success_rate`` and each
perpendicular move with half the rest (Gymnasium's rule; 1/3 each by default, RAGEN v1's). Reward 1 on reaching the
goal; the episode ends at the goal or in a hole.

RAGEN-2 (mll-lab-nu/RAGEN, 2025-11) draws tiles frozen with probability 0.9, sets ``success_rate`` 0.8 (1 in its
main table) and writes the state as a ``grid``, as ``coord`` (zero-indexed coordinates of start, goal, player and
holes) or both (``grid_coord``, its CoordFrozenLake). ``generator="ragen2"`` draws maps and slips exactly as its env
does (NumPy's PCG64 seeded through Gymnasium's seeding), so a seed gives RAGEN-2's episode, text for text;
``generator="ragen_pl"`` (the default) draws from the same distribution with Python's ``random``.

Action order is Gymnasium's (Left, Down, Right, Up), so the two perpendicular moves of action ``a`` are
``(a - 1) % 4`` and ``(a + 1) % 4``.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Literal

from ragen_pl.envs.base import (
    Env,
    StepResult,
    check_int,
    check_observation_format,
    check_range,
    check_separator,
    formatted_observation,
    grid_text,
)

_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))  # Left, Down, Right, Up

SYMBOLS = {"player": "P", "frozen": "_", "hole": "O", "goal": "G", "player_in_hole": "X", "player_on_goal": "√"}


class FrozenLake(Env):
    actions = ("Left", "Down", "Right", "Up")

    def __init__(
        self,
        size: int = 4,
        frozen_prob: float = 0.8,
        slippery: bool = True,
        max_steps: int = 100,
        layout: Literal["random", "corners"] = "random",
        cell_separator: str = "",
        success_rate: float = 1 / 3,
        observation_format: Literal["grid", "coord", "grid_coord"] = "grid",
        generator: Literal["ragen_pl", "ragen2"] = "ragen_pl",
        tag: str | None = None,
    ) -> None:
        """
        Args:
            size: the map is ``size`` x ``size`` tiles.
            frozen_prob: probability that a tile (other than start and goal) is frozen rather than a hole.
            slippery: the intended move happens with probability 1/3, each perpendicular one with 1/3.
            max_steps: the episode ends after this many env steps.
            layout: ``random`` start and goal on each map (RAGEN's; mean shortest path 2.8 moves on 4x4), or the
                ``corners`` (Gymnasium's; 6.0 moves, a much harder task).
            cell_separator: text between the cells of a row: ``""`` is RAGEN's layout; ``" "`` gives every cell
                its own token under a BPE tokenizer (:func:`ragen_pl.envs.base.grid_text`). Same maps and rules.
            success_rate: on slippery ice, the probability of the intended move; each perpendicular one gets half
                the rest (1/3: RAGEN v1's and Gymnasium's default; RAGEN-2's 0.8, 1 in its main table).
            observation_format: ``grid`` (the symbols), ``coord`` (zero-indexed coordinates of start, goal, player
                and holes) or ``grid_coord`` (both, RAGEN-2's CoordFrozenLake).
            generator: ``ragen_pl`` (Python's ``random``) or ``ragen2`` (RAGEN-2's own draws of maps and slips,
                seed for seed; needs ``layout: random``).
            tag: metrics tag (default ``FrozenLake``).
        """
        super().__init__(tag)
        check_int("size", size, 2, 64)
        check_range("frozen_prob", frozen_prob, 0.0, 1.0)
        if frozen_prob < 0.5:
            raise ValueError(f"`frozen_prob` must be >= 0.5 so that a map with a path can be drawn, got {frozen_prob}")
        if not isinstance(slippery, bool):
            raise TypeError(f"`slippery` must be true or false, got {slippery!r}")
        check_int("max_steps", max_steps, 1)
        if layout not in ("random", "corners"):
            raise ValueError(f"`layout` must be 'random' or 'corners', got {layout!r}")
        check_range("success_rate", success_rate, 0.0, 1.0)
        check_observation_format(observation_format)
        if generator not in ("ragen_pl", "ragen2"):
            raise ValueError(f"`generator` must be 'ragen_pl' or 'ragen2', got {generator!r}")
        if generator == "ragen2" and layout != "random":
            raise ValueError("`generator: ragen2` draws RAGEN-2's maps, whose start and goal are random: it needs "
                             "`layout: random`")
        self.success_rate, self.observation_format, self.generator = float(success_rate), observation_format, generator
        self.layout = layout
        self.cell_separator = check_separator("cell_separator", cell_separator, SYMBOLS.values())
        self.size, self.frozen_prob, self.slippery, self.max_steps = size, float(frozen_prob), slippery, max_steps
        self.holes: frozenset[tuple[int, int]] = frozenset()
        self.start, self.goal = (0, 0), (size - 1, size - 1)
        self.pos = self.start
        self.steps = 0
        self._rng = random.Random(0)
        self._policy: dict[tuple[int, int], str] | None = None

    @property
    def instructions(self) -> str:
        s = SYMBOLS
        slip = (
            " The ice is slippery: you may move perpendicular to the direction you chose."
            if self.slippery and self.success_rate < 1 else ""
        )
        corner = f"({self.size - 1}, {self.size - 1})"
        shown = {
            "grid": "",
            "coord": " The observation gives the zero-indexed coordinates (row, column) of the start, goal, player and "
                     f"any holes, from the top-left corner (0, 0) to the bottom-right corner {corner}.",
            "grid_coord": " The observation includes both a symbol grid and zero-indexed coordinates (row, column) for "
                          "the start, goal, player, and any holes, from the top-left corner (0, 0) to the bottom-right "
                          f"corner {corner}.",
        }[self.observation_format]
        legend = "" if self.observation_format == "coord" else (
            f"Symbols: {s['player']} player, {s['frozen']} frozen, {s['hole']} hole, {s['goal']} goal, "
            f"{s['player_in_hole']} player in hole, {s['player_on_goal']} player on goal.\n")
        return ("You are walking on a frozen lake. Reach the goal without falling into a hole." + shown + slip + "\n"
                + legend + "Actions: Left, Down, Right, Up.")

    def reset(self, seed: int) -> str:
        if self.generator == "ragen2":
            self.holes, self.start, self.goal = _ragen2_map(self.size, self.frozen_prob, seed)
            self.pos, self.steps, self._policy = self.start, 0, None
            self._rng = _Ragen2Slips(seed)
            return self.render()
        self._rng = rng = random.Random(seed)
        n = self.size
        while True:  # draw the tiles, then start and goal over them, until a path joins the two
            holes = {(r, c) for r in range(n) for c in range(n) if rng.random() >= self.frozen_prob}
            if self.layout == "random":
                start, goal = divmod(rng.randrange(n * n), n), divmod(rng.randrange(n * n), n)
                if start == goal:
                    continue
            else:
                start, goal = (0, 0), (n - 1, n - 1)
            holes = frozenset(holes - {start, goal})
            if _path(n, holes, start, goal) is not None:
                break
        self.holes, self.start, self.goal, self.pos, self.steps = holes, start, goal, start, 0
        self._policy = None
        return self.render()

    def state_key(self) -> tuple[int, int]:
        """The player's cell (holes, start and goal are fixed by the seed)."""
        return self.pos

    def render(self) -> str:
        return formatted_observation(self.observation_format, self.grid, self.coordinates)

    def coordinates(self) -> str:
        """The state as RAGEN-2 writes it in coordinates: board size, then start, goal, player (on the goal, in a
        hole) and holes, zero-indexed (row, column), holes in reading order."""
        where = {self.goal: "Player on goal"}.get(self.pos, "Player in hole" if self.pos in self.holes else "Player")
        lines = [f"Board size: {self.size} rows x {self.size} cols (zero-indexed).", f"Start: {self.start}",
                 f"Goal: {self.goal}", f"{where}: {self.pos}"]
        if self.holes:
            lines.append("Holes: " + ", ".join(str(h) for h in sorted(self.holes)))
        return "\n".join(lines)

    def grid(self) -> str:
        """The state as a grid of symbols (RAGEN's)."""
        s = SYMBOLS
        rows = []
        for r in range(self.size):
            row = []
            for c in range(self.size):
                cell = (r, c)
                if cell == self.pos:
                    row.append(
                        s["player_in_hole"] if cell in self.holes else s["player_on_goal"] if cell == self.goal
                        else s["player"]
                    )
                else:
                    row.append(s["hole"] if cell in self.holes else s["goal"] if cell == self.goal else s["frozen"])
            rows.append(row)
        return grid_text(rows, self.cell_separator)

    def expert_action(self) -> str:
        """The optimal move: on ice that does not slip the first move of a shortest path; on slippery ice value
        iteration's, discounted by 0.99 so that of moves with the same chance of reaching the goal it takes the one
        that gets there sooner (undiscounted, every tile from which the goal is sure ties, and the policy can walk
        in circles)."""
        if not self.slippery:
            path = shortest_path(self)
            return path[0] if path else "Left"
        if self._policy is None:
            self._policy = value_iteration(self, gamma=0.99)[1]
        return self._policy.get(self.pos, "Left")

    def effective_actions(self) -> tuple[str, ...]:
        """The directions that point to a tile on the map (the ice may still slip sideways)."""
        r, c = self.pos
        n = self.size
        return tuple(a for a, (dr, dc) in zip(self.actions, _MOVES) if 0 <= r + dr < n and 0 <= c + dc < n)

    @property
    def finished(self) -> bool:
        return self.pos == self.goal or self.pos in self.holes or self.steps >= self.max_steps

    def step(self, action: str) -> StepResult:
        index = self.parse_action(action)
        if index is None or self.finished:
            return self.invalid(self.render())
        if isinstance(self._rng, _Ragen2Slips):
            index = (index + self._rng.turn(self.slippery, self.success_rate)) % 4
        elif self.slippery and self.success_rate == 1 / 3:
            index = (index + self._rng.choice((-1, 0, 1))) % 4  # RAGEN v1's draw (kept: same seeds, same slips)
        elif self.slippery:
            index = (index + _slip(self._rng.random(), self.success_rate)) % 4
        dr, dc = _MOVES[index]
        r, c = self.pos
        new = (min(max(r + dr, 0), self.size - 1), min(max(c + dc, 0), self.size - 1))
        moved = new != self.pos
        self.pos = new
        self.steps += 1
        success = new == self.goal
        done = success or new in self.holes or self.steps >= self.max_steps
        info = {"success": success, "action_is_valid": True, "action_is_effective": moved}
        return self.render(), float(success), done, info


def _neighbours(n: int, cell: tuple[int, int]):
    r, c = cell
    for dr, dc in _MOVES:
        rr, cc = r + dr, c + dc
        if 0 <= rr < n and 0 <= cc < n:
            yield rr, cc


def _path(n: int, holes: frozenset, start: tuple[int, int], goal: tuple[int, int]) -> list[tuple[int, int]] | None:
    parents: dict[tuple[int, int], tuple[int, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            path = [cell]
            while parents[path[-1]] is not None:
                path.append(parents[path[-1]])  # type: ignore[arg-type]
            return path[::-1]
        for nxt in _neighbours(n, cell):
            if nxt not in holes and nxt not in parents:
                parents[nxt] = cell
                queue.append(nxt)
    return None


def shortest_path(env: FrozenLake) -> list[str] | None:
    """Action names of a shortest hole-free path from the current position to the goal (no slipping assumed)."""
    cells = _path(env.size, env.holes, env.pos, env.goal)
    if cells is None:
        return None
    names = []
    for (r0, c0), (r1, c1) in zip(cells, cells[1:]):
        names.append(FrozenLake.actions[_MOVES.index((r1 - r0, c1 - c0))])
    return names


def _outcomes(env: FrozenLake) -> tuple[tuple[int, float], ...]:
    """(turn, probability) of an intended move: straight on; on slippery ice also each perpendicular turn."""
    if not env.slippery:
        return ((0, 1.0),)
    fail = (1 - env.success_rate) / 2
    return ((-1, fail), (0, env.success_rate), (1, fail))


def _slip(u: float, success_rate: float) -> int:
    """The turn a uniform draw ``u`` gives: the first of (-1, 0, +1) whose cumulative probability (half the failure,
    then the intended move, then the other half) passes ``u``, as Gymnasium's ``categorical_sample`` picks it."""
    fail = (1.0 - success_rate) / 2.0
    return -1 if u < fail else 0 if u < fail + success_rate else 1


def _gymnasium_rng(seed: int):
    """The generator ``gymnasium.utils.seeding.np_random(seed)`` makes: NumPy's PCG64 from a SeedSequence."""
    import numpy as np

    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))


class _Ragen2Slips:
    """RAGEN-2's slips: its env is Gymnasium's FrozenLake reset with the episode's seed, whose generator draws once
    for the start tile at reset and once per step, slippery or not (:func:`_slip`)."""

    def __init__(self, seed: int) -> None:
        self._rng = _gymnasium_rng(seed)
        self._rng.random()  # the reset's draw of the (single) start tile

    def turn(self, slippery: bool, success_rate: float) -> int:
        u = self._rng.random()
        return _slip(u, success_rate) if slippery else 0


def _ragen2_map(n: int, frozen_prob: float, seed: int):
    """RAGEN-2's ``generate_random_map``: tiles frozen with ``frozen_prob`` (NumPy's ``choice``), then start and goal
    as two random tiles over them, redrawn until they differ and a path of non-hole tiles joins them."""
    rng = _gymnasium_rng(seed)
    while True:
        board = rng.choice(["F", "H"], (n, n), p=[frozen_prob, 1 - frozen_prob])
        start = tuple(int(x) for x in rng.integers(n, size=2))
        goal = tuple(int(x) for x in rng.integers(n, size=2))
        if start == goal:
            continue
        holes = frozenset((r, c) for r in range(n) for c in range(n) if board[r][c] == "H") - {start, goal}
        if _path(n, holes, start, goal) is not None:
            return holes, start, goal


def _moved(n: int, cell: tuple[int, int], a: int) -> tuple[int, int]:
    """Where move ``a`` takes ``cell`` on an n x n map (a move off the map stays)."""
    dr, dc = _MOVES[a]
    return min(max(cell[0] + dr, 0), n - 1), min(max(cell[1] + dc, 0), n - 1)


def action_values(env: FrozenLake, budget: int) -> dict[str, float]:
    """Each action's probability of reaching the goal from the current position within ``budget`` actions, acting
    optimally after it (finite-horizon value iteration under the env's transition rule, observing after each move)."""
    n, outcomes = env.size, _outcomes(env)
    cells = [(r, c) for r in range(n) for c in range(n)]

    def q(values, cell, a):
        return sum(p * values[_moved(n, cell, (a + o) % 4)] for o, p in outcomes)

    values = {c: float(c == env.goal) for c in cells}  # no action left
    for _ in range(budget - 1):
        values = {c: (1.0 if c == env.goal else 0.0 if c in env.holes else max(q(values, c, a) for a in range(4)))
                  for c in cells}
    return {name: q(values, env.pos, i) for i, name in enumerate(env.actions)}


def value_iteration(env: FrozenLake, tol: float = 1e-10, max_iters: int = 10_000, gamma: float = 1.0):
    """Optimal success probability and greedy policy under the env's transition rule.

    Returns ``(values, policy)``: dicts from tile to the probability of reaching the goal when acting optimally
    (without a step limit; with ``gamma`` < 1, that probability discounted by the steps it takes), and to the best
    action name.
    """
    n, outcomes = env.size, _outcomes(env)
    tiles = [(r, c) for r in range(n) for c in range(n)]
    values = {t: 0.0 for t in tiles}
    values[env.goal] = 1.0

    def q(cell, a):
        return gamma * sum(p * values[_moved(n, cell, (a + o) % 4)] for o, p in outcomes)

    for _ in range(max_iters):
        delta = 0.0
        for t in tiles:
            if t == env.goal or t in env.holes:
                continue
            best = max(q(t, a) for a in range(4))
            delta = max(delta, abs(best - values[t]))
            values[t] = best
        if delta < tol:
            break
    policy = {
        t: FrozenLake.actions[max(range(4), key=lambda a, t=t: q(t, a))]
        for t in tiles
        if t != env.goal and t not in env.holes
    }
    return values, policy
