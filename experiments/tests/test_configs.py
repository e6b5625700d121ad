"""Every experiment config runs one training step with the tiny test model, through the plugins' entry points."""

from pathlib import Path

import pytest

from ragen_pl.cli import main

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
SHRINK = [
    "--trainer.max_steps=1", "--trainer.precision=32-true", "--trainer.logger=false",
    "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
    "--data.n_groups=2", "--data.group_size=2", "--data.val_episodes=2", "--data.rollout.max_turns=2",
    "--model.ppo.mini_batch_size=4", "--model.ppo.micro_batch_size=2", "--model.collapse=null",
]


def test_there_are_experiment_configs():
    assert {p.name for p in CONFIGS} >= {"smollm2-frozenlake.yaml", "smollm2-sokoban.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_experiment_config_runs_one_step(config, tiny_model_path, tmp_path, monkeypatch):
    pytest.importorskip("peft", reason="the readout trains a LoRA adapter (pip install 'ragen-pl[peft]')")
    monkeypatch.chdir(tmp_path)
    # The tiny tokenizer spells Down and Left in two tokens each: a readout of Up and Right instead.
    hooks = "[{class_path: readout_head, init_args: {center: 4, whiten: true, tokens: [Up, Right]}}]"
    assert main(["fit", "--config", str(config), f"--model.model={tiny_model_path}", f"--model.hooks={hooks}",
                 *SHRINK]) == 0
