import json
import math

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from ragen_pl.callbacks import EchoTrapAlarm, TrajectorySamples, ValidateAtStart
from ragen_pl.data import RolloutDataModule
from ragen_pl.envs.bandit import Bandit
from ragen_pl.filters import NoFilter
from ragen_pl.module import PPOConfig, RagenModule
from ragen_pl.rollout.collector import RolloutConfig


def stream(n, std, entropy, grad):
    return [{"filter/reward_std_before": std(i), "loss/entropy": entropy(i), "actor/grad_norm": grad(i)}
            for i in range(n)]


def run(alarm, metrics, signals=None):
    fired = []
    for i, m in enumerate(metrics):
        now = alarm.observe(m)
        if alarm.firing:
            fired.append(i)
            if signals is not None:
                signals.append(now)
            alarm.streak = 0
    return fired


def test_alarm_quiet_on_a_healthy_run():
    healthy = stream(60, lambda i: 0.5 + 0.1 * math.sin(i), lambda i: 1.0 + 0.05 * math.cos(i), lambda i: 1.0 + 0.2 * math.sin(3 * i))
    assert run(EchoTrapAlarm(), healthy) == []


def test_alarm_fires_on_collapse_and_names_signals():
    # Healthy for 20 steps, then in-group std and entropy collapse and the gradient norm spikes.
    collapse = stream(40, lambda i: 0.5 if i < 20 else 0.01, lambda i: 1.0 if i < 20 else 0.2,
                      lambda i: 1.0 if i < 20 else 20.0)
    alarm, signals = EchoTrapAlarm(patience=2), []
    fired = run(alarm, collapse, signals)
    assert fired and fired[0] == 21  # two consecutive collapsing steps: 20 and 21
    assert set(signals[0]) == {"reward_std", "entropy", "grad_spike"}
    assert signals[0]["reward_std"] == 0.01 and signals[0]["grad_spike"] == 20.0


def test_alarm_std_only_early_warning_needs_one_signal():
    falling = stream(30, lambda i: 0.5 * 0.8**i, lambda i: 1.0, lambda i: 1.0)
    assert run(EchoTrapAlarm(min_signals=1, patience=3), falling)
    assert not run(EchoTrapAlarm(min_signals=2, patience=3), falling)


def test_alarm_arguments():
    with pytest.raises(ValueError, match=r"`EchoTrapAlarm.action` must be warn, checkpoint or stop, got 'halt'"):
        EchoTrapAlarm(action="halt")  # type: ignore[arg-type]


def test_step0_validation_and_samples(tiny_model_path, tmp_path):
    module = RagenModule(str(tiny_model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4))
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(), val_episodes=4,
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=6))
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
    samples = list((tmp_path / "lightning_logs" / "version_0" / "samples").glob("*.jsonl"))
    assert len(samples) == 1
    lines = [json.loads(x) for x in samples[0].read_text().splitlines()]
    assert len(lines) == 3 and lines[0]["env"] == "Bandit" and lines[0]["transcript"][0]["role"] == "env"


@pytest.mark.slow
def test_alarm_stops_a_provoked_collapse(tmp_path):
    """GRPO with a learning rate 10x too high drives the warm-started tiny model into the Echo Trap within a few
    iterations (every answer malformed and alike, in-group reward std 0): the alarm must fire and stop the run."""
    from ragen_pl.advantages import GRPO
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.module import OptimConfig
    from ragen_pl.tiny import TINY_MODEL_ID, warm_start_rollout

    alarm = EchoTrapAlarm(window=4, patience=2, action="stop")
    module = RagenModule(TINY_MODEL_ID, advantage=GRPO(), ppo=PPOConfig(mini_batch_size=32, micro_batch_size=32),
                         optim=OptimConfig(actor_lr=1e-2))
    dm = RolloutDataModule(Sokoban(), n_groups=4, group_size=8, filter=NoFilter(), rollout=warm_start_rollout())
    trainer = pl.Trainer(max_steps=12, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         limit_val_batches=0, callbacks=[alarm], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"Echo Trap alarm at step \d+: .*reward_std=0.*repetition="):
        trainer.fit(module, dm)
    assert alarm.fired_at is not None and alarm.fired_at <= 8
    assert trainer.global_step < 12  # stopped early


def test_alarm_history_survives_a_checkpoint():
    alarm = EchoTrapAlarm(window=3)
    for m in stream(5, lambda i: 0.5, lambda i: 1.0, lambda i: 1.0):
        alarm.observe(m)
    restored = EchoTrapAlarm(window=3)
    restored.load_state_dict(json.loads(json.dumps(alarm.state_dict())))
    assert {k: list(v) for k, v in restored.history.items()} == {k: list(v) for k, v in alarm.history.items()}
    assert restored.observe({"filter/reward_std_before": 0.01}) == alarm.observe({"filter/reward_std_before": 0.01})


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
