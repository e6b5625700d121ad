"""Rollouts played ahead of the update (``--data.max_staleness``): the schedule, the weights, the faults.

The schedule is checked with a fake play and sync (which weights each rollout sampled, when the engine was written,
what a checkpoint keeps); the process engine against the in-process one on the same weights and seed; the whole
loop through the CLI with the tiny model (staleness logged, an exact resume, a killed rollout process, refusals).
"""

from __future__ import annotations

import csv
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from ragen_pl.cli import main
from ragen_pl.rollout.ahead import Played, RolloutsAhead
from ragen_pl.types import TrajectoryBatch

ROOT = Path(__file__).resolve().parents[2]


class FakeSide:
    """A trainer and an engine: ``version`` counts updates; the engine holds the version last synced."""

    def __init__(self, play_s: float = 0.0, fail_at: int | None = None) -> None:
        self.version = 0
        self.engine_holds = None
        self.synced_at: list[int] = []
        self.sampled: dict[int, int] = {}
        self.play_s, self.fail_at = play_s, fail_at
        self.playing = threading.Event()
        self.state = {"draws": 0}

    def play(self, i: int) -> Played:
        self.playing.set()
        time.sleep(self.play_s)
        if i == self.fail_at:
            raise RuntimeError(f"env server down in rollout {i}")
        self.sampled[i] = self.engine_holds
        self.state["draws"] += 1
        return Played(i, _batch(i), {"rollout/success": torch.tensor(float(i))}, [], 2)

    def sync(self) -> None:
        self.engine_holds = self.version
        self.synced_at.append(self.version)

    def state_dict(self):
        return dict(self.state)


def _batch(i: int) -> TrajectoryBatch:
    ids = torch.full((2, 3), i)
    return TrajectoryBatch(ids, torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool),
                           torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), torch.tensor([i, i]), ("a", "a"))


def _train(side: FakeSide, ahead: RolloutsAhead, steps: int, start: int = 0, update_s: float = 0.0) -> list[Played]:
    taken = []
    for step in range(start, start + steps):
        played = ahead.take(step)
        ahead.refill(step)
        taken.append(played)
        time.sleep(update_s)
        side.version += 1  # the update
    return taken


@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_rollout_samples_with_weights_at_most_k_updates_old_and_in_order(k):
    side = FakeSide(play_s=0.002)
    engine = type("E", (), {"state_dict": side.state_dict})()
    ahead = RolloutsAhead(side.play, side.sync, engine, k, first_iteration=0)
    taken = _train(side, ahead, 12, update_s=0.003)
    ahead.close()
    assert [p.iteration for p in taken] == list(range(12))  # each iteration once, in order
    for step, played in enumerate(taken):
        assert played.version == side.sampled[step]  # the version recorded is the one the engine held
        assert 0 <= step - played.version <= k
    # Rollout i samples with version max(0, i - k): written only when a rollout needs it, never mid-rollout.
    assert [p.version for p in taken] == [max(0, i - k) for i in range(12)]
    assert side.synced_at == list(range(12))  # version t written when rollout t + k is queued


def test_the_update_overlaps_the_next_rollout():
    """K=1: while update t runs (0.2 s here), rollout t+1 plays (0.2 s): the trainer barely waits."""
    side = FakeSide(play_s=0.2)
    engine = type("E", (), {"state_dict": side.state_dict})()
    ahead = RolloutsAhead(side.play, side.sync, engine, 1, first_iteration=0)
    t0 = time.perf_counter()
    taken = _train(side, ahead, 5, update_s=0.2)
    elapsed = time.perf_counter() - t0
    ahead.close()
    assert elapsed < 0.2 * 5 * 2 * 0.8  # the synchronous loop would take 2.0 s
    assert max(p.waited for p in taken[1:]) < 0.15


def test_a_failed_rollout_surfaces_on_the_trainers_thread_and_the_checkpoint_goes_back_before_it():
    side = FakeSide(fail_at=3)
    engine = type("E", (), {"state_dict": side.state_dict})()
    ahead = RolloutsAhead(side.play, side.sync, engine, 1, first_iteration=0)
    _train(side, ahead, 3)  # rollouts 0..2 taken; 3 queued by refill(2), and fails
    state = ahead.state()
    assert state["ahead"] == [] and state["iteration"] == 3  # resume plays rollout 3 again
    assert state["engine"] == {"draws": 3}  # the sampling stream before it
    with pytest.raises(RuntimeError, match="env server down in rollout 3"):
        ahead.take(3)
    ahead.close()


def test_a_checkpoint_keeps_the_rollouts_in_flight_and_a_resume_continues_the_stream():
    side = FakeSide(play_s=0.05)
    engine = type("E", (), {"state_dict": side.state_dict})()
    ahead = RolloutsAhead(side.play, side.sync, engine, 2, first_iteration=0)
    _train(side, ahead, 4)
    state = ahead.state()  # waits for rollouts 4 and 5 (in flight)
    assert [s["iteration"] for s in state["ahead"]] == [4, 5]
    assert [s["version"] for s in state["ahead"]] == [2, 3]
    assert state["iteration"] == 6 and state["engine"] == {"draws": 6}
    restored = Played.from_state(state["ahead"][0])
    assert torch.equal(restored.batch.input_ids, _batch(4).input_ids) and restored.played == 2
    ahead.close()


# ------------------------------------------------------------------------------- the process engine
def test_the_process_engine_samples_what_the_policy_samples_after_every_weight_write(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.rollout.engine import SamplingParams
    from ragen_pl.rollout.hf import HFEngine
    from ragen_pl.rollout.process import ProcessEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = [tok("hello there")["input_ids"], tok("go left")["input_ids"]]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop=[])
    process = ProcessEngine(HFEngine(seed=7, prefix_cache=False), threads=1)
    process.bind(model, tok)
    try:
        for change in range(3):
            if change:  # an update: every weight moves
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.05)
            process.load_weights(model.state_dict())
            local = HFEngine(seed=7, prefix_cache=False)
            local.bind(model, tok)
            local.load_state_dict(process.state_dict())
            got, want = process.generate(prompts, params), local.generate(prompts, params)
            assert [g.token_ids for g in got] == [w.token_ids for w in want]
            for g, w in zip(got, want):
                assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5)
        with pytest.raises(Exception, match="lack 1 of the rollout process's tensors"):
            process.load_weights({k: v for k, v in model.state_dict().items() if k != "model.norm.weight"})
        with torch.no_grad():  # the policy's head untied and moved, while the worker's copy ties it to the embedding
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight + 0.01)
        with pytest.raises(Exception, match="ties weight 'lm_head.weight' to 'model.embed_tokens.weight', but the"):
            process.load_weights(model.state_dict())
    finally:
        process.close()


def test_a_dead_rollout_process_is_one_line_within_seconds(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.errors import RolloutError
    from ragen_pl.rollout.engine import SamplingParams
    from ragen_pl.rollout.process import ProcessEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    process = ProcessEngine(threads=1, poll_s=0.2)
    process.bind(model, tok)
    process.load_weights(model.state_dict())
    os.kill(process.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(RolloutError, match=r"the rollout process \(pid \d+\) died during 'generate' \(exit code -9\)"):
        process.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, stop=[]))
    assert time.perf_counter() - t0 < 5
    process.close()


# ------------------------------------------------------------------------------------------- the CLI
def _args(model, tmp_path, steps, *extra, name="runs"):
    return ["fit", "--config", str(ROOT / "configs" / "bandit.yaml"), f"--model.model={model}",
            f"--trainer.max_steps={steps}", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
            "--trainer.devices=1", "--trainer.enable_progress_bar=false", "--trainer.val_check_interval=100",
            "--data.n_groups=2", "--data.group_size=4", "--data.val_episodes=2", "--data.rollout.max_new_tokens=6",
            "--model.ppo.mini_batch_size=8", "--model.ppo.micro_batch_size=8", "--model.optim.actor_lr=1e-3",
            "--data.engine=process", "--data.engine.init_args.threads=1", "--model.ppo.tis_cap=2",
            f"--trainer.logger.init_args.save_dir={tmp_path / name}", *extra]


def _rows(run: Path) -> dict[int, dict[str, str]]:
    rows: dict[int, dict[str, str]] = {}
    with open(run / "metrics.csv") as f:
        for r in csv.DictReader(f):
            if r.get("loss/policy"):
                rows[int(r["step"])] = r
    return rows


@pytest.mark.slow
def test_k1_logs_staleness_and_resumes_exactly_from_a_checkpoint_with_a_rollout_in_flight(tiny_model_path, tmp_path):
    assert main(_args(tiny_model_path, tmp_path, 4, "--data.max_staleness=1", name="whole")) == 0
    whole = _rows(tmp_path / "whole" / "bandit" / "version_0")
    assert [float(whole[s]["async/staleness"]) for s in range(4)] == [0.0, 1.0, 1.0, 1.0]
    assert float(whole[3]["async/staleness_max"]) == 1.0

    assert main(_args(tiny_model_path, tmp_path, 2, "--data.max_staleness=1", name="cut")) == 0
    ckpt = tmp_path / "cut" / "bandit" / "version_0" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    kept = next(v for k, v in state.items() if k.endswith("RolloutDataModule"))["ahead"]
    assert [r["iteration"] for r in kept] == [2] and kept[0]["version"] == 1  # rollout 2, sampled after update 1
    assert main(_args(tiny_model_path, tmp_path, 4, "--data.max_staleness=1", f"--ckpt_path={ckpt}",
                      name="cut")) == 0
    resumed = _rows(tmp_path / "cut" / "bandit" / "version_1")
    assert sorted(resumed) == [2, 3]  # none trained twice, none lost
    for step in (2, 3):
        for key in ("loss/policy", "rollout/success", "async/staleness", "mismatch/kl_k3"):
            assert float(resumed[step][key]) == pytest.approx(float(whole[step][key]), rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_a_rollout_process_killed_mid_run_stops_it_with_one_line_and_a_checkpoint(tiny_model_path, tmp_path, capsys,
                                                                                   monkeypatch):
    from ragen_pl.rollout import process as process_mod

    real = process_mod.ProcessEngine.generate
    calls = {"n": 0}

    def generate(self, prompts, params):
        calls["n"] += 1
        if calls["n"] == 6:  # a few rollouts in: the worker dies
            os.kill(self.pid, signal.SIGKILL)
        return real(self, prompts, params)

    monkeypatch.setattr(process_mod.ProcessEngine, "generate", generate)
    t0 = time.perf_counter()
    code = main(_args(tiny_model_path, tmp_path, 50, "--data.max_staleness=1"))
    assert code != 0 and time.perf_counter() - t0 < 120
    err = capsys.readouterr().err
    assert "the rollout process (pid" in err and "died during '" in err and "(exit code -9)" in err
    last = tmp_path / "runs" / "bandit" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] >= 1


@pytest.mark.parametrize("extra, message", [
    (["--data.engine=hf"], "`--data.max_staleness=1` samples while the policy updates, so the engine needs its own"),
    (["--model.ppo.tis_cap=null"], "`--data.max_staleness=1` trains on rollouts of older weights: set"),
    (["--data.rollout_every_n_steps=2"], "`--data.max_staleness=1` plays rollouts ahead of the update; it cannot"),
    (["--data.max_staleness=-1"], "`--data.max_staleness` must be an integer >= 0, got -1"),
])
def test_settings_async_cannot_honour_are_refused_in_one_line(tiny_model_path, tmp_path, capsys, extra, message):
    code = main(_args(tiny_model_path, tmp_path, 2, "--data.max_staleness=1", *extra))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], errors


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_both_sides_keeps_the_rollout_in_flight_and_leaves_no_orphan(
        tiny_model_path, tmp_path):
    import subprocess
    import sys

    args = _args(tiny_model_path, tmp_path, 200, "--data.max_staleness=1", "--torch_threads=1")
    proc = subprocess.Popen([sys.executable, "-m", "ragen_pl.cli", *args], cwd=tmp_path, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs" / "bandit" / "version_0" / "metrics.csv"
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and not (
            metrics.is_file() and len(metrics.read_text().splitlines()) > 4):
        time.sleep(0.2)
    workers = _children(proc.pid)
    assert proc.poll() is None and workers, "the run did not reach its 4th iteration with a rollout process"
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does: every process of the job
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = tmp_path / "runs" / "bandit" / "version_0" / "checkpoints" / "last.ckpt"
    assert err.strip().splitlines()[-1] == f"stopped by SIGTERM; resume with --ckpt_path={last}"
    saved = torch.load(last, weights_only=True)
    data = next(v for k, v in saved.items() if k.endswith("RolloutDataModule"))
    # Stopped in an update: the next iteration's rollout, finished by then, is kept; stopped while the trainer waited
    # for that rollout: it is left out and played again on resume. Either way the stream resumes right after.
    step, kept = saved["global_step"], [r["iteration"] for r in data["ahead"]]
    assert kept in ([step], []) and data["iteration"] == step + len(kept)
    time.sleep(1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()
                and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]
