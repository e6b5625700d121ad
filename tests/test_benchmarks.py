"""The product benchmarks compare fairly: train_step's plain-loop baseline pads each micro-batch to its own longest row
(as a collator does), rollout.py says how much of its prompts is one shared prefix, and credit.py's recipes differ
only in their advantage."""

import sys

import pytest
import torch

from benchmarks.rollout import common_prefix
from benchmarks.train_step import plain_update
from tests.helpers import make_batch


def test_the_plain_loop_cuts_each_micro_batch_to_its_longest_row():
    """Rows of 2, 2, 5 and 5 real tokens in micro-batches of two: the model sees widths 2 and 5, never the batch's
    5 for the short pair (the review measured the baseline padding every micro-batch to the batch's longest row)."""
    widths = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 10)

        def forward(self, input_ids, attention_mask=None):
            widths.append(input_ids.shape[1])
            return type("Out", (), {"logits": self.emb(input_ids)})()

    batch = make_batch([[0, 1, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    batch.attention_mask[:2, 2:] = False  # the first two rows are 2 real tokens long, right-padded
    batch.input_ids = batch.input_ids % 10
    batch.advantages = torch.ones_like(batch.rewards)
    model = Spy()
    plain_update(model, batch, torch.optim.SGD(model.parameters(), lr=0.1), micro=2)
    assert widths == [2, 5]


def test_common_prefix():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix([[7, 1], [8, 1]]) == 0 and common_prefix([[1, 2], [1, 2]]) == 2


@pytest.mark.parametrize("recipe, advantage", [("gigpo", "GiGPO"), ("grpo", "GRPO"), ("ppo_bilevel_gae", "BiLevelGAE")])
def test_the_credit_benchmark_changes_only_the_advantage(recipe, advantage, tiny_model_path, tmp_path, capsys):
    """benchmarks/credit.py: each recipe is the quickstart on FrozenLake alone with its own advantage."""
    import yaml

    from benchmarks import credit
    from ragen_pl.cli import main

    (tmp_path / "frozenlake_only.yaml").write_text(credit.FROZEN_LAKE_ONLY)
    args = credit.fit_args(recipe, 3, str(tiny_model_path), 30, 128, tmp_path)
    assert args[:4] == [sys.executable, "-m", "ragen_pl.cli", "fit"]
    with pytest.raises(SystemExit):
        main([*args[3:], "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["advantage"]["class_path"] == f"ragen_pl.advantages.{advantage}"
    assert [e["init_args"]["tag"] for e in config["data"]["env"]] == ["FrozenLakeNoSlip"]
    assert config["model"]["optim"]["actor_lr"] == 1.0e-3 and config["data"]["group_size"] == 8
    assert config["seed_everything"] == 3 and config["data"]["seed"] == 3000
    if recipe == "ppo_bilevel_gae":
        assert config["model"]["advantage"]["init_args"]["segments"] == "turn_ids"


@pytest.mark.slow
def test_the_async_benchmark_runs_both_layouts_on_the_same_config(tiny_model_path, monkeypatch, capsys):
    """benchmarks/async_rollout.py: K=0 with the embedded engine, K=0 and K=1 with a rollout process, one table."""
    from benchmarks import async_rollout

    monkeypatch.setattr(sys, "argv", ["async_rollout.py", "--model", str(tiny_model_path), "--steps", "3",
                                      "--trainer.precision=32-true"])
    assert async_rollout.main() == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines() if line.startswith(("K=0, ", "K=1, "))}
    assert set(rows) == {"K=0, hf", "K=0, process", "K=1, process"}
    assert rows["K=0, hf"][-1] == rows["K=0, process"][-1] == "0.00" and rows["K=1, process"][-1] == "1.00"  # staleness
    assert "overlapping them gains at most" in out and "K=1 against K=0 with the same split of cores: " in out
    assert "trainer 1 + rollout process 1" in out
