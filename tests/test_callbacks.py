import csv
import json
import math
import random
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from ragen_pl.callbacks import TrajectorySamples, ValidateAtStart
from ragen_pl.config import RolloutConfig
from ragen_pl.data import RolloutDataModule
from ragen_pl.echo_trap import EchoTrapAlarm, drop_z
from ragen_pl.envs.bandit import Bandit
from ragen_pl.filters import NoFilter
from ragen_pl.module import PPOConfig, RagenModule

TRACES = Path(__file__).parent / "data" / "echo_trap"


def stream(n, success, repetition=lambda i: 0.05, entropy=lambda i: 1.0, grad=lambda i: 1.0, tag="Bandit",
           episodes=64):
    return [{f"rollout/{tag}/success": success(i), f"rollout/{tag}/episodes": episodes,
             f"rollout/{tag}/repetition": repetition(i), "loss/entropy": entropy(i), "actor/grad_norm": grad(i)}
            for i in range(n)]


def run(alarm, metrics, signals=None, tags=None):
    """Feed a metric stream; return the indices where the alarm fired (each env once, as in a run)."""
    fired = []
    for i, m in enumerate(metrics):
        now = alarm.observe(m)
        if alarm.firing:
            fired.append(i)
            if signals is not None:
                signals.append(now)
            if tags is not None:
                tags.append(alarm.last_tag)
            alarm.fired_tags.add(alarm.last_tag)
    return fired


def trace(name):
    """A recorded quickstart run (64 episodes per env and step; recorded before the episodes were logged)."""
    with open(TRACES / name) as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    for row in rows:
        row.update({k[: -len("success")] + "episodes": 64.0 for k in list(row) if k.count("/") == 2
                    and k.startswith("rollout/") and k.endswith("/success")})
    return rows


def test_drop_z_by_hand():
    # 0.5 of 100 -> 0.3 of 100: pooled 0.4, variance 0.4 * 0.6 * (1/100 + 1/100) = 0.0048, z = 0.2 / 0.069282
    assert drop_z(0.5, 100, 0.3, 100) == pytest.approx(2.886751, rel=1e-6)
    assert drop_z(0.3, 100, 0.5, 100) == pytest.approx(-2.886751, rel=1e-6)
    assert drop_z(1.0, 10, 0.0, 10) == pytest.approx(math.sqrt(20))  # pooled 0.5: variance 0.25 * 0.2
    assert drop_z(0.0, 10, 0.0, 30) == 0.0 and drop_z(1.0, 10, 1.0, 10) == 0.0


def test_alarm_quiet_on_a_healthy_run():
    healthy = stream(60, lambda i: min(0.9, 0.3 + 0.02 * i), entropy=lambda i: 1.0 + 0.05 * math.cos(i),
                     grad=lambda i: 1.0 + 0.2 * math.sin(3 * i))
    assert run(EchoTrapAlarm(), healthy) == []


def test_solving_is_not_collapsing():
    """A policy that solves its env narrows too (answers repeated, entropy down): without a success drop, no alarm."""
    solved = stream(30, lambda i: min(1.0, 0.4 + 0.1 * i), repetition=lambda i: min(0.9, 0.1 + 0.1 * i),
                    entropy=lambda i: 1.0 / (1 + i))
    assert run(EchoTrapAlarm(), solved) == []


def test_alarm_fires_on_collapse_and_names_signals():
    # Success holds at 0.6, then falls to 0.1 while the entropy falls to 0.3 of its level.
    collapse = stream(40, lambda i: 0.6 if i < 20 else 0.1, entropy=lambda i: 1.0 if i < 20 else 0.3)
    signals, tags = [], []
    fired = run(EchoTrapAlarm(patience=2), collapse, signals, tags)
    assert fired == [21]  # two consecutive collapsing steps: 20 and 21; and only once
    assert signals[0] == {"success_drop": 0.1, "entropy": 0.3} and tags == ["Bandit"]
    # Asking for a second signal: the entropy's trailing median has fallen to 0.3 by step 26, so it stops counting.
    assert run(EchoTrapAlarm(min_signals=2), collapse) == [21]
    flat = stream(40, lambda i: 0.6 if i < 20 else 0.1)
    assert run(EchoTrapAlarm(min_signals=2), flat) == [] and run(EchoTrapAlarm(), flat) == [21]


def test_a_low_success_env_can_collapse_but_its_noise_cannot():
    """The old alarm needed a best of 0.3 first, so an env at 15% could never raise it; the z-test replaces that."""
    fell = stream(30, lambda i: 0.15 if i < 15 else 0.0)
    assert run(EchoTrapAlarm(), fell) == [17]  # 0.15 -> 0 over 64 episodes is z 3.4: the 2- and 3-step means carry it
    rng = random.Random(0)
    noisy = [stream(100, lambda i: sum(rng.random() < 0.15 for _ in range(64)) / 64) for _ in range(100)]
    assert sum(bool(run(EchoTrapAlarm(), s)) for s in noisy) <= 5  # at most 5% false alarms (measured: 0)
    # Without the z-test (the old ratio rule with no minimum best), noise halves and alarms come often.
    assert sum(bool(run(EchoTrapAlarm(min_z=1e-9), s)) for s in noisy) >= 50


def test_entropy_is_read_per_env_where_the_run_logs_it():
    """A multi-env run logs each env's token entropy: one env narrowing is its own signal, not the other's, and the
    batch-wide loss/entropy (which mixes them) is then not read."""
    steady = stream(30, lambda i: 0.5, tag="FrozenLake")
    falling = stream(30, lambda i: 0.5 if i < 20 else 0.05, tag="Bandit")
    metrics = [{**a, **b, "rollout/FrozenLake/token_entropy": 1.0, "loss/entropy": 1.0 if i < 20 else 0.1,
                "rollout/Bandit/token_entropy": 1.0 if i < 15 else 0.2} for i, (a, b) in enumerate(zip(steady, falling))]
    alarm = EchoTrapAlarm()
    held = []
    for m in metrics:
        alarm.observe(m)
        held.append({tag: set(signals) for tag, signals in alarm.held.items()})
    assert held[15] == {"Bandit": {"entropy"}, "FrozenLake": set()}  # before success fell: a lead
    assert held[20] == {"Bandit": {"entropy", "success_drop"}, "FrozenLake": set()}
    assert held[25] == {"Bandit": {"success_drop"}, "FrozenLake": set()}  # the window has caught up with it
    # Steps whose filtered batches held no per-env entropy: the run's batch-wide entropy is still not read.
    for value in (1.0, 1.0, 1.0, 0.01):
        alarm.observe({k: v for k, v in metrics[-1].items() if not k.endswith("token_entropy")} | {"loss/entropy": value})
    assert all("entropy" not in signals for signals in alarm.held.values())


def test_one_env_collapsing_while_another_improves():
    rising = stream(30, lambda i: min(0.9, 0.05 * i), tag="FrozenLake")
    falling = stream(30, lambda i: 0.5 if i < 10 else 0.05, tag="Bandit")
    tags = []
    fired = run(EchoTrapAlarm(), [{**a, **b} for a, b in zip(rising, falling)], tags=tags)
    assert fired == [11] and tags == ["Bandit"]


@pytest.mark.parametrize("seed", range(5))
def test_recorded_runs_grpo_collapses_fire_and_ppo_stays_quiet(seed):
    """Recorded quickstart runs (benchmarks/learning_seeds.py, 20 iterations, warm starts of seeds 0-4): under
    GRPO the Bandit fell to the safe arm from step 1 in seeds 1-4 (0.44-0.64 -> 0.03-0.23 within three steps; seed 3
    recovered after step 14) and learned it in seed 0; PPO learned it in all five. The alarm fires on exactly the
    collapses, at most 3 steps after the fall began (benchmarks/echo_trap.py prints the table)."""
    grpo = trace(f"grpo_seed{seed}.csv")
    tags = []
    fired = run(EchoTrapAlarm(), grpo, tags=tags)
    if seed == 0:
        assert fired == []
    else:
        assert fired and fired[0] <= 4 and tags == ["Bandit"], (fired, tags)
    assert run(EchoTrapAlarm(), trace(f"ppo_seed{seed}.csv")) == []


def test_fires_once_per_env(tiny_model_path, tmp_path):
    alarm = EchoTrapAlarm()
    with pytest.warns(UserWarning, match=r"Echo Trap alarm") as warned:
        fit_replaying(tiny_model_path, tmp_path, alarm, "grpo_seed1.csv")
    assert len([w for w in warned if "Echo Trap alarm" in str(w.message)]) == 1
    assert alarm.fired_tags == {"Bandit"} and alarm.fired_at == 4


def test_alarm_arguments():
    with pytest.raises(ValueError, match=r"`EchoTrapAlarm.action` must be warn, checkpoint or stop, got 'halt'"):
        EchoTrapAlarm(action="halt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`EchoTrapAlarm` needs 0 < drop_ratio < 1 and min_z > 0; got 1.5, 4.0"):
        EchoTrapAlarm(drop_ratio=1.5)


def test_step0_validation_and_samples(tiny_model_path, tmp_path):
    module = RagenModule(str(tiny_model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4))
    other = Bandit(low_arm="Trader", high_arm="Librarian", tag="BanditTraderLibrarian")
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(), val_episodes=4,
                           val_envs=[Bandit(), other], rollout=RolloutConfig(max_turns=1, max_new_tokens=6))
    logger = CSVLogger(tmp_path)
    trainer = pl.Trainer(max_steps=2, val_check_interval=2, check_val_every_n_epoch=None, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                         callbacks=[ValidateAtStart(), TrajectorySamples(n=3)])
    trainer.fit(module, dm)
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    steps_with_val = [r.split(",")[header.index("step")] for r in rows[1:]
                      if r.split(",")[header.index("val/Bandit/success")]]
    assert steps_with_val[0] == "0"  # evaluated before the first update
    samples = sorted((tmp_path / "lightning_logs" / "version_0" / "samples").glob("*.jsonl"))
    assert [p.name for p in samples] == ["step_000000.jsonl", "step_000002.jsonl"]  # the baseline's too
    lines = [json.loads(x) for x in samples[-1].read_text().splitlines()]
    # 3 of each env's own episodes (the second env's were once written for both)
    assert [(x["env"], x["seed"]) for x in lines] == [("Bandit", 1_000_000 + k) for k in range(3)] + [
        ("BanditTraderLibrarian", 1_000_000 + k) for k in range(3)]
    assert lines[0]["transcript"][0]["role"] == "env" and "Trader" in json.dumps(lines[3]["transcript"])


def test_a_run_ends_with_a_summary_per_env(tiny_model_path, tmp_path, caplog):
    """The closing table: per evaluation env the step-0 success, the best and the last evaluation with their steps,
    and the random policy on the same seeds (Bandit: one random arm of two; the high-risk arm is a success)."""
    import logging

    from ragen_pl.baselines import random_success
    from ragen_pl.callbacks import RunSummary

    module = RagenModule(str(tiny_model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4))
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(), val_episodes=8,
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=6, max_actions_per_episode=1))
    trainer = pl.Trainer(max_steps=2, val_check_interval=1, check_val_every_n_epoch=None, logger=CSVLogger(tmp_path),
                         enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                         callbacks=[ValidateAtStart(), RunSummary()])
    with caplog.at_level(logging.INFO):
        trainer.fit(module, dm)
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Evaluation success"))
    lines = summary.splitlines()
    assert lines[0] == "Evaluation success (8 fixed seeds per env, temperature 0.5):"
    assert lines[1].split() == ["env", "step", "0", "best", "(step)", "last", "(step)", "random", "policy",
                                "optimal", "policy"]
    row = lines[2].split()
    history = next(cb for cb in trainer.callbacks if isinstance(cb, RunSummary)).history["Bandit"]
    assert [step for step, _ in history] == [0, 1, 2]  # the step-0 evaluation, then one after each update
    best = max(history, key=lambda p: p[1])
    assert row[0] == "Bandit" and float(row[1]) == pytest.approx(history[0][1], abs=5e-4)
    assert row[2:6] == [f"{best[1]:.3f}", f"({best[0]})", f"{history[-1][1]:.3f}", f"({history[-1][0]})"]
    assert float(row[6]) == pytest.approx(random_success(Bandit(), range(1_000_000, 1_000_008), 1), abs=5e-4)
    assert float(row[7]) == 1.0  # the expert pulls the high-risk arm
    assert lines[-1].startswith("Run folder: ")
    # Every evaluation logged both beside the model's success, and its console line says them.
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/Bandit/success")]
    assert len(rows) == 3 and {r["val/Bandit/optimal_success"] for r in rows} == {"1.0"}
    assert all(float(r["val/Bandit/random_success"]) == pytest.approx(float(row[6]), abs=5e-4) for r in rows)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("val/Bandit: success")]
    assert said and all(f"(random policy {float(row[6]):.3f}, optimal policy 1.000 on the same seeds)" in m
                        for m in said)


@pytest.mark.parametrize("bars", [True, False])
def test_an_evaluation_shows_its_progress_by_turn(tiny_model_path, capfd, bars):
    """Lightning's validation bar counts an evaluation as one batch; the episodes' turns get a bar of their own, with
    the episodes ended beside it, shown only where the trainer shows progress bars."""
    module = RagenModule(str(tiny_model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4))
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(), val_episodes=8,
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=6, max_actions_per_episode=1))
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=bars,
                         enable_model_summary=False)
    trainer.validate(module, dm)
    err = capfd.readouterr().err
    # 8 episodes of one turn: 8 episode-turns (the collector's test counts them)
    assert ("val/Bandit episode turns:   0%| " in err and "0/8" in err and "8/8 episodes ended" in err) is bars


def test_random_success_by_hand():
    """Bandit with one action: a random arm of two, so about half the plays choose the high-risk arm; a free-text env
    has no random policy here."""
    from ragen_pl.baselines import random_success
    from ragen_pl.envs.countdown import Countdown

    share = random_success(Bandit(), range(200), budget=1, repeats=5)
    assert 0.43 < share < 0.57  # 1,000 fair coin flips: 3.5 standard deviations either side
    assert random_success(Countdown(), range(3), budget=1) is None


def test_the_optimal_policy_by_hand_and_envs_without_one():
    """The expert on FrozenLake not slippery reaches the goal of every map within the shortest path's actions, and no
    fewer; slippery, value iteration's success is its optimal probability up to sampling; an env without an expert,
    or without named actions, simply has no such reference."""
    from ragen_pl.baselines import optimal_success, reference_success
    from ragen_pl.envs.base import Env
    from ragen_pl.envs.countdown import Countdown
    from ragen_pl.envs.frozen_lake import FrozenLake, shortest_path, value_iteration

    lake = FrozenLake(slippery=False)
    lengths = []
    for s in range(40):
        lake.reset(s)
        lengths.append(len(shortest_path(lake)))
    assert optimal_success(lake, range(40), budget=max(lengths)) == 1.0
    assert optimal_success(lake, range(40), budget=3) == pytest.approx(sum(n <= 3 for n in lengths) / 40)
    slippery = FrozenLake()
    expected = []
    for s in range(200):
        slippery.reset(s)
        expected.append(value_iteration(slippery)[0][slippery.start])
    measured = optimal_success(slippery, range(200), budget=100)
    assert abs(measured - sum(expected) / 200) < 0.1  # 200 episodes: about 3 standard errors (a fixed draw)
    assert reference_success(Countdown(), range(3), budget=1) == {"optimal_success": 1.0}

    class Plain(Env):
        actions = ("a",)
        instructions = "press a"

        def reset(self, seed):
            return "s"

        def step(self, action):
            return "s", 1.0, True, {"success": True}

        def render(self):
            return "s"

    assert reference_success(Plain(), range(4), budget=2) == {"random_success": 1.0}


class Replay(pl.Callback):
    """Puts one row of a recorded trace into the metrics after each step, as if this run had logged it."""

    def __init__(self, rows):
        self.rows = rows

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = self.rows[min(trainer.global_step - 1, len(self.rows) - 1)]
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in row.items() if k != "step"})


def test_alarm_stops_a_run_replaying_a_recorded_collapse(tiny_model_path, tmp_path):
    """The live plumbing: in a real fit, the recorded GRPO collapse (seed 1) makes the alarm warn, log and stop
    (step k sees row k - 1 of the trace; rows 2 and 3 collapse, so it stops after step 4)."""
    alarm = EchoTrapAlarm(action="stop")
    with pytest.warns(UserWarning, match=r"Echo Trap alarm at step 4 in env Bandit: .*success_drop=0\.125"):
        trainer = fit_replaying(tiny_model_path, tmp_path, alarm, "grpo_seed1.csv")
    assert alarm.fired_at == 4 and trainer.global_step == 4  # stopped at once


def fit_replaying(model_path, root, alarm, trace_name, steps=12):
    """A short real fit whose logged metrics are replaced, step by step, by a recorded trace."""
    module = RagenModule(str(model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4))
    dm = RolloutDataModule(Bandit(), n_groups=1, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=4))
    trainer = pl.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         limit_val_batches=0, callbacks=[Replay(trace(trace_name)), alarm], default_root_dir=root)
    trainer.fit(module, dm)
    return trainer


def test_early_warning_counts_steps_without_reward_variance():
    """The early warning: the kept groups' mean in-group reward std at most no_signal_std (0.02) for no_signal_steps
    (2) steps in a row while some env succeeds at least 0.5; filter/reward_std_after (what the update sees) over
    rollout/group_reward_std; a step that kept nothing (no update at all), or where every env is under 0.5 (nothing
    learned to lose), breaks the streak instead of extending it."""
    def step(after=None, before=None, kept=1.0, success=1.0):
        m = {"filter/kept_frac": kept, "rollout/Bandit/success": success, "rollout/Sokoban/success": 0.0}
        if after is not None:
            m["filter/reward_std_after"] = after
        if before is not None:
            m["rollout/group_reward_std"] = before
        return m

    alarm = EchoTrapAlarm()
    warned = []
    for m in [step(0.3, 0.3), step(0.01, 0.3), step(0.02, 0.3), step(0.0, 0.0, kept=0.0), step(0.0, 0.0),
              step(before=0.015), step(before=0.021), step(0.0, 0.5), step(0.0, 0.5), step(0.0, success=0.4),
              step(0.0, success=0.5)]:
        alarm.observe(m)
        warned.append(alarm.no_signal)
    assert warned == [False, False, True, False, False, True, False, False, True, False, False]
    off = EchoTrapAlarm(no_signal_steps=0)
    for _ in range(3):
        off.observe(step(0.0))
    assert not off.no_signal
    alarm.observe(step(0.0))
    restored = EchoTrapAlarm()
    restored.load_state_dict(json.loads(json.dumps(alarm.state_dict())))
    assert restored.no_signal_streak == 2 and restored.no_signal
    with pytest.raises(ValueError, match="no_signal_steps >= 0"):
        EchoTrapAlarm(no_signal_steps=-1)


@pytest.mark.parametrize("advantage", ["GAE", "GRPO"])
def test_early_warning_in_a_fit_only_where_advantages_are_whitened(tiny_model_path, tmp_path, advantage):
    """The live plumbing: a fit whose updates carry no reward variance warns once, at step 2, under PPO's whitened
    GAE (the critic's error at unit scale); under GRPO a group without variance has zero advantage, so no warning."""
    from ragen_pl.advantages import GAE, GRPO

    rows = [{"filter/reward_std_after": 0.0, "rollout/group_reward_std": 0.0, "filter/kept_frac": 1.0,
             "rollout/success": 1.0, "rollout/Bandit/success": 1.0}]
    alarm = EchoTrapAlarm()
    module = RagenModule(str(tiny_model_path), advantage={"GAE": GAE, "GRPO": GRPO}[advantage](),
                         ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4))
    dm = RolloutDataModule(Bandit(), n_groups=1, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=4))
    trainer = pl.Trainer(max_steps=4, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         limit_val_batches=0, callbacks=[Replay(rows), alarm], default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, dm)
    early = [str(w.message) for w in caught if "Echo Trap early warning" in str(w.message)]
    if advantage == "GAE":
        assert alarm.no_signal_at == 2 and len(early) == 1 and "DropZeroVariance" in early[0], early
    else:
        assert alarm.no_signal_at is None and not early and alarm.no_signal  # it held, but nothing to warn of


def test_alarm_history_survives_a_checkpoint():
    alarm = EchoTrapAlarm(window=3)
    for m in stream(5, lambda i: 0.6):
        alarm.observe(m)
    restored = EchoTrapAlarm(window=3)
    restored.load_state_dict(json.loads(json.dumps(alarm.state_dict())))
    assert {k: list(v) for k, v in restored.history.items()} == {k: list(v) for k, v in alarm.history.items()}
    assert restored.peaks == alarm.peaks == {"Bandit": {1: (0.6, 64), 2: (0.6, 128), 3: (0.6, 192)}}
    assert restored.successes == alarm.successes
    drop = stream(1, lambda i: 0.1)[0]
    assert restored.observe(drop) == alarm.observe(drop) and "success_drop" in alarm.last_signals


def test_success_test_counts_effective_episodes():
    """A fall from 0.4 to 0.15 over 64 episodes a step is z > 4 counted as independent episodes; where the groups'
    successes cluster so that a step is worth 8 of its 64 (design effect 8), the same fall is noise."""
    def fall(effective):
        metrics = stream(10, lambda i: 0.4 if i < 5 else 0.15)
        for m in metrics:
            m["rollout/Bandit/effective_episodes"] = effective
        return metrics

    assert run(EchoTrapAlarm(), fall(64.0)) != []
    alarm = EchoTrapAlarm()
    assert run(alarm, fall(8.0)) == []
    assert alarm.design == {"Bandit": (80.0, 10)}
    restored = EchoTrapAlarm()
    restored.load_state_dict(json.loads(json.dumps(alarm.state_dict())))
    assert restored.design == alarm.design


@pytest.mark.parametrize("kind", ["wandb", "tensorboard"])
def test_other_loggers(kind, tiny_model_path, tmp_path, monkeypatch):
    """wandb in offline mode (no network) and TensorBoard both take a run, sample table included."""
    if kind == "wandb":
        pytest.importorskip("wandb", reason="pip install 'ragen-pl[wandb]'")
        from lightning.pytorch.loggers import WandbLogger

        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
        logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="ragen-pl-test")
    else:
        pytest.importorskip("tensorboard", reason="pip install tensorboard")
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(tmp_path)
    module = RagenModule(str(tiny_model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4))
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(), val_episodes=2,
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=6))
    trainer = pl.Trainer(max_steps=1, val_check_interval=1, check_val_every_n_epoch=None, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[TrajectorySamples(n=2)],
                         default_root_dir=tmp_path)
    trainer.fit(module, dm)
    if kind == "wandb":
        logger.experiment.finish()
        runs = list((tmp_path / "wandb").glob("offline-run-*"))
        assert runs and list(runs[0].glob("*.wandb"))
    else:
        assert list(tmp_path.rglob("events.out.tfevents.*"))
    assert list(tmp_path.rglob("samples/step_*.jsonl"))


def test_echo_trap_benchmark(monkeypatch, capsys):
    """benchmarks/echo_trap.py: its ground truth by hand, and its tables on the recorded and simulated runs."""
    import benchmarks.echo_trap as echo_trap

    # Best trailing 3-step mean before step 3: (0.4 + 0.5 + 0.6) / 3 = 0.5; steps 3-5 average 0.2 < 0.25.
    assert echo_trap.halving([0.4, 0.5, 0.6, 0.3, 0.2, 0.1, 0.6]) == 3
    assert echo_trap.halving([0.4, 0.5, 0.6, 0.3, 0.3, 0.3]) is None  # 0.3 is not below half of 0.6's best (0.5)
    assert echo_trap.halving([0.08, 0.0, 0.0, 0.0, 0.0]) is None  # a best under 0.1 is noise, not a collapse
    # A lasting collapse stays below half the best to the end, for at least LASTING (10) steps: the dip at 3
    # recovers (0.6 at 6-8, so the best becomes 0.6), and the fall at 9 lasts 10 steps; 9 steps are not enough.
    dip_then_fall = [0.4, 0.5, 0.6, 0.1, 0.1, 0.1, 0.6, 0.6, 0.6] + [0.1] * 10
    assert echo_trap.LASTING == 10
    assert echo_trap.halving(dip_then_fall) == 3 and echo_trap.halving(dip_then_fall, to_end=True) == 9
    assert echo_trap.halving(dip_then_fall[:-1], to_end=True) is None
    rows = [r for s in range(5) for r in echo_trap.judge(f"grpo{s}", echo_trap.load(TRACES / f"grpo_seed{s}.csv"))]
    bandit = {name: (halved, alarm) for name, tag, halved, _, alarm, _ in rows if tag == "Bandit"}
    assert bandit["grpo0"] == (None, None)
    assert all(h == 1 and 1 <= a - h <= 3 for name, (h, a) in bandit.items() if name != "grpo0"), bandit
    rates = echo_trap.false_alarm_rates(runs=10, steps=60)
    assert set(rates) == set(echo_trap.LEVELS) and max(rates.values()) <= 0.1, rates
    # Groups on boards of their own (intra-class correlation 0.3): counting episodes as independent fires on most
    # no-learning runs at 15-30% success; the design effect from effective_episodes keeps it quiet.
    naive = echo_trap.false_alarm_rates(runs=10, steps=60, icc=0.3, effective=False)
    corrected = echo_trap.false_alarm_rates(runs=10, steps=60, icc=0.3)
    assert naive[0.15] >= 0.5 and naive[0.3] >= 0.5, naive
    assert max(corrected.values()) <= 0.1, corrected
    monkeypatch.setattr(sys, "argv", ["echo_trap.py", "--simulated", "2", "--steps", "20"])
    echo_trap.main()
    out = capsys.readouterr().out
    assert "Tuning runs" in out and "Held-out runs" in out and "false alarms" in out
    # The format-breaking SmolLM2 run (lr 3e-2, seed 1) is the held-out set's lasting real-model collapse.
    line = next(row for row in out.splitlines() if row.startswith("smollm2_frozenlake_centred_lr3e-2_seed1"))
    assert line.split()[2:6] == ["14", "16", "21", "caught,"], line
    # The early warning on a recorded PPO collapse (seed 7, lr 3e-3, no filter): no reward variance in the updates
    # from step 16 (Bandit solved, FrozenLake at 0), warned at 17, 5 steps before Bandit's success halved for good.
    early = next(row for row in out.splitlines() if row.startswith("  ppo_lr3e-3_nofilter_seed7 "))
    assert early.split()[1:4] == ["17", "22", "22"] and early.endswith("ahead by 5"), early
    # Tallied apart: the runs its thresholds were chosen on (seeds 3-8), and the PPO runs it never saw.
    assert "  tuning: 3-step halvings warned ahead of 4/6 (by 5-11); lasting collapses warned ahead of 4/5" in out
    held = next(row for row in out.splitlines() if row.startswith("  held out: 3-step halvings"))
    assert "lasting collapses warned ahead of 0/9" in held and "warned in 2/17 runs with no lasting collapse" in held
    # one of the two: the collapse grid's 25% filter at seed 10 (tests/data/collapse_grid), whose Bandit never halved
    quiet_grid = next(row for row in out.splitlines() if row.startswith("  ppo_lr3e-3_top0.25_seed10 "))
    assert quiet_grid.split()[1:] == ["37", "-", "-", "warned,", "nothing", "fell"], quiet_grid
    assert max(echo_trap.false_alarm_rates(runs=10, steps=60, icc=0.3, early=True).values()) <= 0.1
    monkeypatch.setattr(sys, "argv", ["echo_trap.py", "--simulated", "0"])
    echo_trap.main()
    assert "Simulated" not in capsys.readouterr().out
    # The lead table by hand: success falls from 0.6 to 0.1 at step 8 and stays down, so the halving is at 7 (steps
    # 7-9 average 0.267 < 0.3); repetition jumps past max_repetition (0.6) from step 5, 2 steps before, within the
    # 5-step horizon. A run with no halving where repetition holds at 2 of its 20 steps: held in 1 of 1, 10% of
    # steps, so by chance 1 - 0.9^6 = 47% of 6-step windows.
    def step(success, repetition):
        return {"rollout/Env/success": success, "rollout/Env/episodes": 64.0, "rollout/Env/repetition": repetition}
    falling = [step(0.6 if t < 8 else 0.1, 0.9 if t >= 5 else 0.1) for t in range(20)]
    quiet = [step(0.3, 0.9 if t in (10, 15) else 0.1) for t in range(20)]
    assert echo_trap.replay(falling, EchoTrapAlarm()).held["Env"]["repetition"] == list(range(5, 20))
    echo_trap.lead_table("By hand", [falling, quiet])
    line = next(row for row in capsys.readouterr().out.splitlines() if row.strip().startswith("repetition"))
    assert line.split() == ["repetition", "1/1", "(lead", "2-2)", "1/1", "(lead", "2-2)", "held", "in", "1/1",
                            "10.0%", "47%"], line
    monkeypatch.setattr(sys, "argv", ["echo_trap.py", "--runs", "no/such/metrics.csv"])
    with pytest.raises(SystemExit):
        echo_trap.main()
    assert "--runs: no such file no/such/metrics.csv" in capsys.readouterr().err


def test_each_evaluation_is_logged_at_the_step_of_the_weights_it_evaluated(tiny_model_path, tmp_path):
    """The evaluation after update k is logged at step k (Lightning would write it at k - 1, the step of the last
    training row, so the first evaluation after training shared step 0 with the baseline), and every evaluation,
    the step-0 baseline included, writes its sample trajectories."""
    from ragen_pl.callbacks import TrajectorySamples

    module = RagenModule(str(tiny_model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4))
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(), val_episodes=2,
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=6))
    trainer = pl.Trainer(max_steps=2, val_check_interval=1, check_val_every_n_epoch=None, logger=CSVLogger(tmp_path),
                         enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                         callbacks=[ValidateAtStart(), TrajectorySamples(n=2)])
    trainer.fit(module, dm)
    folder = tmp_path / "lightning_logs" / "version_0"
    with open(folder / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r.get("val/Bandit/success")] == [0, 1, 2]
    assert sorted(p.name for p in (folder / "samples").glob("*.jsonl")) == [
        "step_000000.jsonl", "step_000001.jsonl", "step_000002.jsonl"]


def test_the_alarm_tally_counts_a_catch_only_near_the_collapse():
    """An alarm counts as catching a collapse only from 5 steps before its onset to 10 after: the held-out run whose
    alarm fired at 2 on an earlier fall, 25 steps before its lasting collapse at 27, is not a catch of that collapse
    (the replay says so, and the tally has 20 of 21)."""
    import benchmarks.echo_trap as echo_trap

    assert echo_trap.CATCH_WINDOW == (-5, 10)
    assert echo_trap.caught(3, 1) and echo_trap.caught(0, 5) and echo_trap.caught(11, 1)
    assert not echo_trap.caught(2, 27) and not echo_trap.caught(12, 1) and not echo_trap.caught(None, 1)
    rows = [("seed4", "Bandit", 1, 27, 2, "-"), ("seed3", "Bandit", 19, 19, 21, "-")]
    assert echo_trap._tally(rows, 3) == ("caught 1/2 within -5..+10 steps of the onset (delay +2 to +2 steps, 1 more "
                                         "fired outside the window); false alarms 0/0")
    assert echo_trap._tally(rows, 2).startswith("caught 2/2 within")


def test_training_budget_stops_a_run_and_its_resume(tiny_model_path, tmp_path):
    """The budget sums the iterations' wall time (``time/iteration``, evaluations left out), stops the run once it is
    used, and travels in the checkpoint: a run resumed after its budget was used trains no further iteration."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ragen_pl.callbacks import TrainingBudget

    def fit(budget, ckpt_path=None):
        module = RagenModule(str(tiny_model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4))
        dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(), val_episodes=2,
                               rollout=RolloutConfig(max_turns=1, max_new_tokens=6))
        trainer = pl.Trainer(max_steps=5, val_check_interval=100, check_val_every_n_epoch=None, logger=False,
                             enable_progress_bar=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
                             callbacks=[budget, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
        trainer.fit(module, dm, ckpt_path=ckpt_path)
        return trainer

    budget = TrainingBudget(minutes=1e-6)  # used up by the first iteration
    trainer = fit(budget)
    assert trainer.global_step == 1 and budget.spent_s > 0
    assert trainer.callback_metrics["time/iteration"] == pytest.approx(budget.spent_s)
    again = TrainingBudget(minutes=1e-6)
    trainer = fit(again, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert trainer.global_step == 1 and again.spent_s == budget.spent_s  # restored, and nothing more trained
    with pytest.raises(ValueError, match=r"`TrainingBudget.minutes` must be > 0, got 0"):
        TrainingBudget(minutes=0)
