"""The text-environment interface every env plugin implements.

One ``Env`` instance plays one episode at a time. The rollout collector (not the env) owns prompts, action parsing
and format penalties; an env only knows its rules:

* ``reset(seed)`` starts an episode and returns the observation text. The same seed gives the same initial state,
  byte for byte, in any process.
* ``step(action)`` takes one action string and returns ``(observation, reward, done, info)``. ``info`` carries at
  least ``success``, ``action_is_valid`` and ``action_is_effective``. An invalid action (an unknown name, or a
  malformed expression in a language env) changes nothing, returns reward 0 and ``action_is_valid=False``; it
  never raises.
* ``instructions`` is the text a prompt shows once: rules, symbol legend, action list.
* ``state_key()`` (optional) names the current state for GiGPO's anchor-state groups; without it the observation
  text is the key.

Discrete envs list their action names in ``actions`` and match them case-insensitively; language envs set
``actions = None`` and take free text.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypedDict

from ragen_pl.config import check_int

__all__ = ["OBSERVATION_FORMATS", "Env", "StepInfo", "StepResult", "anchor_state", "check_int", "check_observation_format",
           "check_range", "check_separator", "formatted_observation", "grid_text", "state_id"]


class StepInfo(TypedDict, total=False):
    success: bool
    action_is_valid: bool
    action_is_effective: bool


StepResult = tuple[str, float, bool, dict[str, Any]]


class Env(ABC):
    """Base class of text environments (entry-point group ``ragen_pl.envs``)."""

    #: Action names for discrete envs (matched case-insensitively); ``None`` for free-text envs. A class attribute
    #: for fixed action sets; set it on the instance when the names are configurable (Bandit's arms).
    actions: tuple[str, ...] | None = None

    def __init__(self, tag: str | None = None) -> None:
        """
        Args:
            tag: name used to group metrics and rewards by env (defaults to the class name). Variants of one env
                (say Sokoban 8x8) get their own tag.
        """
        self.tag = tag or type(self).__name__

    @abstractmethod
    def reset(self, seed: int) -> str:
        """Start an episode from the initial state determined by ``seed``; return the observation."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action; return ``(observation, reward, done, info)``."""

    @property
    @abstractmethod
    def instructions(self) -> str:
        """Rules, symbol legend and action list, shown once at the start of a prompt."""

    @abstractmethod
    def render(self) -> str:
        """The current state as text."""

    def expert_action(self) -> str:
        """The next action of a strong policy (a solver, or the known best arm), for demos and baselines."""
        raise NotImplementedError(f"{type(self).__name__} ships no expert policy")

    def effective_actions(self) -> tuple[str, ...]:
        """The actions whose intended move changes the state here (no walk into a wall or off the map). Knows the
        rules, not the goal: random play over them is still random, only board-aware (``play="effective"``
        of :func:`ragen_pl.sft.demonstrations`). Default: every action."""
        if self.actions is None:
            raise TypeError(f"{type(self).__name__} takes free text; it has no named actions")
        return self.actions

    def state_key(self) -> Hashable | None:
        """The current state as a key: turns of one group that start in states with equal keys form an anchor-state
        group (:class:`ragen_pl.advantages.GiGPO`). A str, int, float, bool, bytes, None or a tuple of them; equal states
        must give equal keys in any process. Default None: the observation text is the key, which is exact for envs
        whose observation shows the whole state (a counter the text leaves out would split nothing it should)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the episode holds (a connection, a process); the collector calls it once the trajectory
        ends. Default: nothing."""

    def parse_action(self, text: str) -> int | None:
        """Index of a discrete action name (case-insensitive, surrounding whitespace ignored), else ``None``."""
        if self.actions is None:
            raise TypeError(f"{type(self).__name__} takes free text; it has no named actions")
        lookup = _action_lookup(self.actions)
        return lookup.get(text.strip().lower())

    @staticmethod
    def invalid(observation: str) -> StepResult:
        """The result of an action that is not valid: nothing changes, no reward."""
        return observation, 0.0, False, {"success": False, "action_is_valid": False, "action_is_effective": False}


_LOOKUPS: dict[tuple[str, ...], dict[str, int]] = {}


def _action_lookup(actions: tuple[str, ...]) -> dict[str, int]:
    table = _LOOKUPS.get(actions)
    if table is None:
        table = _LOOKUPS[actions] = {name.lower(): i for i, name in enumerate(actions)}
    return table


_KEY_ATOMS = (str, bytes, int, float, bool, type(None))


def state_id(key: Hashable) -> int:
    """A state key as a signed 64-bit id, equal in every process (Python's ``hash`` of a str is salted per process).

    Raises:
        TypeError: ``key`` is not a str, int, float, bool, bytes, None or a (nested) tuple of them.
    """
    def check(k: Any) -> None:
        if isinstance(k, tuple):
            for part in k:
                check(part)
        elif not isinstance(k, _KEY_ATOMS):
            raise TypeError(f"state_key() must return a str, int, float, bool, bytes, None or a tuple of them, got "
                            f"{key!r} (a {type(k).__name__} inside)")

    check(key)
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def anchor_state(env: Env, observation: str) -> int:
    """The id of the state ``env`` is in, whose text is ``observation``: its ``state_key()``, else the text."""
    key = env.state_key()
    return state_id(observation if key is None else key)


#: How a grid env writes its state (RAGEN-2's): the symbols, zero-indexed coordinates, or both.
OBSERVATION_FORMATS = ("grid", "coord", "grid_coord")


def check_observation_format(value: Any) -> str:
    if value not in OBSERVATION_FORMATS:
        raise ValueError(f"`observation_format` must be 'grid', 'coord' or 'grid_coord', got {value!r}")
    return value


def formatted_observation(observation_format: str, grid: Callable[[], str], coordinates: Callable[[], str]) -> str:
    """The state in ``observation_format``: the grid, the coordinates, or both as RAGEN-2 joins them."""
    if observation_format == "grid":
        return grid()
    coords = coordinates()
    return coords if observation_format == "coord" else f"Coordinates: \n{coords}\nGrid Map: \n{grid()}"


def check_separator(name: str, value: Any, symbols: Iterable[str]) -> str:
    """``value`` as a cell separator of a text grid: a short string without newlines or any of the grid's symbols."""
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a string, got {value!r} ({type(value).__name__})")
    if len(value) > 4 or "\n" in value or any(s in value for s in symbols):
        raise ValueError(f"`{name}` must be at most 4 characters with no newline and no grid symbol, got {value!r}")
    return value


def grid_text(rows: Iterable[Sequence[str]], separator: str = "") -> str:
    """A text grid: one line per row, its cells joined by ``separator``.

    RAGEN writes the cells side by side (``separator=""``). A BPE tokenizer then merges runs of them (SmolLM2 reads
    ``____`` as one token and ``P__O`` as ``P``, ``__``, ``O``), so no token says which column it covers; ``" "``
    gives every cell a token of its own (``_``, `` _``, `` P``, ...), the same state in another spelling.
    """
    return "\n".join(separator.join(row) for row in rows)


def check_range(name: str, value: float, low: float | None = None, high: float | None = None) -> None:
    """Raise ``ValueError`` naming the field when ``value`` is outside ``[low, high]``."""
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"`{name}` must be in [{lo}, {hi}], got {value!r}")
