"""`benchmarks/findings.py --quick`: the findings grid's plumbing end to end (runs, table, report figures)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_findings_quick(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("findings", None)
    import findings

    results = findings.main(["--quick", "--out", str(tmp_path)])
    assert set(results) == {findings.BASE, "GRPO"}
    for r in results.values():
        (run,) = r["runs"]
        assert set(run["success"]) == {"Bandit", "FrozenLakeNoSlip"}
        assert all(0.0 <= v <= 1.0 for pair in run["success"].values() for v in pair)
    out = capsys.readouterr().out
    assert "| condition | Bandit | FrozenLakeNoSlip | Echo Trap alarm (collapse) | the paper |" in out
    assert "| GRPO |" in out
    assert (tmp_path / "report" / "ppo_vs_grpo" / "success.png").is_file()
    assert (tmp_path / "report" / "ppo_vs_grpo" / "trajectories.html").is_file()
