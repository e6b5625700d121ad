"""GiGPO (issue 58): verl-agent's numbers on random batches, hand-derived cases, anchor states from the rollout,
and groups that never span processes."""

from __future__ import annotations

import csv
import math
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from ragen_pl.advantages import GRPO, DrGRPO, GiGPO, discounted_step_returns, gigpo
from ragen_pl.cli import main
from ragen_pl.config import RolloutConfig
from ragen_pl.data import RolloutDataModule
from ragen_pl.envs.base import state_id
from ragen_pl.envs.frozen_lake import FrozenLake
from ragen_pl.envs.sokoban import Sokoban
from ragen_pl.rollout.collector import Collector, EpisodeSpec
from ragen_pl.types import TrajectoryBatch
from tests.helpers import make_batch, random_batch, split_into_turn_rows
from tests.rollout.test_collector import Scripted

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ verl-agent's semantics, as a plain loop
def verl_agent_reference(steps, gamma, w, mode, eps, cross_steps):
    """verl-agent's ``compute_gigpo_outcome_advantage`` (gigpo/core_gigpo.py) written over step rows with Python
    floats: every step row of an episode carries the episode's reward; episode-level statistics per group over its
    step rows (``compute_mean_std_cross_steps``) or its episodes, where a group of one gets mean 0 and std 1; step-level
    groups are the step rows of one group with the same anchor observation, where a group of one gets its own value
    as mean and std 1.

    ``steps``: dicts with group, episode, reward (the step's), anchor, in episode order.
    """
    episode_reward = defaultdict(float)
    for s in steps:
        episode_reward[s["episode"]] += s["reward"]
    returns, running = [0.0] * len(steps), {}
    for i in reversed(range(len(steps))):
        e = steps[i]["episode"]
        running[e] = steps[i]["reward"] + gamma * running.get(e, 0.0)
        returns[i] = running[e]

    def normalise(values, keys, lone_mean_zero):
        by_key = defaultdict(list)
        for v, k in zip(values, keys):
            by_key[k].append(v)
        out = []
        for v, k in zip(values, keys):
            xs = by_key[k]
            mean = sum(xs) / len(xs) if len(xs) > 1 or not lone_mean_zero else 0.0
            std = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 1.0
            out.append(v - mean if mode == "mean_norm" else (v - mean) / (std + eps))
        return out

    scores = [episode_reward[s["episode"]] for s in steps]
    if cross_steps:
        episode_adv = normalise(scores, [s["group"] for s in steps], True)
    else:
        firsts = {}
        for s in steps:
            firsts.setdefault(s["episode"], s["group"])
        per_episode = dict(zip(firsts, normalise([episode_reward[e] for e in firsts], list(firsts.values()), True)))
        episode_adv = [per_episode[s["episode"]] for s in steps]
    step_adv = normalise(returns, [(s["group"], s["anchor"]) for s in steps], False)
    return [a + w * b for a, b in zip(episode_adv, step_adv)]


def random_steps(rng: random.Random):
    """Groups of >= 2 episodes of 1-4 steps; anchors from a few states (so steps share them); rewards from a few
    values (so returns tie) or continuous."""
    steps, episode = [], 0
    discrete = rng.random() < 0.5
    for group in range(rng.randint(1, 4)):
        for _ in range(rng.randint(2, 5)):
            for _ in range(rng.randint(1, 4)):
                reward = rng.choice([0.0, 0.0, 1.0, -0.1]) if discrete else rng.gauss(0, 1)
                reward = float(torch.tensor(reward, dtype=torch.float32))  # what a batch holds
                steps.append({"group": group * 7 + 3, "episode": episode, "reward": reward,
                              "anchor": rng.randint(0, 3)})
            episode += 1
    return steps


def batch_of(steps, rng: random.Random) -> TrajectoryBatch:
    """One row per episode: each step is a turn of 1-3 sampled tokens after 1-2 env tokens; its reward on its last
    token, or halved exactly onto its first and last; its anchor on each of its tokens."""
    episodes = defaultdict(list)
    for s in steps:
        episodes[s["episode"]].append(s)
    rows = []
    for its in episodes.values():
        mask, rewards, turns, states = [False], [0.0], [-1], [0]
        for k, s in enumerate(its):
            n_env, n = rng.randint(1, 2), rng.randint(1, 3)
            parts = [0.0] * (n - 1) + [s["reward"]]
            if n > 1 and rng.random() < 0.5:
                parts[0] = parts[-1] = s["reward"] / 2
            mask += [False] * n_env + [True] * n
            rewards += [0.0] * n_env + parts
            turns += [-1] * n_env + [k] * n
            states += [0] * n_env + [state_id(("anchor", s["anchor"]))] * n
        rows.append((mask, rewards, turns, states, its[0]["group"]))
    T = max(len(r[0]) for r in rows)
    pad = [(m + [False] * (T - len(m)), r + [0.0] * (T - len(r)), t + [-1] * (T - len(t)), s + [0] * (T - len(s)), g)
           for m, r, t, s, g in rows]
    b = make_batch([p[0] for p in pad], rewards=[p[1] for p in pad], turn_ids=[p[2] for p in pad],
                   group_ids=[p[4] for p in pad])
    b.turn_states = torch.tensor([p[3] for p in pad], dtype=torch.long)
    return b


def per_step_advantages(batch: TrajectoryBatch, adv: torch.Tensor) -> list[float]:
    """Each turn's advantage in episode and turn order (asserting it is the same on all its tokens)."""
    out = []
    st = batch.stitch
    mask, turns, a = st(batch.loss_mask), st(batch.turn_ids), st(adv)
    for i in range(mask.shape[0]):
        for k in turns[i][mask[i]].unique().tolist():
            values = a[i][mask[i] & (turns[i] == k)]
            assert_close(values, values[:1].expand_as(values))
            out.append(float(values[0]))
    return out


def test_matches_verl_agent_on_300_random_batches():
    rng = random.Random(58)
    for case in range(300):
        steps = random_steps(rng)
        gamma, w = rng.choice([0.95, 1.0, 0.5, rng.random()]), rng.choice([1.0, 0.0, 0.5, rng.uniform(0, 2)])
        mode, cross = rng.choice(["mean_norm", "mean_std_norm"]), rng.random() < 0.5
        batch = batch_of(steps, rng)
        if case % 3 == 0:
            batch = split_into_turn_rows(batch)  # the context-window layout: one row per turn
        estimator = GiGPO(step_advantage_w=w, mode=mode, gamma=gamma, compute_mean_std_cross_steps=cross)
        adv, returns = estimator(batch)
        assert returns is None
        assert float(adv[~batch.loss_mask].abs().sum()) == 0.0
        expected = verl_agent_reference(steps, gamma, w, mode, 1e-6, cross)
        assert_close(torch.tensor(per_step_advantages(batch, adv)), torch.tensor(expected), atol=2e-5, rtol=2e-5,
                     msg=f"case {case}: gamma={gamma} w={w} mode={mode} cross_steps={cross}")


# --------------------------------------------------------------------------------------------- by hand
def two_episodes(**kwargs):
    """Episode A: states s0 -> s1, rewards 0 then 1. Episode B: s0 -> s2, rewards 0 then 0. One group."""
    steps = [{"group": 0, "episode": 0, "reward": 0.0, "anchor": 0}, {"group": 0, "episode": 0, "reward": 1.0, "anchor": 1},
             {"group": 0, "episode": 1, "reward": 0.0, "anchor": 0}, {"group": 0, "episode": 1, "reward": 0.0, "anchor": 2}]
    batch = batch_of(steps, random.Random(0))
    return per_step_advantages(batch, GiGPO(**kwargs)(batch)[0])


def test_hand_derived():
    # Scores A=1, B=0 over 4 step rows: mean 0.5 -> episode advantages +0.5 (A), -0.5 (B).
    # Returns with gamma 0.5: A 0.5, 1; B 0, 0. Anchor s0 holds A0 (0.5) and B0 (0): mean 0.25 -> +0.25, -0.25;
    # s1 and s2 hold one step each: step advantage 0.
    assert two_episodes(gamma=0.5) == pytest.approx([0.75, 0.5, -0.75, -0.5])
    assert two_episodes(gamma=0.5, step_advantage_w=2.0) == pytest.approx([1.0, 0.5, -1.0, -0.5])
    # The step weight 0 leaves the episode-level advantage alone.
    assert two_episodes(gamma=0.5, step_advantage_w=0.0) == pytest.approx([0.5, 0.5, -0.5, -0.5])
    # mean_std_norm: episode scores [1, 1, 0, 0] have std 1/sqrt(3); anchor s0's returns [0.5, 0] std 1/sqrt(8).
    e, s = 0.5 / (3 ** -0.5 + 1e-6), 0.25 / (8 ** -0.5 + 1e-6)
    assert two_episodes(gamma=0.5, mode="mean_std_norm") == pytest.approx([e + s, e, -e - s, -e])


def test_equal_returns_and_singleton_anchors_give_zero_step_advantage():
    ones = torch.ones(4, dtype=torch.float64)
    ep, step = gigpo(ones, torch.zeros(4), torch.tensor([0, 0, 1, 1]), ones, torch.tensor([5, 5, 5, 5]))
    assert ep.tolist() == [0.0] * 4 and step.tolist() == [0.0] * 4
    _, step = gigpo(ones, torch.zeros(4), torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 2.0, 3.0, 4.0]),
                    torch.tensor([0, 1, 2, 3]), mode="mean_std_norm")
    assert step.tolist() == [0.0] * 4  # every anchor group is a singleton
    # Equal states in different groups are different anchors.
    _, step = gigpo(ones, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 2, 3]), torch.tensor([1.0, 2.0, 3.0, 5.0]),
                    torch.tensor([9, 9, 9, 9]))
    assert step.tolist() == [-0.5, 0.5, -1.0, 1.0]


def test_discounted_step_returns_restart_at_each_episode():
    r = discounted_step_returns(torch.tensor([1.0, 0.0, 2.0, 3.0, 1.0]), torch.tensor([0, 0, 0, 1, 1]), 0.5)
    assert r.tolist() == [1.5, 1.0, 2.0, 3.5, 1.0]


@pytest.mark.parametrize("seed", range(5))
def test_step_weight_zero_is_grpo_or_dr_grpo(seed):
    """Without the step level and with statistics over episodes, GiGPO's episode level is GRPO (mean_std_norm) or
    Dr. GRPO (mean_norm)."""
    b = random_batch(12, 40, groups=3, turns=3, seed=seed)
    for mode, reference in (("mean_std_norm", GRPO()), ("mean_norm", DrGRPO())):
        est = GiGPO(step_advantage_w=0.0, mode=mode, compute_mean_std_cross_steps=False)
        assert_close(est(b)[0], reference(b)[0], atol=1e-5, rtol=1e-5)


def test_an_episode_alone_in_its_group_gets_zero():
    """Its group-mates failed: nothing to compare with. (verl-agent gives a group of one step row mean 0 and std 1,
    so that episode's raw score; ragen-pl's group estimators give 0, as GRPO does.)"""
    b = make_batch([[0, 1, 1], [0, 1, 1], [0, 1, 1]], rewards=[[0, 0, 1], [0, 0, 0], [0, 0, 3]],
                   turn_ids=[[-1, 0, 0]] * 3, group_ids=[0, 0, 1])
    b.turn_states = torch.zeros(3, 3, dtype=torch.long)
    adv = GiGPO()(b)[0]
    assert adv[2].tolist() == [0.0, 0.0, 0.0]
    assert adv[0, 1:].tolist() == [1.0, 1.0] and adv[1, 1:].tolist() == [-1.0, -1.0]  # 0.5 + 0.5 each


def test_settings_and_missing_states_are_named():
    for kwargs, flag in (({"mode": "mean"}, "mode"), ({"gamma": 1.5}, "gamma"), ({"step_advantage_w": -1}, "step_"),
                         ({"epsilon": -1.0}, "epsilon")):
        with pytest.raises(ValueError, match=f"`{flag}"):
            GiGPO(**kwargs)
    b = make_batch([[0, 1]], group_ids=[0])
    with pytest.raises(ValueError, match="turn_states"):
        GiGPO()(b)


def test_metrics_describe_the_anchor_groups():
    est = GiGPO(gamma=0.5)
    steps = [{"group": 0, "episode": 0, "reward": 0.0, "anchor": 0}, {"group": 0, "episode": 0, "reward": 1.0, "anchor": 1},
             {"group": 0, "episode": 1, "reward": 0.0, "anchor": 0}, {"group": 0, "episode": 1, "reward": 0.0, "anchor": 2}]
    est(batch_of(steps, random.Random(1)))
    m = est.metrics()
    assert float(m["gigpo/anchor_group_size"]) == pytest.approx(4 / 3)  # groups {A0, B0}, {A1}, {B1}
    assert float(m["gigpo/grouped_turn_frac"]) == pytest.approx(0.5)
    assert float(m["gigpo/step_adv_abs_mean"]) == pytest.approx(0.125)


# ------------------------------------------------------------------------------------------ anchor states
def test_state_ids_are_the_same_in_every_process_and_refuse_unhashable_keys():
    key = ((1, 2), "frozen", None, 0.5, b"x", True)
    here = state_id(key)
    code = f"from ragen_pl.envs.base import state_id; print(state_id({key!r}))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(there) == here  # str hashes are salted per process; these ids are not
    assert state_id("a") != state_id(("a",)) and state_id(1) != state_id("1")
    with pytest.raises(TypeError, match=r"state_key\(\) must return .* got \[1, 2\] \(a list inside\)"):
        state_id([1, 2])


def test_the_rollout_records_the_state_each_turn_started_in(tiny):
    """Two FrozenLake turns: the first starts at the start cell, the second where the first moved to. An env without
    state_key() is keyed by its observation text."""
    _, tok = tiny
    answers = {0: "go</think><answer>Right</answer>", 1: "go</think><answer>Down</answer>"}
    config = RolloutConfig(max_turns=2, max_actions_per_turn=1, max_actions_per_episode=10)

    class Textual(FrozenLake):
        def state_key(self):
            return None

    for env in (FrozenLake(size=4, slippery=False), Textual(size=4, slippery=False)):
        probe = FrozenLake(size=4, slippery=False)
        first_obs = probe.reset(3)
        first = probe.state_key() if env.state_key.__func__ is FrozenLake.state_key else first_obs
        probe.step("Right")
        second = probe.state_key() if env.state_key.__func__ is FrozenLake.state_key else probe.render()
        result = Collector(Scripted(tok, lambda turn, _: answers[turn]), tok, config).collect(
            [EpisodeSpec(env, seed=3, group_id=0)])
        batch = result.batch
        assert result.episodes[0].turns == 2, "the episode ended early: pick a seed whose first move is safe"
        for turn, key in ((0, first), (1, second)):
            on = batch.loss_mask[0] & (batch.turn_ids[0] == turn)
            assert set(batch.turn_states[0][on].tolist()) == {state_id(key)}


def test_sokoban_keys_the_player_and_boxes():
    """A move changes the key exactly when it changes the board."""
    start = Sokoban()
    start.reset(0)
    for action in Sokoban.actions:
        moved = Sokoban()
        moved.reset(0)
        moved.step(action)
        assert (moved.state_key() == start.state_key()) == (moved.render() == start.render())


# ------------------------------------------------------------------------------------- across processes
class Played(Exception):
    pass


def test_every_group_is_played_whole_on_one_rank(monkeypatch):
    """Groups never span ranks: each rank plays n_groups / world whole groups, so GiGPO's episode and anchor
    groups are complete on the rank that computes them (a 2-process run: tests/test_distributed.py)."""
    seen: dict[int, list[int]] = {}
    for rank in range(2):
        monkeypatch.setattr(RolloutDataModule, "world", property(lambda self, r=rank: (r, 2)))
        dm = RolloutDataModule(FrozenLake(), n_groups=4, group_size=3)

        def collect(specs, rank=rank, **_):
            for spec in specs:
                seen.setdefault(spec.group_id, []).append(rank)
            raise Played

        monkeypatch.setattr(dm, "_collect", collect)
        with pytest.raises(Played):
            dm.play_training_rollout()
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(len(ranks) == 3 and len(set(ranks)) == 1 for ranks in seen.values())
    assert {ranks[0] for ranks in seen.values()} == {0, 1}


COMPOSED = {
    "filter": [],
    "gspo": ["--config", str(ROOT / "configs" / "variants" / "gspo.yaml")],
    "dr_grpo aggregation": ["--model.ppo.loss_agg=seq-mean-token-sum-norm", "--model.ppo.loss_agg_norm=64"],
    "lora": ["--model.lora.r=4", "--model.lora.alpha=8", "--model.lora.target_modules=all-linear"],
}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_gigpo_composes_and_logs_its_anchor_groups(name, tiny_model_path, tmp_path, monkeypatch):
    """One iteration on Sokoban with StarPO-S's variance filter, composed with a token-level loss or LoRA."""
    if name == "lora":
        pytest.importorskip("peft", reason="LoRA needs peft (pip install 'ragen-pl[peft]')")
    monkeypatch.chdir(tmp_path)
    extra = COMPOSED[name]
    variant = extra if extra[:1] == ["--config"] else []  # before gigpo.yaml, whose advantage then wins
    flags = [] if variant else extra
    args = ["fit", "--config", str(ROOT / "configs" / "sokoban.yaml"), *variant, "--config",
            str(ROOT / "configs" / "variants" / "gigpo.yaml"), *flags, f"--model.model={tiny_model_path}",
            "--trainer.max_steps=1", "--trainer.precision=32-true", "--trainer.accelerator=cpu",
            "--trainer.devices=1", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.limit_val_batches=0", f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--data.n_groups=4", "--data.group_size=3", "--data.rollout.max_new_tokens=4",
            "--data.rollout.max_turns=3", "--data.filter.init_args.top_p=0.5", "--model.ppo.mini_batch_size=6",
            "--model.ppo.micro_batch_size=3"]
    assert main(args) == 0
    with open(next(tmp_path.glob("sokoban/version_*/metrics.csv"))) as f:
        row = next(r for r in csv.DictReader(f) if r.get("gigpo/anchor_group_size"))
    assert float(row["gigpo/anchor_group_size"]) >= 1.0
    assert 0.0 <= float(row["gigpo/grouped_turn_frac"]) <= 1.0
    assert float(row["filter/kept_frac"]) == 0.5
    assert math.isfinite(float(row["loss/policy"]))
