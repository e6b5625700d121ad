"""A shortened quickstart: the warm-started tiny model learns Bandit (success from about 0.5 to >= 0.9) and
improves on FrozenLake (not slippery) well above its step-0 rate, in one run with fixed seeds."""

import csv
from pathlib import Path

import pytest

from ragen_pl.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_learns_bandit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps=20",
                 "--trainer.val_check_interval=20", "--data.val_episodes=64", "--trainer.enable_progress_bar=false",
                 f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_checkpointing=false"])
    assert code == 0
    with open(next(tmp_path.glob("quickstart/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    bandit = [(int(r["step"]), float(r["val/Bandit/success"])) for r in rows if r.get("val/Bandit/success")]
    lake = [(int(r["step"]), float(r["val/FrozenLakeNoSlip/success"])) for r in rows
            if r.get("val/FrozenLakeNoSlip/success")]
    assert bandit[0][0] == 0 and bandit[-1][0] >= 19 and lake[0][0] == 0
    assert 0.3 <= bandit[0][1] <= 0.75, bandit  # the warm start picks arms almost at random
    assert bandit[-1][1] >= 0.9, bandit  # StarPO-S learned to pick the high-risk arm
    assert lake[0][1] <= 0.1, lake  # random legal moves rarely reach the goal
    assert lake[-1][1] >= lake[0][1] + 0.1, lake  # clearly above the step-0 rate
