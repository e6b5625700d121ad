"""ragen_pl_experiments.research.real_llm runs its multi-turn path end to end (tiny model, a few seconds of training): the random
baseline, the curve, the final evaluation of the last weights, the time split, the collapse metrics, the random policy
with the model's own action count and the goal line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

RESEARCH = "ragen_pl_experiments.research"


@pytest.mark.slow
def test_real_llm_benchmark_smoke(tiny_model_path, tmp_path):
    """(``--state-only``: the prompts without the turn header; the fit refuses nothing in that layout.)"""
    command = [sys.executable, "-m", f"{RESEARCH}.real_llm", "--env", "frozenlake", "--minutes", "0.02",
        "--max-steps", "2", "--random-repeats", "2", "--final-episodes", "6", "--out", str(tmp_path / "runs"),
        "--state-only", f"--model.model={tiny_model_path}",
        "--data.n_groups=2", "--data.group_size=2", "--data.val_episodes=4", "--data.rollout.max_new_tokens=6",
        "--trainer.val_check_interval=1", "--torch_threads=1", "--model.collapse.samples=4",
        # the tiny tokenizer spells Down and Left in two tokens each
        "--model.hooks=[{class_path: readout_head, init_args: {center: 4, whiten: true, tokens: [Up, Right]}}]"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    baseline = float(re.search(r"random policy on the 6 evaluation seeds of the final evaluation \(2 plays each, "
                               r"10 actions\): success ([0-9.]+)", text).group(1))
    assert 0.0 <= baseline <= 1.0
    effective = float(re.search(r"random effective moves \(no walk into a wall or off the map\) on the same seeds: "
                                r"success ([0-9.]+)", text).group(1))
    assert 0.0 <= effective <= 1.0
    assert re.search(r"\(final, last weights, 6 episodes\)", text)  # --final-episodes, not the loop's 4
    assert re.search(r"per iteration: [0-9.]+ s = generation [0-9.]+ \+ scoring [0-9.]+ \+ update [0-9.]+", text)
    assert re.search(r"collapse metrics at iteration 0: I\(X;Z\) -?[0-9.]+ of at most [0-9.]+, H\(Z\|X\) [0-9.]+ nats "
                     r"per sequence; retrieval accuracy [0-9.]+ \(chance [0-9.]+\)", text), text
    assert re.search(r"actions per episode at step 0: [0-9.]+; the random policy with [0-9]+ actions: success [0-9.]+",
                     text), text
    assert re.search(r"^\s+0\s+[0-9.]+\s+[0-9.]+\s+[0-9]+\s+[0-9.]+\s+[-+][0-9.]+ vs random \(>= \+0\.10\), "
                     r"[-+][0-9.]+ vs random effective$", text,
                     re.MULTILINE), text

    # The same --out again: refused without --resume; with it, the finished fit goes straight to the final evaluation.
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 2 and "holds a run already; continue it with --resume" in again.stderr, again.stderr
    again = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(final, last weights, 6 episodes)" in again.stdout
    seed = tmp_path / "runs" / "seed0"
    assert len(list(seed.glob("*/version_*"))) == 1 and len(list((seed / "final").glob("*/version_*"))) == 2
    # With the loop's own 4 episodes, the fit's evaluation as it stopped (the last weights) is the final one: no third.
    same = [*command[:command.index("--final-episodes")], *command[command.index("--final-episodes") + 2:]]
    again = subprocess.run([*same, "--resume"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(final, last weights, 4 episodes, the fit's own last evaluation)" in again.stdout, again.stdout
    assert len(list((seed / "final").glob("*/version_*"))) == 2

    # policy_reading on that run: the greedy first action of its start and of its last weights
    run = next((tmp_path / "runs").rglob("checkpoints")).parent
    out = subprocess.run([sys.executable, "-m", f"{RESEARCH}.policy_reading", str(run), "--boards", "6",
                          "--threads", "1"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    line = (r"first action optimal ([0-9.]+) \(random ([0-9.]+)\), its success probability ([0-9.]+) \(random "
            r"action ([0-9.]+), best action ([0-9.]+)\)$")
    rows = [re.search(rf"^  {who} .*: {line}", out.stdout, re.MULTILINE) for who in ("start", "last weights")]
    assert all(rows), out.stdout
    for row in rows:
        optimal, chance, q, q_random, q_best = map(float, row.groups())
        assert 0.0 <= optimal <= 1.0 and 0.25 <= chance <= 1.0  # every board has at least one optimal action of 4
        assert q <= q_best + 1e-9 and q_random <= q_best + 1e-9  # no action beats the best one
    assert rows[0].group(2) == rows[1].group(2)  # the same boards for both


def test_policy_reading_refuses_a_folder_that_is_not_a_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", f"{RESEARCH}.policy_reading", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"policy_reading.py: error: RUN {tmp_path}: no config.yaml (give a run's version folder, the one that holds "
        "config.yaml and checkpoints/)")


@pytest.mark.parametrize("args, message", [
    (["--env", "bandit", "--state-only"], "--state-only: Bandit has one turn"),
    (["--env", "frozenlake", "--state-only", "--data.rollout.turn_header=false"],
     "--state-only sets --data.rollout.turn_header=false itself; give one or the other"),
])
def test_real_llm_refuses_state_only_where_it_means_nothing(args, message, tmp_path):
    out = subprocess.run([sys.executable, "-m", f"{RESEARCH}.real_llm", *args], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and f"real_llm.py: error: {message}" in out.stderr.strip().splitlines()[-1], out.stderr


@pytest.mark.slow
def test_real_llm_on_a_ragen2_main_table_env_prints_its_goal_beside_the_optimal_policy(tiny_model_path, tmp_path):
    """``--env coordsokoban``: issue 59's goal (random + 0.10) and the optimal policy's success, read from the run."""
    out = subprocess.run(
        [sys.executable, "-m", f"{RESEARCH}.real_llm", "--env", "coordsokoban", "--minutes", "0.02",
         "--max-steps", "1", "--random-repeats", "2", "--final-episodes", "4", "--out", str(tmp_path / "runs"),
         f"--model.model={tiny_model_path}", "--data.n_groups=2", "--data.group_size=2", "--data.val_episodes=4",
         "--data.rollout.max_new_tokens=6", "--torch_threads=1",
         "--model.hooks=[{class_path: readout_head, init_args: {center: 4, whiten: true, tokens: [Up, Right]}}]"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    row = re.search(r"^\s+0\s+[0-9.]+\s+([0-9.]+)\s+[0-9]+\s+[0-9.]+\s+([-+][0-9.]+) vs random \(>= \+0\.10\), "
                    r"optimal ([0-9.]+)$", out.stdout, re.MULTILINE)
    assert row, out.stdout
    baseline = float(re.search(r"random policy on the 4 evaluation seeds of the final evaluation \(2 plays each, "
                               r"10 actions\): success ([0-9.]+)", out.stdout).group(1))
    final, gain, optimal = map(float, row.groups())
    assert abs(final - baseline - gain) < 2e-3
    assert max(final, baseline) <= optimal <= 1.0  # deterministic rooms: what any play solves, the solver solves


def test_fit_rows_of_a_resumed_run():
    """A run killed after logging iteration 2 but checkpointed at 1 resumes from 2: its rows replace the first's."""
    from ragen_pl_experiments.research.common import curve, fit_rows

    first = [{"step": "0", "val/X/success": "0.1", "time/iteration": ""},
             {"step": "0", "val/X/success": "", "time/iteration": "10"},
             {"step": "1", "val/X/success": "", "time/iteration": "10"},
             {"step": "2", "val/X/success": "", "time/iteration": "99"}]
    resumed = [{"step": "2", "val/X/success": "", "time/iteration": "10"},
               {"step": "2", "val/X/success": "0.5", "time/iteration": ""}]
    rows = fit_rows([first, resumed])
    assert [(r["step"], r["time/iteration"]) for r in rows] == [("0", ""), ("0", "10"), ("1", "10"), ("2", "10"),
                                                                 ("2", "")]
    assert curve(rows, "X") == [{"iteration": 0, "train_s": 0.0, "success": 0.1},
                                {"iteration": 3, "train_s": 30.0, "success": 0.5}]
