"""The experiments' SmolLM2 warm starts (ragen_pl_experiments.warm_starts), named models through the
`ragen_pl.models` entry points: each recipe, their resolution by name, and the layout warning for them."""

import pytest
from ragen_pl_experiments.warm_starts import RECIPES

from ragen_pl.models.smollm2 import SMOLLM2, SMOLLM2_WARM


@pytest.mark.parametrize("env", ["frozenlake", "sokoban"])
def test_effective_warm_start_is_its_envs_recipe_on_effective_play(env):
    from dataclasses import replace

    assert SMOLLM2_WARM[env].play == "random"
    assert RECIPES[f"{env}-effective"] == replace(SMOLLM2_WARM[env], play="effective")


@pytest.mark.parametrize("name", ["frozenlake", "sokoban", "frozenlake-effective", "sokoban-effective"])
def test_stateonly_warm_start_is_the_recipe_without_the_turn_header(name):
    from dataclasses import replace

    recipe = SMOLLM2_WARM[name] if name in SMOLLM2_WARM else RECIPES[name]
    assert "turn_header" not in recipe.rollout  # the cached builds of the header layout keep their keys
    assert RECIPES[f"{name}-stateonly"] == replace(recipe, rollout={**recipe.rollout, "turn_header": False})




def test_a_named_warm_start_resolves_through_its_entry_point_and_names_its_layout(monkeypatch, tmp_path):
    """`ragen-pl/smollm2-135m-warm-frozenlake-stateonly` resolves through the plugin (its build stubbed here), an
    unknown name lists every named model, and a run in another layout than the plugin's is named in one line."""
    import ragen_pl_experiments.warm_starts as warm_starts

    from ragen_pl.config import RolloutConfig
    from ragen_pl.errors import ConfigError
    from ragen_pl.models import resolve_model
    from ragen_pl.models.smollm2 import warm_layout_mismatch

    built = []
    monkeypatch.setattr(warm_starts, "build_warm_start", lambda key, recipe: built.append((key, recipe)) or tmp_path)
    assert resolve_model(f"{SMOLLM2}-warm-frozenlake-stateonly") == str(tmp_path)
    assert built == [("frozenlake-stateonly", RECIPES["frozenlake-stateonly"])]
    with pytest.raises(ConfigError, match=r"no such named model; choose one of .*warm-bandit.*"
                                          r"ragen-pl/smollm2-135m-warm-sokoban-stateonly"):
        resolve_model(f"{SMOLLM2}-warm-chess")
    taught = RolloutConfig(**RECIPES["frozenlake-stateonly"].rollout)
    assert warm_layout_mismatch(f"{SMOLLM2}-warm-frozenlake-stateonly", taught) is None
    header = RolloutConfig(**{**taught.__dict__, "turn_header": True})
    assert "--data.rollout.turn_header=True (taught: False)" in warm_layout_mismatch(
        f"{SMOLLM2}-warm-frozenlake-stateonly", header)


@pytest.mark.parametrize("key", ["coordfrozenlake", "coordsokoban"])
def test_a_coord_warm_start_teaches_its_configs_env_and_layout(key):
    """The warm start of a RAGEN-2 main-table config plays that config's env with its very arguments, in its rollout
    layout, and the config trains from it; the env is configs/ragen2/'s (same size, format and dynamics)."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    cfg = yaml.safe_load((root / "experiments" / "configs" / f"smollm2-{key}.yaml").read_text())
    recipe = RECIPES[key]
    assert cfg["model"]["model"] == f"{SMOLLM2}-warm-{key}"
    assert cfg["data"]["env"]["class_path"] == recipe.env and cfg["data"]["env"]["init_args"] == recipe.env_args
    assert cfg["data"]["rollout"] == recipe.rollout and recipe.play == "random"
    ragen2 = yaml.safe_load((root / "configs" / "ragen2" / f"{key.removeprefix('coord')}.yaml").read_text())
    assert ragen2["data"]["env"]["class_path"] == recipe.env
    assert {k: v for k, v in recipe.env_args.items() if k != "cell_separator"} == ragen2["data"]["env"]["init_args"]
