"""Gymnasium envs through the ``gymnasium`` env plugin (issue 57): no code for the toy-text envs, the same episodes as
ragen-pl's own FrozenLake on the same map, and one-line errors for what cannot be played as text."""

from __future__ import annotations

import random
from pathlib import Path

import gymnasium  # a dev dependency: the test command installs it
import pytest

from ragen_pl import registry
from ragen_pl.cli import main
from ragen_pl.envs.frozen_lake import FrozenLake
from ragen_pl.envs.gym import GymnasiumEnv

ROOT = Path(__file__).resolve().parents[2]


def same_map(ours: FrozenLake) -> list[str]:
    """ragen-pl's map as Gymnasium's ``desc``."""
    n = ours.size
    return ["".join("S" if (r, c) == ours.start else "G" if (r, c) == ours.goal else "H" if (r, c) in ours.holes
                    else "F" for c in range(n)) for r in range(n)]


@pytest.mark.parametrize("seed", range(12))
def test_gymnasiums_frozen_lake_plays_the_episodes_of_ragen_pls(seed):
    """Same map, same actions: the same moves, rewards, ends and successes (not slippery: the two envs draw slips
    from different generators)."""
    ours = FrozenLake(size=4, slippery=False)
    ours.reset(seed)
    theirs = GymnasiumEnv("FrozenLake-v1", kwargs={"desc": same_map(ours), "is_slippery": False})
    text = theirs.reset(seed)
    assert text.splitlines()[ours.start[0]][ours.start[1]] == "P"
    rng = random.Random(seed)
    for _ in range(12):
        action = rng.choice(FrozenLake.actions + ("Jump",))
        _, r1, done1, info1 = ours.step(action)
        _, r2, done2, info2 = theirs.step(action.lower())
        assert (r1, done1, info1["success"], info1["action_is_valid"]) == \
               (r2, done2, info2["success"], info2["action_is_valid"])
        assert theirs.state_key() == ours.pos[0] * 4 + ours.pos[1]
        if info1["action_is_valid"]:
            assert info1["action_is_effective"] == info2["action_is_effective"]
        if done1:
            assert theirs.step("Left")[3]["action_is_valid"] is False  # a finished episode takes no action
            break


def test_taxi_and_frozen_lake_need_no_code():
    taxi_id = next(i for i in ("Taxi-v4", "Taxi-v3") if i in gymnasium.registry)
    taxi = registry.resolve("envs", "gymnasium", id=taxi_id)
    first = taxi.reset(7)
    assert first == taxi.reset(7) and "Destination" in first and "T" in first  # the seed fixes the episode
    assert taxi.actions == ("South", "North", "East", "West", "Pickup", "Dropoff")
    obs, reward, done, info = taxi.step("Pickup")
    assert info["action_is_valid"] and reward == -10 and not done  # no passenger at the taxi: a wrong pickup
    assert taxi.step("Fly")[3]["action_is_valid"] is False
    lake = registry.resolve("envs", "gymnasium", id="FrozenLake-v1")
    assert lake.tag == "FrozenLake" and "Left, Down, Right, Up" in lake.instructions
    assert lake.reset(0).count("P") == 1


def test_an_ansi_render_marks_its_coloured_cells():
    """Without a built-in renderer, the ansi text is used, with the cell Gymnasium colours written as [x]."""
    env = GymnasiumEnv("FrozenLake-v1", action_names=["a", "b", "c", "d"], instructions="walk")
    env._text, env._ansi = None, True  # as for an env with no built-in renderer
    assert env.reset(0).splitlines()[0] == "[S]FFF"
    assert "\x1b" not in env.render()


def test_what_cannot_be_played_as_text_is_one_line():
    with pytest.raises(ValueError, match=r"init_args.id` 'NoSuchEnv-v0'"):
        GymnasiumEnv("NoSuchEnv-v0")
    with pytest.raises(ValueError, match=r"action_names`: CartPole-v1 has the action space Discrete\(2\)"):
        GymnasiumEnv("CartPole-v1")
    with pytest.raises(ValueError, match=r"observation_text`: CartPole-v1 renders no text"):
        GymnasiumEnv("CartPole-v1", action_names=["Left", "Right"])
    with pytest.raises(ValueError, match=r"action_names`: 3 names for FrozenLake-v1"):
        GymnasiumEnv("FrozenLake-v1", action_names=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"action_parser`: cannot import 'nowhere.parse'"):
        GymnasiumEnv("FrozenLake-v1", action_parser="nowhere.parse")


def cart_text(env, obs) -> str:
    return "pole " + " ".join(f"{x:+.2f}" for x in obs)


def test_a_class_path_renders_and_names_any_env():
    env = GymnasiumEnv("CartPole-v1", action_names=["Left", "Right"], observation_text=f"{__name__}.cart_text")
    assert env.reset(3).startswith("pole ") and env.reset(3) == env.reset(3)
    key = env.state_key()
    assert isinstance(key, tuple) and len(key) == 4
    obs, reward, done, info = env.step("Right")
    assert reward == 1.0 and info["action_is_effective"] and not info["success"]


def test_a_fit_trains_on_gymnasiums_frozen_lake(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(ROOT / "configs" / "bandit.yaml"),
                 "--data.env=gymnasium", "--data.env.init_args.id=FrozenLake-v1",
                 "--data.env.init_args.kwargs={is_slippery: false}", "--data.val_envs=null",
                 f"--model.model={tiny_model_path}", "--trainer.max_steps=1", "--trainer.precision=32-true",
                 "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false",
                 "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
                 "--trainer.limit_val_batches=0", "--data.n_groups=2", "--data.group_size=2",
                 "--data.rollout.max_new_tokens=4", "--data.rollout.max_turns=2", "--model.ppo.mini_batch_size=4",
                 "--model.ppo.micro_batch_size=2"]) == 0

