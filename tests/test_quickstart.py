"""The quickstart learns: the warm-started tiny model goes from picking Bandit arms about at random to the better
arm, in one run of `configs/quickstart.yaml` (shortened) through the CLI.

The claim tested is the one that holds on any machine: float results differ between CPUs (the warm start and the
sampled tokens change), so the margins come from `benchmarks/learning_seeds.py`, which rebuilds the warm start with
5 seeds. FrozenLake's progress within this budget varies from seed to seed; that benchmark and the README report
its range instead of a test asserting one machine's path.
"""

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
    assert bandit[0][0] == 0 and bandit[-1][0] >= 19
    # the warm start does not know the better arm: 0.09-0.91 over 8 rebuilt seeds on 2026-12-04's CPU (seed 0: 0.75;
    # seed 2's 0.91 is above this bar, so another float path can fail here: see issue 20's note of that day)
    assert bandit[0][1] <= 0.85, bandit
    # StarPO-S learned to pick the high-risk arm: 1.00 on all 8 rebuilt seeds (0-4, and 5-7 held out) on a CPU with
    # avx512_bf16, 2026-12-04 (with the former entropy bonus of 0.001, seed 0 there broke its answer format: 0.375);
    # with 64 episodes a success of 0.9 has a standard error of about 0.04, so the bar sits 2-3 of them below.
    assert bandit[-1][1] >= 0.8, bandit
