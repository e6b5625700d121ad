"""SmolLM2 warm starts of the readout runs, as named models (entry-point group ``ragen_pl.models``).

``ragen-pl/smollm2-135m-warm-<env>-effective`` (``frozenlake``, ``sokoban``) plays random *effective* moves instead of
random legal ones (no walk into a wall or off the map): still no goal, reward or solver in them, but the answer
depends on the board from the start. ``-stateonly`` after any of the four warm starts of FrozenLake and Sokoban: the
same recipe in prompts without the turn header (``--data.rollout.turn_header=false``), where a window-1 prompt is the
rules and the current board alone.

``ragen-pl/smollm2-135m-warm-coordfrozenlake`` and ``-coordsokoban``: the v1 recipes (random legal play, 10 one-action
turns, window 1) on RAGEN-2's main-table envs as ``configs/ragen2/`` sets them, grid plus coordinates
(``experiments/configs/smollm2-coord*.yaml``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ragen_pl.models import NamedModel
from ragen_pl.models.smollm2 import SMOLLM2_WARM, WarmStart, build_warm_start

__all__ = ["COORD_ENVS", "RECIPES", "WarmStartModel"]


#: RAGEN-2's main-table envs (configs/ragen2/), with the readout layout's spaced cells.
COORD_ENVS = {
    "coordfrozenlake": ("frozenlake", {"size": 4, "frozen_prob": 0.9, "slippery": True, "success_rate": 1.0,
                                       "observation_format": "grid_coord", "generator": "ragen2", "cell_separator": " ",
                                       "tag": "CoordFrozenLake"}),
    "coordsokoban": ("sokoban", {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 100,
                                 "observation_format": "grid_coord", "cell_separator": " ", "tag": "CoordSokoban"}),
}


def _recipe(key: str) -> WarmStart:
    env, *variants = key.split("-")
    if env in COORD_ENVS:
        base, env_args = COORD_ENVS[env]
        recipe = replace(SMOLLM2_WARM[base], env_args=env_args)
    else:
        recipe = SMOLLM2_WARM[env]
    if "effective" in variants:
        recipe = replace(recipe, play="effective")
    if "stateonly" in variants:
        recipe = replace(recipe, rollout={**recipe.rollout, "turn_header": False})
    return recipe


#: The warm starts this package adds, by the key after ``ragen-pl/smollm2-135m-warm-``.
RECIPES = {key: _recipe(key) for key in ("frozenlake-effective", "sokoban-effective", "frozenlake-stateonly",
                                         "sokoban-stateonly", "frozenlake-effective-stateonly",
                                         "sokoban-effective-stateonly", *COORD_ENVS)}


class WarmStartModel(NamedModel):
    """One of :data:`RECIPES`, built into the cache on first use."""

    key: str

    def path(self) -> Path:
        return build_warm_start(self.key, RECIPES[self.key])

    def taught_rollout(self) -> dict:
        return RECIPES[self.key].rollout


# One class per entry point: the registry instantiates an entry's class with no arguments.
FrozenLakeEffective = type("FrozenLakeEffective", (WarmStartModel,), {"key": "frozenlake-effective"})
SokobanEffective = type("SokobanEffective", (WarmStartModel,), {"key": "sokoban-effective"})
FrozenLakeStateOnly = type("FrozenLakeStateOnly", (WarmStartModel,), {"key": "frozenlake-stateonly"})
SokobanStateOnly = type("SokobanStateOnly", (WarmStartModel,), {"key": "sokoban-stateonly"})
FrozenLakeEffectiveStateOnly = type("FrozenLakeEffectiveStateOnly", (WarmStartModel,),
                                    {"key": "frozenlake-effective-stateonly"})
SokobanEffectiveStateOnly = type("SokobanEffectiveStateOnly", (WarmStartModel,), {"key": "sokoban-effective-stateonly"})
CoordFrozenLake = type("CoordFrozenLake", (WarmStartModel,), {"key": "coordfrozenlake"})
CoordSokoban = type("CoordSokoban", (WarmStartModel,), {"key": "coordsokoban"})
