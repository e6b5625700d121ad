"""Every config parses, and runs one training step with the tiny test model and tiny budgets."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragen_pl.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASES = sorted(p for p in (ROOT / "configs").glob("*.yaml"))
RAGEN2 = sorted((ROOT / "configs" / "ragen2").glob("*.yaml"))
VARIANTS = sorted((ROOT / "configs" / "variants").glob("*.yaml"))

SHRINK = [
    "--trainer.max_steps=1", "--trainer.precision=32-true", "--trainer.accelerator=cpu", "--trainer.devices=1",
    "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
    "--trainer.limit_val_batches=0", "--data.n_groups=2", "--data.group_size=2", "--data.val_episodes=2",
    "--data.rollout.max_new_tokens=4", "--data.rollout.max_turns=2", "--model.ppo.mini_batch_size=4",
    "--model.ppo.micro_batch_size=2",
]


def test_there_are_configs():
    names = {p.name for p in BASES}
    assert {"bandit.yaml", "sokoban.yaml", "frozenlake.yaml", "quickstart.yaml"} <= names
    assert {"grpo.yaml", "starpo.yaml"} <= {p.name for p in VARIANTS}


@pytest.mark.parametrize("config", BASES, ids=[p.stem for p in BASES])
def test_config_runs_one_step(config, tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # LoRA on SmolLM2's last 10 of 30 layers: the tiny model has 2.
    fit = ["--model.lora.last_layers=1"] if "last_layers" in config.read_text() else []
    assert main(["fit", "--config", str(config), f"--model.model={tiny_model_path}", *SHRINK, *fit]) == 0


# Strategy variants run in tests/test_distributed.py (fsdp2, 2 CPU processes) and on GPUs (fsdp, marker gpu);
# lora needs peft. Here: every variant parses on top of every env config, and the others run one step.
RUNNABLE = [v for v in VARIANTS if v.stem in ("grpo", "starpo", "gigpo", "async")]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda p: p.stem)
def test_variant_parses(variant, tiny_model_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs" / "sokoban.yaml"), "--config", str(variant),
              f"--model.model={tiny_model_path}", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "model:" in capsys.readouterr().out


@pytest.mark.parametrize("variant", RUNNABLE, ids=lambda p: p.stem)
def test_variant_composes_and_runs(variant, tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(ROOT / "configs" / "sokoban.yaml"), "--config", str(variant),
            f"--model.model={tiny_model_path}", *SHRINK]
    assert main(args) == 0


@pytest.mark.gpu
def test_fsdp_variant_runs_on_gpus(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shrink = [a for a in SHRINK if not a.startswith(("--trainer.accelerator", "--trainer.devices", "--trainer.precision"))]
    args = ["fit", "--config", str(ROOT / "configs" / "sokoban.yaml"), "--config",
            str(ROOT / "configs" / "variants" / "fsdp.yaml"), f"--model.model={tiny_model_path}", *shrink]
    assert main(args) == 0


@pytest.mark.slow
def test_lora_variant_runs(tiny_model_path, tmp_path, monkeypatch):
    pytest.importorskip("peft", reason="the lora variant needs peft (pip install 'ragen-pl[peft]')")
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(ROOT / "configs" / "sokoban.yaml"), "--config",
            str(ROOT / "configs" / "variants" / "lora.yaml"), "--config", str(ROOT / "configs" / "variants" / "starpo.yaml"),
            f"--model.model={tiny_model_path}", "--model.lora.r=4", "--model.lora.alpha=8", *SHRINK]
    assert main(args) == 0


def test_print_config_and_entry_names(tiny_model_path, capsys):
    """Components can be named by entry name (`grpo`) as well as class path."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs" / "sokoban.yaml"), f"--model.model={tiny_model_path}",
              "--model.advantage=grpo", "--data.filter=drop_zero_variance", "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "class_path: ragen_pl.advantages.GRPO" in out
    assert "class_path: ragen_pl.filters.DropZeroVariance" in out


def test_help_lists_subcommands_and_known_subclasses():
    out = subprocess.run([sys.executable, "-m", "ragen_pl.cli", "fit", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"}).stdout
    flat = " ".join(out.split())
    assert "known subclasses: ragen_pl.advantages.GAE, ragen_pl.advantages.BiLevelGAE, ragen_pl.advantages.GRPO, " \
           "ragen_pl.advantages.DrGRPO, ragen_pl.advantages.RLOO, ragen_pl.advantages.ReinforcePP" in flat
    assert "ragen_pl.filters.VarianceTopP" in flat and "ragen_pl.envs.sokoban.Sokoban" in flat
    assert "ragen_pl.filters.SNR" in flat and "ragen_pl.losses.GSPO" in flat
    ppo = subprocess.run([sys.executable, "-m", "ragen_pl.cli", "fit", "--model.ppo.help"], capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "Passes over each rollout batch. (type: int, default: 1)" in ppo  # field docstrings become --help
    top = subprocess.run([sys.executable, "-m", "ragen_pl.cli", "--help"], capture_output=True, text=True).stdout
    for command in ("plugins", "play", "tiny", "sft", "demos", "fit|validate|test"):
        assert command in top


def test_fit_help_opens_with_the_options_users_set_and_their_own_help():
    """`ragen-pl fit --help` names the rollout and env options in its first lines, with the command that shows each
    group's settings; every such command works and lists that group's fields."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "ragen_pl.cli", "fit", *args], capture_output=True, text=True,
                              env={**os.environ, "COLUMNS": "200"}).stdout

    head = run("--help").splitlines()[:16]
    assert head[0].startswith("ragen-pl fit: StarPO / RAGEN training")
    text = "\n".join(head)
    for shown in ("--data.rollout.help", "--data.env.help NAME", "--model.ppo.help", "--data.filter.help NAME"):
        assert shown in text, shown
    assert "--data.rollout.max_new_tokens" in run("--data.rollout.help")
    assert "--data.env.slippery" in run("--data.env.help", "frozen_lake")
    assert "--data.filter.top_p" in run("--data.filter.help", "variance_top_p")


def test_bad_value_is_one_line_naming_the_flag(tiny_model_path, capsys):
    code = main(["fit", "--config", str(ROOT / "configs" / "bandit.yaml"), f"--model.model={tiny_model_path}",
                 "--model.ppo.clip_low=1.5", *SHRINK])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: `--model.ppo.clip_low` must be in [0, 1), got 1.5\n" in err
    assert "Traceback" not in err


def test_validate_and_test_from_a_checkpoint(tiny_model_path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shrink = [a for a in SHRINK if not a.startswith(("--trainer.enable_checkpointing", "--trainer.limit_val_batches"))]
    base = ["--config", str(ROOT / "configs" / "bandit.yaml"), f"--model.model={tiny_model_path}"]
    assert main(["fit", *base, *shrink, f"--trainer.default_root_dir={tmp_path}"]) == 0
    ckpt = next(tmp_path.rglob("last.ckpt"))
    evaluate = [a for a in shrink if not a.startswith("--trainer.max_steps")]
    for command in ("validate", "test"):
        assert main([command, *base, *evaluate, f"--ckpt_path={ckpt}"]) == 0
    out = capsys.readouterr().out
    assert "val/Bandit/success" in out and "test/Bandit/success" in out
    assert "test/BanditTraderLibrarian/success" in out  # every configured eval env


def test_unloadable_model_is_one_line_naming_the_field(tmp_path, capsys):
    code = main(["fit", "--config", str(ROOT / "configs" / "bandit.yaml"), f"--model.model={tmp_path / 'nothing'}",
                 *SHRINK])
    err = capsys.readouterr().err
    assert code == 2 and "`--model.model`: cannot load" in err and "Traceback" not in err


def test_unknown_component_name_lists_the_available_ones(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / "bandit.yaml"), "--data.env=nope", "--print_config"])
    err = capsys.readouterr().err
    assert "'nope' not found in ragen_pl.envs. Available: bandit, countdown, frozen_lake, gymnasium, openenv, sokoban" in err


@pytest.mark.parametrize("config", [p for p in RAGEN2 if p.stem != "nofilter"], ids=lambda p: p.stem)
@pytest.mark.parametrize("filtered", [True, False], ids=["filter", "nofilter"])
def test_ragen2_main_table_configs_run_one_step(config, filtered, tiny_model_path, tmp_path, monkeypatch):
    """configs/ragen2: RAGEN-2's main-table settings, with and without its filter, each run one step."""
    monkeypatch.chdir(tmp_path)
    nofilter = [] if filtered else ["--config", str(ROOT / "configs" / "ragen2" / "nofilter.yaml")]
    assert main(["fit", "--config", str(config), *nofilter, f"--model.model={tiny_model_path}", *SHRINK,
                 "--model.ppo.micro_batch_size=4"]) == 0
