"""Fault injection (issue 13): nothing lost, nothing silent.

Kills during a checkpoint save, truncated / corrupted / empty checkpoints, a resume with changed flags, ``--ckpt_path
=last``, envs that return garbage or always fail, an env that cannot be copied, two runs started into one folder, and
``ragen-pl report`` on a truncated and on a resumed run.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from ragen_pl.checkpoint import CheckpointError, load_checkpoint, save_atomic
from ragen_pl.cli import main
from ragen_pl.envs.bandit import Bandit
from ragen_pl.runs import claim_version, lock_run_folder

ROOT = Path(__file__).resolve().parents[1]


def _fit_args(model, tmp_path, steps=2, *extra):
    return ["fit", "--config", str(ROOT / "configs" / "bandit.yaml"), f"--model.model={model}",
            f"--trainer.max_steps={steps}", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
            "--trainer.devices=1", "--trainer.enable_progress_bar=false", "--trainer.val_check_interval=100",
            "--data.n_groups=2", "--data.group_size=2", "--data.val_episodes=2", "--data.rollout.max_new_tokens=4",
            "--model.ppo.mini_batch_size=4", "--model.ppo.micro_batch_size=4",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", *extra]


# ------------------------------------------------------------------------------------------- checkpoints
def test_kill_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path):
    """A writer killed mid-save (TMPDIR on another filesystem) leaves last.ckpt as it was, and no temp file."""
    path = tmp_path / "ckpt" / "last.ckpt"
    save_atomic({"step": 1, "w": torch.arange(10.0)}, path)
    script = textwrap.dedent(f"""
        import os, torch
        import ragen_pl.checkpoint as c
        real = c._write_atomic
        def dying(p, data):
            if p.suffix == ".ckpt":  # write half of the new checkpoint, then die as kill -9 would
                tmp = p.with_name(f".{{p.name}}.tmp-{{os.getpid()}}")
                tmp.write_bytes(data[: len(data) // 2])
                os._exit(9)
            real(p, data)
        c._write_atomic = dying
        c.save_atomic({{"step": 2, "w": torch.zeros(1_000_000)}}, {str(path)!r})
    """)
    env = {**os.environ, "TMPDIR": "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    state = load_checkpoint(path)  # the previous file, verified against its digest
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(10.0))
    # The next save cleans up: only the checkpoint and its digest remain.
    save_atomic({"step": 3}, path)
    leftovers = {p.name for p in path.parent.iterdir()} - {"last.ckpt", "last.ckpt.sha256"}
    assert load_checkpoint(path)["step"] == 3
    assert all(name.startswith(".last.ckpt.tmp-") for name in leftovers)  # only the killed writer's own temp file


def test_saves_replace_atomically_while_another_process_reads(tmp_path):
    """A reader never sees a partial file while checkpoints are overwritten in a loop."""
    path = tmp_path / "last.ckpt"
    save_atomic({"i": 0, "w": torch.zeros(200_000)}, path)
    errors = []

    def read():
        for _ in range(30):
            try:
                load_checkpoint(path)
            except CheckpointError as err:
                errors.append(str(err))

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(1, 15):
        save_atomic({"i": i, "w": torch.full((200_000,), float(i))}, path)
    reader.join()
    assert errors == []
    assert load_checkpoint(path)["i"] == 14


@pytest.mark.parametrize("damage, message", [
    ("empty", r"checkpoint .*bad\.ckpt is empty \(0 bytes\)"),
    ("truncated", r"checkpoint .*bad\.ckpt (is corrupt: its sha256 does not match|cannot be read)"),
    ("flipped", r"checkpoint .*bad\.ckpt is corrupt: its sha256 does not match bad\.ckpt\.sha256"),
    ("missing", r"checkpoint .*bad\.ckpt does not exist"),
])
def test_damaged_checkpoints_are_one_line_errors(tmp_path, damage, message):
    path = tmp_path / "bad.ckpt"
    save_atomic({"w": torch.randn(100_000)}, path)
    data = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 3])
    elif damage == "flipped":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes(64 * [0xFF]) + data[middle + 64:])
    else:
        path.unlink()
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


def test_truncated_checkpoint_without_digest_is_one_line(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"w": torch.randn(100_000)}, path)
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=r"checkpoint .*old\.ckpt cannot be read \(truncated or corrupt\)"):
        load_checkpoint(path)


@pytest.mark.slow
def test_cli_resume_paths(tiny_model_path, tmp_path, capsys):
    """The end-of-run checkpoint, --ckpt_path=last, changed flags refused, damaged files named, report stitched."""
    assert main(_fit_args(tiny_model_path, tmp_path, 3)) == 0
    last = tmp_path / "runs" / "bandit" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3  # saved at the end, not at the last multiple of 5
    capsys.readouterr()

    # A changed model flag on resume is refused, naming it (the checkpoint's settings would silently win).
    code = main(_fit_args(tiny_model_path, tmp_path, 5, "--ckpt_path=last", "--model.advantage=grpo",
                          "--model.optim.actor_lr=0.5"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--model.advantage: checkpoint 'ragen_pl.advantages.GAE', given 'ragen_pl.advantages.GRPO'" in err[0]
    assert "--model.optim.actor_lr: checkpoint 1e-06, given 0.5" in err[0]

    for name, data in (("empty.ckpt", b""), ("cut.ckpt", last.read_bytes()[:4096])):
        (tmp_path / name).write_bytes(data)
        assert main(_fit_args(tiny_model_path, tmp_path, 5, f"--ckpt_path={tmp_path / name}")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: checkpoint {tmp_path / name}"), err

    # `last` resumes the newest last.ckpt of this config's run folder; trainer flags apply.
    assert main(_fit_args(tiny_model_path, tmp_path, 5, "--ckpt_path=last")) == 0
    version_1 = tmp_path / "runs" / "bandit" / "version_1"
    assert json.loads((version_1 / "run.json").read_text())["resumed_from"] == str(last.resolve())
    with open(version_1 / "metrics.csv") as f:
        steps = sorted({int(r["step"]) for r in csv.DictReader(f) if r.get("loss/policy")})
    assert steps and min(steps) >= 3  # continued, not from scratch

    from ragen_pl.report import report

    plotted = report([version_1], tmp_path / "report")
    success = next(iter(plotted["success.png"].values()))
    assert success[0][0] < 3 and success[-1][0] >= 3  # the resumed run's report includes its first part

    assert main(_fit_args(tiny_model_path, tmp_path / "elsewhere", 5, "--ckpt_path=last")) == 2
    assert "--ckpt_path=last: no run under" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ envs
class NoneEnv(Bandit):
    """Returns None observations and NaN rewards: every trajectory must count as failed, not train on NaN."""

    def reset(self, seed):
        super().reset(seed)
        return None

    def step(self, action):
        obs, _, done, info = super().step(action)
        return obs, float("nan"), done, info


class RaisingEnv(Bandit):
    def reset(self, seed):
        raise RuntimeError("the env server is down")


class LockedEnv(Bandit):
    def __init__(self, tag=None):
        super().__init__(tag=tag)
        self.lock = threading.Lock()


def _collect(env):
    from ragen_pl.config import RolloutConfig
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.engine import Generation, RolloutEngine

    class Fixed(RolloutEngine):
        def generate(self, prompts, params):
            return [Generation(tok.encode("<think>x</think><answer>" + Bandit().actions[0] + "</answer>"),
                               [0.0] * 9, "stop") for _ in prompts]

    from transformers import AutoTokenizer

    from ragen_pl.models.tiny import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model())
    return Collector(Fixed(), tok, RolloutConfig(max_turns=1)).collect([EpisodeSpec(env, seed=i, group_id=i)
                                                                          for i in range(3)])


def test_none_observation_and_nan_reward_fail_the_trajectory():
    result = _collect(NoneEnv())
    assert result.batch is None and len(result.episodes) == 3
    assert all("must return the observation as str, got NoneType" in ep.failed for ep in result.episodes)


def test_uncopyable_env_names_the_env_and_the_copy():
    from ragen_pl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"env LockedEnv \(tag 'LockedEnv'\) cannot be deep-copied.*cannot pickle"):
        _collect(LockedEnv())


@pytest.mark.slow
@pytest.mark.parametrize("where", ["training", "validation"])
def test_all_failing_envs_are_one_line(tiny_model_path, tmp_path, where, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    env_flag = "--data.env=tests.test_faults.RaisingEnv"
    extra = [env_flag, "--trainer.limit_val_batches=0"] if where == "training" else \
        ["--data.val_envs=[tests.test_faults.RaisingEnv]", "--trainer.limit_val_batches=1"]
    code = main(_fit_args(tiny_model_path, tmp_path, 1, *extra))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    kind = "trajectory of training iteration 0" if where == "training" else "val episode of env 'RaisingEnv'"
    assert f"every {kind} failed; the envs said: RaisingEnv: reset: RuntimeError: the env server is down (x" in errors[0]


# ------------------------------------------------------------------------------------------ run folders
def test_two_runs_never_share_a_version_folder(tmp_path):
    versions = []
    threads = [threading.Thread(target=lambda: versions.append(claim_version(tmp_path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(versions) == list(range(8))


def test_a_folder_in_use_is_refused_and_a_stale_lock_taken_over(tmp_path):
    from ragen_pl.errors import ConfigError

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdout.write('x'); sys.stdout.flush(); "
                               "time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        holder.stdout.read(1)
        (tmp_path.parent / f".{tmp_path.name}.lock").write_text(str(holder.pid))
        with pytest.raises(ConfigError, match=rf"run folder {tmp_path} is in use by process {holder.pid}"):
            lock_run_folder(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock_run_folder(tmp_path)  # its process is gone: the lock is stale
    assert (tmp_path.parent / f".{tmp_path.name}.lock").read_text() == str(os.getpid())


def test_report_skips_a_truncated_last_sample_line_and_names_a_bad_one(tmp_path, capsys):
    from ragen_pl.report import read_samples

    samples = tmp_path / "samples"
    samples.mkdir()
    good = json.dumps({"step": 0, "env": "Bandit", "transcript": []})
    (samples / "step_000000.jsonl").write_text(good + "\n" + good[:20])
    assert len(read_samples(tmp_path)) == 1
    assert "skipping the truncated last line 2 of" in capsys.readouterr().err
    (samples / "step_000005.jsonl").write_text(good[:20] + "\n" + good + "\n")
    with pytest.raises(ValueError, match=r"step_000005\.jsonl:1: not a JSON sample row"):
        read_samples(tmp_path)


def test_explained_variance_of_nearly_constant_returns_is_nan():
    from ragen_pl.update import explained_variance

    returns = torch.tensor([[1.0, 1.0 + 1e-7, 1.0 - 1e-7]])
    values = torch.zeros_like(returns)
    assert torch.isnan(explained_variance(values, returns, torch.ones_like(returns, dtype=torch.bool)))


@pytest.mark.slow
def test_sigterm_stops_a_long_rollout_promptly_and_leaves_the_checkpoint_whole(tiny_model_path, tmp_path):
    """Lightning's handler only notes SIGTERM and lets the step finish; a rollout stuck for a minute then needed
    SIGKILL (issue 21). Now the run stops within seconds, with exit code 143, and the last checkpoint verifies."""
    import signal
    import subprocess
    import sys

    from ragen_pl.checkpoint import verify

    config = tmp_path / "slow.yaml"
    config.write_text(f"""
trainer:
  max_steps: 5
  accelerator: cpu
  logger: false
  enable_progress_bar: false
  limit_val_batches: 0
  default_root_dir: {tmp_path}
  callbacks:
    - class_path: ragen_pl.checkpoint.RunCheckpoint
      init_args: {{every_n_train_steps: 1, dirpath: {tmp_path / 'ckpt'}}}
model:
  model: {tiny_model_path}
  advantage: {{class_path: ragen_pl.advantages.GRPO}}
  ppo: {{mini_batch_size: 4, micro_batch_size: 4}}
data:
  env: {{class_path: tests.slow_env.SlowBandit}}
  n_groups: 2
  group_size: 2
  filter: {{class_path: ragen_pl.filters.NoFilter}}
  rollout: {{max_turns: 1, max_new_tokens: 4, step_timeout_s: 120}}
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(config), "--torch_threads=1"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "ckpt").glob("*.ckpt")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    saved = list((tmp_path / "ckpt").glob("*.ckpt"))
    if not saved:
        proc.kill()
        pytest.fail(f"no checkpoint after the first iteration: {proc.communicate()[1][-2000:]}")
    time.sleep(1.0)  # the second rollout is now sleeping in an env reset
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 15, "SIGTERM did not stop the run promptly"
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in err
    for path in (tmp_path / "ckpt").glob("*.ckpt"):
        verify(path)  # whole: its digest matches


def _sigterm_during_update(loss_cls):
    """``loss_cls`` that sends this process SIGTERM in the second iteration's update (one micro-batch each)."""
    class Loss(loss_cls):
        calls = 0

        def __call__(self, *args, **kwargs):
            import signal as _signal

            type(self).calls += 1
            if type(self).calls == 2:
                os.kill(os.getpid(), _signal.SIGTERM)
            return super().__call__(*args, **kwargs)

    return Loss


from ragen_pl.losses import PPOClip  # noqa: E402

SigtermLoss = _sigterm_during_update(PPOClip)


def _stop_config(tmp_path, model, env: str, steps: int) -> Path:
    config = tmp_path / f"stop-{steps}.yaml"
    config.write_text(f"""
trainer:
  max_steps: {steps}
  accelerator: cpu
  enable_progress_bar: false
  limit_val_batches: 0
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {tmp_path / 'runs'}, name: stop}}
model:
  model: {model}
  advantage: {{class_path: ragen_pl.advantages.GRPO}}
  ppo: {{mini_batch_size: 4, micro_batch_size: 4}}
data:
  env: {env}
  n_groups: 2
  group_size: 2
  filter: {{class_path: ragen_pl.filters.NoFilter}}
  rollout: {{max_turns: 1, max_new_tokens: 4, step_timeout_s: 120}}
""")
    return config


def _signal_mid_rollout(config, tmp_path, wait_for: str):
    """Run ``config`` in a subprocess, wait for ``wait_for`` in its output folder, send SIGTERM, return the process."""
    import signal

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(config), "--torch_threads=1"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and not _reached(tmp_path, wait_for):
        time.sleep(0.2)
    time.sleep(1.5)  # the rollout is now sleeping in an env reset
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, err


def _reached(tmp_path, wait_for):
    """``started``: the run claimed its folder; ``iterations``: its metrics hold 3 iterations."""
    folder = tmp_path / "runs" / "stop" / "version_1"
    if wait_for == "started":
        return folder.is_dir()
    metrics = folder / "metrics.csv"
    return metrics.is_file() and len(metrics.read_text().splitlines()) > 3


@pytest.mark.slow
def test_a_stop_saves_the_last_completed_iteration_in_its_own_run(tiny_model_path, tmp_path, capsys):
    """In a run folder that already holds an older run, SIGTERM in the 4th rollout (its env resets sleep) saves the
    3 completed iterations in the new run's own folder, the rollout under way undone (the data module's seed counter
    is back at 3), and says where; `--ckpt_path=last` then resumes that run, not the older one. Stopped in its first
    rollout, a run says in one line it has no checkpoint, and `--ckpt_path=last` names it instead of resuming an
    older run's."""
    import signal

    old = _stop_config(tmp_path, tiny_model_path, "{class_path: ragen_pl.envs.bandit.Bandit}", 2)
    assert main(["fit", "--config", str(old), "--torch_threads=1"]) == 0
    older = tmp_path / "runs" / "stop" / "version_0" / "checkpoints" / "last.ckpt"
    assert older.exists()

    config = _stop_config(tmp_path, tiny_model_path, "{class_path: tests.slow_env.SlowBandit, init_args: {slow_from: 6}}",
                          10)
    code, err = _signal_mid_rollout(config, tmp_path, "iterations")
    last = tmp_path / "runs" / "stop" / "version_1" / "checkpoints" / "last.ckpt"
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1] == f"stopped by SIGTERM; resume with --ckpt_path={last}"
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 3  # iterations 1-3 completed; the 4th's rollout was under way
    assert saved["RolloutDataModule"]["iteration"] == 3  # the unfinished rollout is undone: resuming plays it again
    capsys.readouterr()
    resume = _stop_config(tmp_path, tiny_model_path, "{class_path: ragen_pl.envs.bandit.Bandit}", 4)
    assert main(["fit", "--config", str(resume), "--ckpt_path=last", "--torch_threads=1"]) == 0
    info = json.loads((tmp_path / "runs" / "stop" / "version_2" / "run.json").read_text())
    assert info["resumed_from"] == str(last.resolve())

    first = _stop_config(tmp_path, tiny_model_path, "{class_path: tests.slow_env.SlowBandit, init_args: {slow_from: 0}}",
                         4)
    import shutil

    for stale in (tmp_path / "runs" / "stop").glob("version_*"):
        if stale.name != "version_0":
            shutil.rmtree(stale)
    code, err = _signal_mid_rollout(first, tmp_path, "started")
    assert code == 128 + signal.SIGTERM, err[-2000:]
    folder = tmp_path / "runs" / "stop" / "version_1"
    assert err.strip().splitlines()[-1] == (f"stopped by SIGTERM before its first iteration ended: this run ({folder}) "
                                            f"has no checkpoint to resume from")
    capsys.readouterr()
    assert main(["fit", "--config", str(resume), "--ckpt_path=last", "--torch_threads=1"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --ckpt_path=last: the latest run, {folder}, has no checkpoint (it stopped before its first iteration "
        f"ended); an earlier run's is {older}: give --ckpt_path explicitly")


@pytest.mark.slow
def test_a_stop_during_an_update_ends_its_iteration_first(tiny_model_path, tmp_path, capsys):
    """SIGTERM while iteration 2 updates (sent from the policy loss): the update is not cut half way; the iteration
    ends, its checkpoint is saved, and the run stops with 143 naming it."""
    config = _stop_config(tmp_path, tiny_model_path, "{class_path: ragen_pl.envs.bandit.Bandit}", 6)
    code = main(["fit", "--config", str(config), "--model.policy_loss=tests.test_faults.SigtermLoss",
                 "--torch_threads=1"])
    last = tmp_path / "runs" / "stop" / "version_0" / "checkpoints" / "last.ckpt"
    assert code == 128 + 15
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"stopped by SIGTERM; resume with --ckpt_path={last}"
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 2  # the interrupted update finished and counted


@pytest.mark.parametrize("failure", ["missing checkpoint", "every env fails"])
def test_a_run_that_fails_to_start_leaves_no_run_folder(tiny_model_path, tmp_path, capsys, monkeypatch, failure):
    """A command refused after it claimed its run folder (a checkpoint that does not exist; an env that fails every
    trajectory of the first iteration) removes that folder: no empty version_N is left to be taken for a run."""
    monkeypatch.syspath_prepend(str(ROOT))
    extra = ([f"--ckpt_path={tmp_path / 'missing.ckpt'}"] if failure == "missing checkpoint" else
             ["--data.env=tests.test_faults.RaisingEnv", "--trainer.limit_val_batches=0"])
    code = main(_fit_args(tiny_model_path, tmp_path, 2, *extra))
    assert code == 2 and "error:" in capsys.readouterr().err
    assert not list((tmp_path / "runs" / "bandit").glob("version_*"))


class FlakyBandit(Bandit):
    """Bandit whose resets of odd seeds from ``fail_from`` on raise (an env server that drops some episodes)."""

    def __init__(self, fail_from: int = 0, tag: str | None = None) -> None:
        super().__init__(tag=tag)
        self.fail_from = fail_from

    def reset(self, seed):
        if seed >= self.fail_from and seed % 2:
            raise RuntimeError(f"seed {seed} is odd")
        return super().reset(seed)


@pytest.mark.slow
def test_failed_episodes_are_counted_where_the_user_looks(tiny_model_path, tmp_path, caplog, monkeypatch, recwarn):
    """An env failing on odd seeds: the evaluation line averages over the episodes it counts and says how many of how
    many failed; one warning names the env and its first error; the progress metrics count them (2 of 4 a rollout,
    the odd group). At the default ceiling (half) the run goes on."""
    import logging

    monkeypatch.syspath_prepend(str(ROOT))
    with caplog.at_level(logging.INFO):
        code = main(_fit_args(tiny_model_path, tmp_path, 2, "--data.env=tests.test_faults.FlakyBandit",
                              "--data.val_envs=[tests.test_faults.FlakyBandit]", "--data.val_episodes=4",
                              "--trainer.val_check_interval=1"))
    assert code == 0
    text = [r.getMessage() for r in caplog.records]
    evals = [m for m in text if m.startswith("val/FlakyBandit: success")]
    # ... and the random and optimal policies beside it, on the seeds whose episodes could be played
    assert evals and all(m.endswith("on the same seeds); 2 of 4 episodes failed and are not counted")
                         and "over 2 episodes (random policy " in m and "optimal policy 1.000" in m for m in evals)
    warned = [str(w.message) for w in recwarn if "episodes fail (" in str(w.message)]
    assert len(warned) == 1 and warned[0].endswith(  # the step-0 evaluation plays first
        "the first: seed 1000001: reset: RuntimeError: seed 1000001 is odd"), warned
    with open(next((tmp_path / "runs" / "bandit").glob("version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/failed")]
    assert [(float(r["rollout/failed"]), float(r["rollout/played"])) for r in rows] == [(2.0, 4.0), (2.0, 4.0)]


@pytest.mark.slow
def test_more_failed_episodes_than_the_ceiling_stop_the_run_with_a_checkpoint(tiny_model_path, tmp_path, capsys,
                                                                             monkeypatch):
    """Odd seeds fail from seed 4 on: iterations 1 and 2 (seeds 0-3) train; the third loses half its episodes, more
    than `--data.max_failed_share=0.25`: one line, exit 2, and the checkpoint of the 2 completed iterations with the
    failed rollout undone."""
    monkeypatch.syspath_prepend(str(ROOT))
    code = main(_fit_args(tiny_model_path, tmp_path, 5, "--data.env=tests.test_faults.FlakyBandit",
                          "--data.env.init_args.fail_from=4", "--data.max_failed_share=0.25",
                          "--trainer.limit_val_batches=0"))
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and err == ["error: 2 of 4 episodes failed (training iteration 2), more than "
                                 "--data.max_failed_share=0.25; the envs said: FlakyBandit: reset: RuntimeError: "
                                 "seed 5 is odd (x2)"], err
    last = next((tmp_path / "runs" / "bandit").glob("version_*/checkpoints/last.ckpt"))
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 2 and saved["RolloutDataModule"]["iteration"] == 2


@pytest.mark.slow
def test_resuming_with_other_data_settings_lists_them_in_one_notice(tiny_model_path, tmp_path, recwarn):
    """The data settings apply as given on resume (an env or a group count may change on purpose), but never without a
    word: one warning lists each changed flag with both values."""
    assert main(_fit_args(tiny_model_path, tmp_path, 2)) == 0
    assert main(_fit_args(tiny_model_path, tmp_path, 3, "--ckpt_path=last", "--data.n_groups=4",
                          "--data.env=ragen_pl.envs.sokoban.Sokoban")) == 0
    notices = [str(w.message) for w in recwarn if "with other data settings" in str(w.message)]
    assert len(notices) == 1, notices
    assert "--data.n_groups: 2 -> 4" in notices[0]
    assert '--data.env.class_path: "ragen_pl.envs.bandit.Bandit" -> "ragen_pl.envs.sokoban.Sokoban"' in notices[0]


def test_a_variance_filter_with_groups_of_one_is_refused(tiny_model_path, capsys):
    """With one trajectory a group every group's reward std is 0: the variance filter would keep an arbitrary share."""
    code = main(_fit_args(tiny_model_path, Path("/nonexistent"), 2, "--data.group_size=1"))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and errors == [
        "error: `--data.group_size=1`: a group of one trajectory has no reward spread, so `--data.filter` VarianceTopP "
        "would keep an arbitrary share of the groups; use --data.group_size >= 2 or --data.filter=none"]


@pytest.mark.parametrize("flag, expected", [
    ("--model.optim.actor_lr=nan", "error: --model.optim.actor_lr: must be a finite number, got nan"),
    ("--model.ppo.entropy_coeff=inf", "error: --model.ppo.entropy_coeff: must be a finite number, got inf"),
    ("--data.rolout.temperature=0.7", "error: unrecognized argument '--data.rolout.temperature=0.7'. Did you mean "
                                      "'--data.rollout.temperature'?"),
])
def test_a_non_finite_rate_and_a_misspelt_nested_flag_are_named(flag, expected, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / "bandit.yaml"), flag, "--print_config"])
    assert capsys.readouterr().err.splitlines()[0] == expected


def test_a_distributed_process_leaves_with_its_code_after_its_exit_handlers(tmp_path):
    """``ragen-pl`` ends a process that holds a process group without interpreter finalization (where a collective's
    worker thread can abort a finished run), yet with its exit code, its atexit handlers run and its output flushed."""
    script = textwrap.dedent(f"""
        import atexit, sys
        import torch.distributed as dist
        from ragen_pl.cli import leave
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        dist.all_reduce(__import__("torch").ones(3))
        atexit.register(lambda: print("exit handler ran"))
        print("unflushed", end="")
        leave(3)
        print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "unflushedexit handler ran\n"
    one = subprocess.run([sys.executable, "-c", "from ragen_pl.cli import leave; leave(4)"], capture_output=True,
                         timeout=60)
    assert one.returncode == 4
