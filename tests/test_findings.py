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
        assert all(0.0 <= v <= 1.0 and -1.0 <= rise <= 1.0 for v0, v1, rise in run["success"].values() for v in (v0, v1))
    out = capsys.readouterr().out
    assert "| condition | Bandit | FrozenLakeNoSlip | Echo Trap alarm (collapse) | the paper |" in out
    assert "| GRPO |" in out
    assert (tmp_path / "report" / "ppo_vs_grpo" / "success.png").is_file()
    assert (tmp_path / "report" / "ppo_vs_grpo" / "trajectories.html").is_file()


@pytest.mark.slow
def test_collapse_grid_quick(tmp_path, capsys, monkeypatch):
    """`--grid collapse --quick`: the collapse setting's runs log I(X;Z), and the table reads it beside reward std."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("findings", None)
    import findings

    results = findings.main(["--grid", "collapse", "--quick", "--out", str(tmp_path)])
    assert set(results) == set(findings.GRIDS["collapse"].quick)
    for r in results.values():
        (run,) = r["runs"]
        assert len(run["curves"]["rollout/Bandit/success"]) == 2  # one value per iteration
        assert any(k.startswith("collapse/") and k.endswith("/mi") for k in run["curves"])
    out = capsys.readouterr().out
    assert ("| condition | Bandit: final, collapse at | FrozenLakeNoSlip: final, collapse at | group reward std "
            "| entropy | entropy halved at | I(X;Z) (of log N) |") in out
    assert f"| {findings.COLLAPSE_NONE} |" in out
    assert (tmp_path / "report" / "filter" / "success.png").is_file()


def test_collapse_iteration(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from findings import collapse_iteration

    # 2-iteration means 0.6, 0.6, 0.35, 0.05, 0, 0: at most half the best (0.6) from the 4th iteration to the end
    assert collapse_iteration([0.6, 0.6, 0.1, 0.0, 0.0, 0.0]) == 4
    assert collapse_iteration([0.6, 0.0, 0.0, 0.6, 0.6, 0.6]) is None  # a dip it recovers from
    assert collapse_iteration([0.2, 0.2, 0.0, 0.0, 0.0]) is None  # its best (0.2) never reached HALVED_FROM
    assert collapse_iteration([0.6, 0.6, 0.6, 0.6, 0.0]) is None  # shorter than COLLAPSE_MIN at the end
    assert collapse_iteration([]) is None


def test_halved_from_start(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from findings import halved_from_start

    # 2-iteration means after the first: 0.5, 0.35, 0.25 -> at most 0.6 / 2 at the 4th iteration
    assert halved_from_start([0.6, 0.4, 0.3, 0.2]) == 4
    assert halved_from_start([0.6, 0.5, 0.4]) is None
    assert halved_from_start([0.6]) is None


def test_fit_flags_pass_through(tmp_path, monkeypatch):
    """Flags findings.py does not know go to every run's `ragen-pl fit`, after the grid's and the condition's own
    (so they override both); with --from-runs, which trains nothing, they are refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("findings", None)
    import findings

    seen = []

    def fake_fit(seed, steps, val_episodes, extra, save_dir):
        seen.append(extra)
        raise KeyboardInterrupt  # stop after the first run

    monkeypatch.setattr(findings, "fit_seed", fake_fit)
    with pytest.raises(KeyboardInterrupt):
        findings.main(["--grid", "collapse", "--conditions", findings.COLLAPSE_NONE, "--seeds", "0",
                       "--out", str(tmp_path), "--model.optim.actor_lr=2e-3"])
    (flags,) = seen
    assert flags[-1] == "--model.optim.actor_lr=2e-3"
    assert flags.index(f"--model.optim.actor_lr={findings.COLLAPSE_LR}") < len(flags) - 1
    assert "--data.filter.init_args.top_p=1.0" in flags
    # both grids keep the entropy bonus their README tables were measured with, whatever the quickstart has now
    assert flags[0] == "--model.ppo.entropy_coeff=0.001" and findings.GRIDS["quickstart"].flags == findings.MEASURED_WITH
    for bad in (["--from-runs", "--model.optim.actor_lr=2e-3"], ["stray"]):
        with pytest.raises(SystemExit):
            findings.main(["--out", str(tmp_path), *bad])
