"""Any Gymnasium environment as a ragen-pl env (entry point ``gymnasium``; ``pip install 'ragen-pl[gymnasium]'``).

``--data.env=gymnasium --data.env.init_args.id=FrozenLake-v1`` trains on Gymnasium's own FrozenLake. The wrapper
needs the observation as text and the actions as names:

* text: a built-in renderer for the toy-text envs (FrozenLake, Taxi), else ``observation_text`` (the class path of a
  function ``(env, observation) -> str``), else the env's ``render_mode="ansi"`` text, its coloured cells written as
  ``[x]`` (the colour is what marks the player in Gymnasium's ansi renders);
* actions: ``Discrete`` spaces take names (built in for FrozenLake and Taxi, else ``action_names``); any space takes
  ``action_parser``, the class path of a function ``(text) -> action or None`` (None: not a valid action).

Each episode is ``reset(seed=seed)``: the same seed gives the same episode in any process. Success is
``info["success"]`` or ``info["is_success"]`` where the env reports one, else a termination with a positive reward
(FrozenLake's goal, Taxi's drop-off); an episode ends on termination or truncation (Gymnasium's ``TimeLimit``:
``max_episode_steps``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ragen_pl.envs.base import Env, StepResult
from ragen_pl.registry import import_class_path

__all__ = ["GymnasiumEnv"]

_COLOURED = re.compile(r"\x1b\[[0-9;]*m(.*?)\x1b\[0m", re.DOTALL)
_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _frozen_lake_text(env: Any, obs: int) -> str:
    desc = [[c.decode() for c in row] for row in env.unwrapped.desc]
    row, col = divmod(int(obs), len(desc[0]))
    desc[row][col] = "P"
    return "\n".join("".join(r) for r in desc)


def _taxi_text(env: Any, obs: int) -> str:
    taxi_row, taxi_col, passenger, destination = env.unwrapped.decode(int(obs))
    desc = [[c.decode() for c in row] for row in env.unwrapped.desc]
    desc[1 + taxi_row][2 * taxi_col + 1] = "T"
    names = "RGYB"
    where = "in the taxi" if passenger == 4 else f"at {names[passenger]}"
    return ("\n".join("".join(r) for r in desc) + f"\nTaxi T at row {taxi_row}, column {taxi_col}. Passenger {where}. "
            f"Destination {names[destination]}.")


#: Gymnasium's toy-text envs, by their class: action names, text renderer, instructions.
_BUILT_IN: dict[str, tuple[tuple[str, ...], Callable[[Any, Any], str], str]] = {
    "FrozenLakeEnv": (("Left", "Down", "Right", "Up"), _frozen_lake_text,
                      "You are walking on a frozen lake from the start S to the goal G. Do not fall into a hole.\n"
                      "Symbols: P you, S start, F frozen, H hole, G goal.\nActions: Left, Down, Right, Up."),
    "TaxiEnv": (("South", "North", "East", "West", "Pickup", "Dropoff"), _taxi_text,
                "You drive the taxi T on a 5x5 grid (walls are |). Pick the passenger up at their stop (R, G, Y or B) "
                "and drop them off at the destination. Each move costs 1; a wrong pickup or drop-off costs 10; the "
                "drop-off at the destination earns 20.\nActions: South, North, East, West, Pickup, Dropoff."),
}


class GymnasiumEnv(Env):
    """A Gymnasium environment played through text (see the module docstring)."""

    def __init__(
        self,
        id: str,
        kwargs: dict[str, Any] | None = None,
        action_names: Sequence[str] | None = None,
        action_parser: str | None = None,
        observation_text: str | None = None,
        instructions: str | None = None,
        tag: str | None = None,
    ) -> None:
        """
        Args:
            id: the Gymnasium id (``FrozenLake-v1``, ``Taxi-v4``, or a plugin's registered id).
            kwargs: passed to ``gymnasium.make`` (``is_slippery``, ``map_name``, ``max_episode_steps``, ...).
            action_names: the name of each action of a ``Discrete`` space, in order (built in for FrozenLake, Taxi).
            action_parser: class path of a function ``(text) -> action or None``, for any action space.
            observation_text: class path of a function ``(env, observation) -> str`` (built in for FrozenLake,
                Taxi; else the env's ansi render).
            instructions: the rules shown once in the prompt (built in for FrozenLake, Taxi; else a generic line).
            tag: metrics tag (default: the id without its version).
        """
        super().__init__(tag or id.split("-v")[0])
        try:
            import gymnasium
        except ImportError as err:
            raise ImportError("the gymnasium env needs Gymnasium: pip install 'ragen-pl[gymnasium]'") from err

        self.id, self.kwargs = id, dict(kwargs or {})
        probe = self._make(ansi=False)
        built_in = _BUILT_IN.get(type(probe.unwrapped).__name__)
        self._parser = _function("action_parser", action_parser)
        self._text = _function("observation_text", observation_text)
        space = probe.action_space
        self._first_action = int(getattr(space, "start", 0))  # Discrete(n, start): actions start..start+n-1
        if action_names is not None:
            names = tuple(str(a) for a in action_names)
            if not isinstance(space, gymnasium.spaces.Discrete) or len(names) != int(space.n):
                raise ValueError(f"`--data.env.init_args.action_names`: {len(names)} names for {id}'s action "
                                 f"space {space}; give one name per action of a Discrete space")
            self.actions = names
        elif self._parser is None:
            if built_in is None or not isinstance(space, gymnasium.spaces.Discrete):
                raise ValueError(f"`--data.env.init_args.action_names`: {id} has the action space {space} and no "
                                 f"built-in names; give action_names (Discrete) or action_parser (a class path)")
            self.actions = built_in[0]
        if self._text is None and built_in is not None:
            self._text = built_in[1]
        self._ansi = self._text is None
        if self._ansi and "ansi" not in (probe.metadata.get("render_modes") or []):
            raise ValueError(f"`--data.env.init_args.observation_text`: {id} renders no text (render modes "
                             f"{probe.metadata.get('render_modes')}); give the class path of a function "
                             f"(env, observation) -> str")
        probe.close()
        if instructions is None:
            listed = f"Actions: {', '.join(self.actions)}." if self.actions else "Answer with an action."
            instructions = built_in[2] if built_in is not None else f"You play the Gymnasium environment {id}.\n{listed}"
        self._instructions = instructions
        self._env: Any = None  # made in reset: every trajectory plays a deep copy of the configured env
        self._obs: Any = None
        self._done = False

    def _make(self, ansi: bool):
        import gymnasium

        kwargs = {**self.kwargs, "render_mode": "ansi"} if ansi else self.kwargs
        try:
            return gymnasium.make(self.id, **kwargs)
        except Exception as err:
            message = _ESCAPE.sub("", str(err))
            raise ValueError(f"`--data.env.init_args.id` {self.id!r} (kwargs {self.kwargs}): {message}") from None

    @property
    def instructions(self) -> str:
        return self._instructions

    def reset(self, seed: int) -> str:
        if self._env is None:
            self._env = self._make(self._ansi)
        self._obs, _ = self._env.reset(seed=seed)
        self._done = False
        return self.render()

    def render(self) -> str:
        if self._env is None:
            raise RuntimeError("reset the env before rendering it")
        if self._ansi:
            text = _ESCAPE.sub("", _COLOURED.sub(r"[\1]", self._env.render()))
            return text.strip("\n")
        return self._text(self._env, self._obs)

    def state_key(self) -> Hashable | None:
        """The observation where it is a number or an array of numbers; else None (the text is the key)."""
        value = self._obs.tolist() if hasattr(self._obs, "tolist") else self._obs
        if isinstance(value, list):
            flat = _flatten(value)
            return tuple(flat) if all(isinstance(v, (int, float, bool)) for v in flat) else None
        return value if isinstance(value, (int, float, bool, str)) else None

    def step(self, action: str) -> StepResult:
        if self._parser is not None:
            chosen = self._parser(action)
        else:
            index = self.parse_action(action)
            chosen = None if index is None else self._first_action + index
        if chosen is None or self._done:
            return self.invalid(self.render())
        before = self._obs
        self._obs, reward, terminated, truncated, info = self._env.step(chosen)
        self._done = bool(terminated or truncated)
        success = info.get("success", info.get("is_success", bool(terminated) and reward > 0))
        changed = not _equal(before, self._obs)
        return self.render(), float(reward), self._done, {"success": bool(success), "action_is_valid": True,
                                                          "action_is_effective": changed}


def _function(flag: str, path: str | None):
    """The callable a class path names (None for None); one line naming the flag when it cannot be had."""
    if path is None:
        return None
    try:
        fn = import_class_path(path)
    except Exception as err:
        raise ValueError(f"`--data.env.init_args.{flag}`: cannot import {path!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"`--data.env.init_args.{flag}`: {path!r} is not callable")
    return fn


def _flatten(value: list) -> list:
    return [x for v in value for x in (_flatten(v) if isinstance(v, list) else [v])]


def _equal(a: Any, b: Any) -> bool:
    try:
        import numpy as np

        return bool(np.array_equal(a, b))
    except Exception:  # noqa: BLE001 - observations without array semantics
        return a == b
