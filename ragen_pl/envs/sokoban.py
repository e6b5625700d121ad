"""Sokoban (multi-turn, deterministic, irreversible), as in RAGEN / gym-sokoban.

Room generation follows gym-sokoban: carve a room topology with a random walk of 3x3 masks, put the boxes on
targets, then play *backwards* (the player walks and may pull a box behind it). Every reverse move has a forward
inverse (walk back, or push), so the room reached is solvable by construction; the reverse state that moved the
boxes furthest from their targets is kept. ``solve`` (breadth-first search) confirms it in the tests.

Rewards (gym-sokoban's): -0.1 per step, +1 for pushing a box onto a target, -1 for pushing one off, +10 when every
box is on a target. The text grid uses the paper's symbols by default; ``symbols`` swaps the vocabulary, so the
"other symbols" variant is a config.

The state lives in flat Python lists indexed ``row * cols + col``: for rooms this small that is several times
faster than numpy, and rollouts reset hundreds of rooms per iteration.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Literal

from ragen_pl.envs.base import (
    Env,
    StepResult,
    check_int,
    check_observation_format,
    check_separator,
    formatted_observation,
    grid_text,
)

WALL, FLOOR, TARGET = 0, 1, 2

#: The paper's text symbols.
DEFAULT_SYMBOLS: dict[str, str] = {
    "wall": "#",
    "empty": "_",
    "target": "O",
    "box_on_target": "√",
    "box": "X",
    "player": "P",
    "player_on_target": "S",
}

# gym-sokoban's carving masks: each step of the random walk opens one of these 3x3 patterns.
_MASKS = (
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)
_DIRECTIONS = ((-1, 0), (1, 0), (0, -1), (0, 1))  # Up, Down, Left, Right


class Sokoban(Env):
    actions = ("Up", "Down", "Left", "Right")

    def __init__(
        self,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        max_steps: int = 100,
        search_depth: int = 300,
        symbols: Mapping[str, str] | None = None,
        cell_separator: str = "",
        observation_format: Literal["grid", "coord", "grid_coord"] = "grid",
        tag: str | None = None,
    ) -> None:
        """
        Args:
            dim_room: (rows, cols) including the outer wall; the paper uses (6, 6) and a (8, 8) variant.
            num_boxes: boxes (and targets) per room; the 8x8 variant uses 2.
            max_steps: the episode ends after this many env steps.
            search_depth: depth bound of the reverse-play search (RAGEN's: 300 for 6x6, 10 for its 8x8/2-box
                variant; smaller gives easier rooms).
            symbols: text vocabulary, a mapping with exactly the keys of ``DEFAULT_SYMBOLS``.
            cell_separator: text between the cells of a row: ``""`` is RAGEN's layout; ``" "`` gives every cell
                its own token under a BPE tokenizer (:func:`ragen_pl.envs.base.grid_text`). Same rooms and rules.
            observation_format: ``grid`` (the symbols), ``coord`` (zero-indexed coordinates of targets, boxes and
                the player, RAGEN-2's) or ``grid_coord`` (both, RAGEN-2's CoordSokoban).
            tag: metrics tag (default ``Sokoban``).
        """
        super().__init__(tag)
        if not (isinstance(dim_room, Sequence) and len(dim_room) == 2):
            raise ValueError(f"`dim_room` must be (rows, cols), got {dim_room!r}")
        check_int("dim_room[0]", dim_room[0], 4, 64)
        check_int("dim_room[1]", dim_room[1], 4, 64)
        check_int("num_boxes", num_boxes, 1, 10)
        check_int("max_steps", max_steps, 1)
        check_int("search_depth", search_depth, 1)
        interior = (dim_room[0] - 2) * (dim_room[1] - 2)
        if interior < 2 * num_boxes + 2:
            raise ValueError(
                f"`num_boxes` {num_boxes} does not fit a {dim_room[0]}x{dim_room[1]} room; "
                f"at most {(interior - 2) // 2} boxes fit"
            )
        self.rows, self.cols = int(dim_room[0]), int(dim_room[1])
        self.num_boxes, self.max_steps, self.search_depth = num_boxes, max_steps, search_depth
        self.symbols = _check_symbols(symbols)
        self.cell_separator = check_separator("cell_separator", cell_separator, self.symbols.values())
        self.observation_format = check_observation_format(observation_format)
        self._deltas = tuple(dr * self.cols + dc for dr, dc in _DIRECTIONS)
        self.fixed: list[int] = [WALL] * (self.rows * self.cols)
        self.boxes: set[int] = set()
        self.player = 0
        self.steps = 0

    # ------------------------------------------------------------------ text
    @property
    def instructions(self) -> str:
        s = self.symbols
        corner = f"({self.rows - 1}, {self.cols - 1})"
        shown = {
            "grid": "",
            "coord": " You are given the zero-indexed coordinates (row, column) of each target, each box and the "
                     f"player, from the top-left corner (0, 0) to the bottom-right corner {corner}; walls are not "
                     "listed.",
            "grid_coord": " You are provided with a symbol grid and the zero-indexed coordinates (row, column) of the "
                          f"player, each box, and each target, from the top-left corner (0, 0) to the bottom-right "
                          f"corner {corner}.",
        }[self.observation_format]
        legend = "" if self.observation_format == "coord" else (
            f"Symbols: {s['wall']} wall, {s['empty']} empty, {s['target']} target, {s['box_on_target']} box on "
            f"target, {s['box']} box, {s['player']} player, {s['player_on_target']} player on target.\n")
        return (
            "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets."
            + shown + " When you are right next to a box, you can push it by moving in the same direction. You cannot "
            "push a box through a wall or into another box, and you cannot pull a box.\n" + legend
            + "Actions: Up, Down, Left, Right."
        )

    def render(self) -> str:
        return formatted_observation(self.observation_format, self.grid, self.coordinates)

    def coordinates(self) -> str:
        """The state as RAGEN-2 writes it in coordinates: board size, then targets, boxes off and on targets and the
        player (on a target or not), zero-indexed (row, column), each list in reading order; walls are left out."""
        at = lambda cells: ", ".join(str(divmod(i, self.cols)) for i in sorted(cells))  # noqa: E731
        targets = [i for i, kind in enumerate(self.fixed) if kind == TARGET]
        on = [b for b in self.boxes if self.fixed[b] == TARGET]
        off = [b for b in self.boxes if self.fixed[b] != TARGET]
        lines = [f"Board size: {self.rows} rows x {self.cols} cols (zero-indexed).", f"Targets: {at(targets)}"]
        if off:
            lines.append(f"Boxes: {at(off)}")
        if on:
            lines.append(f"Boxes on target: {at(on)}")
        player = "Player on target" if self.fixed[self.player] == TARGET else "Player"
        lines.append(f"{player}: {at([self.player])}")
        return "\n".join(lines)

    def grid(self) -> str:
        """The state as a grid of symbols (RAGEN's)."""
        s = self.symbols
        cells = []
        for i, kind in enumerate(self.fixed):
            on_target = kind == TARGET
            if kind == WALL:
                cells.append(s["wall"])
            elif i == self.player:
                cells.append(s["player_on_target"] if on_target else s["player"])
            elif i in self.boxes:
                cells.append(s["box_on_target"] if on_target else s["box"])
            else:
                cells.append(s["target"] if on_target else s["empty"])
        c = self.cols
        return grid_text((cells[r * c : (r + 1) * c] for r in range(self.rows)), self.cell_separator)

    def state_key(self) -> tuple:
        """The player's cell and the boxes' cells (walls and targets are fixed by the seed)."""
        return self.player, tuple(sorted(self.boxes))

    # ------------------------------------------------------------ episode
    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        for _ in range(1000):
            if self._generate(rng):
                self.steps = 0
                return self.render()
        raise RuntimeError(  # pragma: no cover - needs a pathological config
            f"Sokoban could not generate a {self.rows}x{self.cols} room with {self.num_boxes} boxes for seed {seed}"
        )

    def load(self, grid: str) -> str:
        """Start an episode from a hand-made grid written in this env's symbols (rows separated by newlines, cells
        by ``cell_separator``)."""
        rows = grid.strip("\n").split("\n")
        if self.cell_separator:
            rows = ["".join(row.split(self.cell_separator)) for row in rows]
        inverse = {v: k for k, v in self.symbols.items()}
        if len(rows) != self.rows or any(len(r) != self.cols for r in rows):
            raise ValueError(f"grid must be {self.rows}x{self.cols}, got {len(rows)} rows: {grid!r}")
        self.fixed, self.boxes, players = [], set(), []
        for i, ch in enumerate("".join(rows)):
            if ch not in inverse:
                raise ValueError(f"grid has unknown symbol {ch!r}; allowed: {''.join(self.symbols.values())}")
            kind = inverse[ch]
            self.fixed.append(
                WALL if kind == "wall" else TARGET if kind in ("target", "box_on_target", "player_on_target") else FLOOR
            )
            if kind in ("box", "box_on_target"):
                self.boxes.add(i)
            if kind in ("player", "player_on_target"):
                players.append(i)
        if len(players) != 1:
            raise ValueError(f"grid must have exactly one player, found {len(players)}")
        self.player = players[0]
        self.num_boxes = len(self.boxes)
        self.steps = 0
        return self.render()

    def expert_action(self) -> str:
        plan = solve(self)
        if not plan:
            raise RuntimeError("the room cannot be solved from this state")
        return plan[0]

    def effective_actions(self) -> tuple[str, ...]:
        """The moves that move the player: not into a wall, and no push of a box into a wall or another box."""
        fixed, boxes, p = self.fixed, self.boxes, self.player
        return tuple(a for a, d in zip(self.actions, self._deltas) if fixed[p + d] != WALL and (
            p + d not in boxes or (fixed[p + 2 * d] != WALL and p + 2 * d not in boxes)))

    @property
    def solved(self) -> bool:
        return all(self.fixed[b] == TARGET for b in self.boxes)

    def step(self, action: str) -> StepResult:
        index = self.parse_action(action)
        if index is None or self.steps >= self.max_steps or self.solved:
            return self.invalid(self.render())
        d = self._deltas[index]
        fixed, boxes = self.fixed, self.boxes
        reward = -0.1
        moved = False
        target = self.player + d
        if fixed[target] != WALL:
            if target in boxes:
                beyond = target + d
                if fixed[beyond] != WALL and beyond not in boxes:
                    boxes.remove(target)
                    boxes.add(beyond)
                    reward += (fixed[beyond] == TARGET) - (fixed[target] == TARGET)
                    self.player, moved = target, True
            else:
                self.player, moved = target, True
        self.steps += 1
        solved = self.solved
        if solved:
            reward += 10.0
        done = solved or self.steps >= self.max_steps
        return self.render(), reward, done, {"success": solved, "action_is_valid": True, "action_is_effective": moved}

    # --------------------------------------------------------- generation
    def _generate(self, rng: random.Random) -> bool:
        """One try of RAGEN's generator (its gym-sokoban fork): topology, placement, reverse search, player walk.

        Returns False when this topology gives no room (too little floor, or no box could be moved off its
        target in up to four placements), and the caller draws again.
        """
        cols = self.cols
        for _ in range(4):  # RAGEN's `tries`: a new topology and placement until some box is displaced
            fixed = self._topology(rng)
            floor = [i for i, k in enumerate(fixed) if k != WALL]
            if len(floor) <= self.num_boxes + 1:
                return False
            player = rng.choice(floor)
            free = [i for i in floor if i != player]
            targets = []
            for _ in range(self.num_boxes):
                t = rng.choice(free)
                free.remove(t)
                targets.append(t)
            for t in targets:
                fixed[t] = TARGET
            found = _reverse_search(fixed, cols, self._deltas, player, tuple(targets), self.search_depth)
            if found is not None:
                break
        else:
            return False
        pos, boxes, displacement = found
        # RAGEN then walks the player 1-3 steps away from the box it just pulled (more often when the box moved
        # only one cell), so rooms do not all start with the player beside the box.
        if rng.random() <= (0.8 if displacement == 1 else 0.5):
            visited = [pos]
            for step in range(3):
                moves = [pos + d for d in self._deltas
                         if fixed[pos + d] != WALL and pos + d not in boxes and pos + d not in visited]
                if not moves:
                    break
                pos = rng.choice(moves)
                visited.append(pos)
                if step == 2 or rng.random() > 0.5:
                    break
        self.fixed, self.player, self.boxes = fixed, pos, set(boxes)
        return True

    def _topology(self, rng: random.Random) -> list[int]:
        """gym-sokoban's room: a random walk of ``int(1.7 * (rows + cols))`` steps opening 3x3 masks of floor."""
        rows, cols = self.rows, self.cols
        fixed = [WALL] * (rows * cols)
        dr, dc = rng.choice(_DIRECTIONS)
        r, c = rng.randint(1, rows - 1), rng.randint(1, cols - 1)
        for _ in range(int(1.7 * (rows + cols))):
            if rng.random() < 0.35:
                dr, dc = rng.choice(_DIRECTIONS)
            r = min(max(r + dr, 1), rows - 2)
            c = min(max(c + dc, 1), cols - 2)
            mask = rng.choice(_MASKS)
            for mr in range(3):
                for mc in range(3):
                    rr, cc = r + mr - 1, c + mc - 1
                    if mask[mr][mc] and 0 < rr < rows - 1 and 0 < cc < cols - 1:
                        fixed[rr * cols + cc] = FLOOR
        return fixed


def _reverse_search(fixed: list[int], cols: int, deltas: tuple[int, ...], player: int, targets: tuple[int, ...],
                    search_depth: int, max_states: int = 300_000) -> tuple[int, tuple[int, ...], int] | None:
    """RAGEN's reverse play: depth-first from the solved room, the player walking and pulling boxes.

    Every reverse move has a forward inverse (walk back, or push), so each state reached is solvable. The search
    keeps the first state, in depth-first order (pulls Up, Down, Left, Right), with the highest score
    ``box_swaps * displacement``: ``displacement`` is the total Manhattan distance of the boxes from their own
    targets, ``box_swaps`` counts switches of the pulled box (the first pull counts). A state scores 0 unless every
    target is uncovered (no box and no player on one), so no box starts on a target. ``search_depth`` bounds the
    depth as RAGEN's ``ttl`` does (nodes deeper than ``search_depth - 2`` moves are not expanded), and states are
    never revisited. Returns (player, boxes, displacement) or None when no box could be displaced.
    """
    explored: set = set()
    n = len(targets)
    best: list = [-1, player, targets, 0]

    def visit(pos: int, boxes: tuple[int, ...], pulled: tuple[bool, ...], swaps: int, last: int, ttl: int) -> None:
        ttl -= 1
        if ttl <= 0 or len(explored) >= max_states:
            return
        key = (pos, frozenset(zip(boxes, pulled)))  # as RAGEN hashes its grid: box identities are not part of it
        if key in explored:
            return
        explored.add(key)
        displacement = sum(abs(b // cols - t // cols) + abs(b % cols - t % cols) for b, t in zip(boxes, targets))
        covered = sum(t == pos or t in boxes for t in targets)
        score = swaps * displacement if covered == 0 else 0
        if score > best[0]:
            best[:] = [score, pos, boxes, displacement]
        for d in deltas:
            nxt = pos + d
            if fixed[nxt] == WALL or nxt in boxes:
                continue
            if pos - d in boxes:  # pull: the box behind the player follows it into its old cell
                i = boxes.index(pos - d)
                visit(nxt, boxes[:i] + (pos,) + boxes[i + 1:], pulled[:i] + (True,) + pulled[i + 1:],
                      swaps + (i != last), i, ttl)
            else:
                visit(nxt, boxes, pulled, swaps, last, ttl)

    visit(player, targets, (False,) * n, 0, -1, search_depth)
    if best[3] == 0:
        return None
    return best[1], best[2], best[3]


def _manhattan(a: int, b: int, cols: int) -> int:
    return abs(a // cols - b // cols) + abs(a % cols - b % cols)


def _check_symbols(symbols: Mapping[str, str] | None) -> dict[str, str]:
    if symbols is None:
        return dict(DEFAULT_SYMBOLS)
    if not isinstance(symbols, Mapping) or set(symbols) != set(DEFAULT_SYMBOLS):
        got = sorted(symbols) if isinstance(symbols, Mapping) else symbols
        raise ValueError(f"`symbols` must have exactly the keys {sorted(DEFAULT_SYMBOLS)}, got {got!r}")
    values = list(symbols.values())
    if any(not isinstance(v, str) or len(v) != 1 or v.isspace() for v in values) or len(set(values)) != len(values):
        raise ValueError(f"`symbols` values must be distinct single visible characters, got {dict(symbols)!r}")
    return dict(symbols)


def solve(env: Sokoban, max_states: int = 200_000) -> list[str] | None:
    """Shortest action sequence (in player moves) that solves the current room, by breadth-first search.

    Returns ``None`` when the room is unsolvable, or when more than ``max_states`` states were explored.
    """
    fixed, deltas = env.fixed, env._deltas
    start = (env.player, frozenset(env.boxes))
    parents: dict[tuple[int, frozenset[int]], tuple[tuple[int, frozenset[int]], int] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        player, boxes = state
        if all(fixed[b] == TARGET for b in boxes):
            path = []
            while parents[state] is not None:
                state, a = parents[state]  # type: ignore[misc]
                path.append(Sokoban.actions[a])
            return path[::-1]
        for a, d in enumerate(deltas):
            nxt = player + d
            if fixed[nxt] == WALL:
                continue
            if nxt in boxes:
                beyond = nxt + d
                if fixed[beyond] == WALL or beyond in boxes:
                    continue
                new = (nxt, boxes - {nxt} | {beyond})
            else:
                new = (nxt, boxes)
            if new not in parents:
                parents[new] = (state, a)
                if len(parents) > max_states:
                    return None
                queue.append(new)
    return None
