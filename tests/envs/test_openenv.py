"""OpenEnv both ways (issue 57), against a real ``ragen-pl serve`` on 127.0.0.1: an episode through the server equals
the same episode in-process, a rollout and 2 training iterations run through the client, and a server that dies
mid-episode fails its trajectories with the URL and seed, never a hang."""

from __future__ import annotations

import copy
import csv
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ragen_pl import registry
from ragen_pl.cli import main
from ragen_pl.config import RolloutConfig
from ragen_pl.envs.base import state_id
from ragen_pl.envs.openenv import OpenEnvClient, OpenEnvError, served
from ragen_pl.envs.sokoban import Sokoban
from ragen_pl.rollout.collector import Collector, EpisodeSpec
from ragen_pl.servers import free_port
from tests.rollout.test_collector import Scripted

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sokoban_server():
    with served("sokoban", max_sessions=64) as (url, _):
        yield url


def test_an_episode_through_the_server_is_the_episode_in_process(sokoban_server):
    client = OpenEnvClient(sokoban_server)
    assert client.tag == "Sokoban" and client.actions == Sokoban.actions
    assert client.instructions == Sokoban().instructions
    for seed in (0, 7, 123):
        here, there = Sokoban(), copy.deepcopy(client)
        assert there.reset(seed) == here.reset(seed)
        assert there.state_key() == state_id(here.state_key())  # GiGPO's anchors agree across the wire
        rng = random.Random(seed)
        for _ in range(15):
            action = rng.choice(Sokoban.actions + ("Jump",))
            mine, theirs = here.step(action), there.step(action)
            assert theirs[0] == mine[0] and theirs[1] == pytest.approx(mine[1]) and theirs[2] == mine[2]
            assert {k: theirs[3][k] for k in ("success", "action_is_valid", "action_is_effective")} == \
                   {k: bool(mine[3][k]) for k in ("success", "action_is_valid", "action_is_effective")}
            if mine[2]:
                break
        there.close()


def test_a_rollout_holds_one_session_per_trajectory_and_closes_them(sokoban_server, tiny):
    _, tok = tiny
    client = registry.resolve("envs", "openenv", base_url=sokoban_server)
    answers = ["go</think><answer>Up || Left</answer>", "go</think><answer>Down</answer>"]
    config = RolloutConfig(max_turns=2, max_actions_per_turn=2, max_actions_per_episode=10)
    collector = Collector(Scripted(tok, lambda turn, _: answers[turn]), tok, config)
    specs = [EpisodeSpec(client, seed=s, group_id=s // 4) for s in range(16)]
    remote = collector.collect(specs)
    local = collector.__class__(Scripted(tok, lambda turn, _: answers[turn]), tok, config).collect(
        [EpisodeSpec(Sokoban(), seed=s, group_id=s // 4) for s in range(16)])
    assert [e.failed for e in remote.episodes] == [None] * 16
    assert [e.env_return for e in remote.episodes] == pytest.approx([e.env_return for e in local.episodes])
    # The same anchor groups (the ids differ: the client keys a state by the id the server sent).
    on = local.batch.loss_mask
    pairs = set(zip(remote.batch.turn_states[on].tolist(), local.batch.turn_states[on].tolist()))
    assert len(pairs) == len({r for r, _ in pairs}) == len({line for _, line in pairs}) > 1
    assert all(e.env._ws is None for e in remote.episodes)  # every session ended with its trajectory


def test_two_iterations_train_through_the_client(sokoban_server, tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(ROOT / "configs" / "sokoban.yaml"), "--data.env=openenv",
                 f"--data.env.init_args.base_url={sokoban_server}", "--data.val_envs=null",
                 f"--model.model={tiny_model_path}", "--trainer.max_steps=2", "--trainer.precision=32-true",
                 "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.enable_checkpointing=false",
                 "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
                 f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.n_groups=2", "--data.group_size=4",
                 "--data.rollout.max_new_tokens=4", "--data.rollout.max_turns=2", "--model.ppo.mini_batch_size=8",
                 "--model.ppo.micro_batch_size=4"]) == 0
    with open(next(tmp_path.glob("sokoban/version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/played")]
    assert len(rows) == 2 and all(float(r["rollout/failed"]) == 0 for r in rows)


def test_a_server_that_dies_mid_episode_fails_the_trajectory_with_its_url_and_seed():
    with served("frozen_lake", {"slippery": False}, max_sessions=64) as (url, proc):
        client = copy.deepcopy(OpenEnvClient(url, timeout_s=5, retries=1))
        client.reset(42)
        assert client.step("Jump")[3]["action_is_valid"] is False  # not an action: the episode goes on
        proc.kill()
        proc.wait(timeout=30)
        start = time.monotonic()
        with pytest.raises(OpenEnvError, match=rf"OpenEnv server {url} \(episode seed 42\): step failed"):
            client.step("Down")
        with pytest.raises(OpenEnvError, match=r"\(episode seed 3\): reset failed after 2 tries"):
            client.reset(3)
        assert time.monotonic() - start < 15  # the timeouts, not a hang


def test_an_unreachable_server_and_bad_settings_are_one_line():
    port = free_port()
    with pytest.raises(ValueError, match=rf"base_url`: OpenEnv server http://127.0.0.1:{port} \(episode seed 0\): "
                                         r"reset failed after 1 tries"):
        OpenEnvClient(f"http://127.0.0.1:{port}", timeout_s=2, retries=0)
    with pytest.raises(ValueError, match=r"base_url` must be an http\(s\)://"):
        OpenEnvClient("localhost:8000")
    with pytest.raises(ValueError, match="retries` must be an integer >= 0"):
        OpenEnvClient("http://127.0.0.1:1", retries=-1)


def test_serve_refuses_a_bad_env_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "ragen_pl.cli", "serve", "--env", "nope"], capture_output=True,
                          text=True, timeout=120, env={**os.environ})
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: --env 'nope'")


def test_openenvs_own_client_plays_a_served_env(sokoban_server):
    """What TRL, SkyRL or verifiers would use: OpenEnv's GenericEnvClient (its sync wrapper) on ragen-pl's server."""
    from openenv.core.generic_client import GenericEnvClient

    here = Sokoban()
    with GenericEnvClient(base_url=sokoban_server).sync() as client:
        first = client.reset(seed=11)
        assert first.observation["text"] == here.reset(11) and first.done is False
        for action in ("Up", "Left", "Down", "Right"):
            result = client.step({"action": action})
            text, reward, done, info = here.step(action)
            assert (result.observation["text"], result.reward, result.done) == (text, pytest.approx(reward), done)
            assert result.observation["action_is_effective"] == bool(info["action_is_effective"])
            if done:
                break
