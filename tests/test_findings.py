"""`python -m benchmarks.findings --quick`: the findings grid's plumbing end to end (runs, table, report figures)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_findings_quick(tmp_path, capsys, monkeypatch):
    import benchmarks.findings as findings

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
    import benchmarks.findings as findings

    results = findings.main(["--grid", "collapse", "--quick", "--out", str(tmp_path)])
    assert set(results) == set(findings.GRIDS["collapse"].quick)
    for r in results.values():
        (run,) = r["runs"]
        assert len(run["curves"]["rollout/Bandit/success"]) == 2  # one value per iteration
        assert any(k.startswith("collapse/") and k.endswith("/mi") for k in run["curves"])
    out = capsys.readouterr().out
    assert ("| condition | Bandit: final, collapse at | FrozenLakeNoSlip: final, collapse at | group reward std "
            "| reward std halved at | entropy | entropy halved at | I(X;Z) (of log N) |") in out
    assert f"| {findings.COLLAPSE_NONE} |" in out
    assert (tmp_path / "report" / "filter" / "success.png").is_file()


def test_collapse_iteration(monkeypatch):
    from benchmarks.findings import collapse_iteration

    # 2-iteration means 0.6, 0.6, 0.35, 0.05, 0, 0: at most half the best (0.6) from the 4th iteration to the end
    assert collapse_iteration([0.6, 0.6, 0.1, 0.0, 0.0, 0.0]) == 4
    assert collapse_iteration([0.6, 0.0, 0.0, 0.6, 0.6, 0.6]) is None  # a dip it recovers from
    assert collapse_iteration([0.2, 0.2, 0.0, 0.0, 0.0]) is None  # its best (0.2) never reached HALVED_FROM
    assert collapse_iteration([0.6, 0.6, 0.6, 0.6, 0.0]) is None  # shorter than COLLAPSE_MIN at the end
    assert collapse_iteration([]) is None


def test_count_at(monkeypatch):
    from benchmarks.findings import count_at

    assert count_at([21, None, 3]) == "2 of 3 (at 21, -, 3)"  # in the seeds' order, so columns line up
    assert count_at([None, None]) == "0 of 2"


def test_halved_from_start(monkeypatch):
    from benchmarks.findings import halved_from_start

    # 2-iteration means after the first: 0.5, 0.35, 0.25 -> at most 0.6 / 2 at the 4th iteration
    assert halved_from_start([0.6, 0.4, 0.3, 0.2]) == 4
    assert halved_from_start([0.6, 0.5, 0.4]) is None
    assert halved_from_start([0.6]) is None


def test_fit_flags_pass_through(tmp_path, monkeypatch):
    """Flags findings.py does not know go to every run's `ragen-pl fit`, after the grid's and the condition's own
    (so they override both); with --from-runs, which trains nothing, they are refused."""
    import benchmarks.findings as findings

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


def test_from_csv_tables_the_recorded_collapse_runs(capsys, monkeypatch):
    """`--grid collapse --from-csv`: the table of the runs kept in the repository, reward std beside entropy; a
    condition or seed with no record, or fit flags, refused in one line."""
    import benchmarks.findings as findings

    data = ROOT / "tests" / "data" / "echo_trap" / "heldout"
    grid = ROOT / "tests" / "data" / "collapse_grid"
    results = findings.main(["--grid", "collapse", "--from-csv", str(data), str(grid), "--seeds", "9", "10", "11"])
    assert set(results) == set(findings.COLLAPSE_RECORDED)  # every condition, from the two folders
    # the other conditions' Bandit falls, read by hand from tests/data/collapse_grid (None: no lasting collapse)
    falls = {name: [findings.collapse_iteration(r["curves"]["rollout/Bandit/success"]) for r in results[name]["runs"]]
             for name in results}
    assert falls["filter top_p 0.75"] == [2, None, 4] and falls["filter top_p 0.5"] == [3, None, None]
    assert falls["filter top_p 0.25"] == [4, None, None] and falls["no filter, KL 0.001"] == [3, None, 9]
    assert falls["no filter, symmetric clip 0.2"] == [None, None, None]
    capsys.readouterr()
    # without --conditions, the conditions recorded for every seed in the folders given: the heldout folder has three
    results = findings.main(["--grid", "collapse", "--from-csv", str(data), "--seeds", "9", "10", "11"])
    assert set(results) == {findings.COLLAPSE_NONE, "drop zero-variance groups", "no filter, not whitened"}
    # the seeds' Bandit success, read by hand from the CSVs: falls to 0 at 3 (9, 11) and 20 (10) without the filter
    runs = results[findings.COLLAPSE_NONE]["runs"]
    assert [findings.collapse_iteration(r["curves"]["rollout/Bandit/success"]) for r in runs] == [3, 20, 3]
    assert all(len(r["curves"]["rollout/group_reward_std"]) == 40 for r in runs)
    # the alarm replayed as benchmarks/echo_trap.py does (steps 4, 20, 3 counted from 0 there)
    assert [r["alarms"] for r in runs] == [[5], [21], [4]]
    out = capsys.readouterr().out
    assert "3 seeds x 40 iterations" in out
    assert "| group reward std | reward std halved at | entropy | entropy halved at |" in out
    assert "| PPO, no filter | 0.00; 3 of 3 (at 3, 20, 3) |" in out
    # a record trimmed to the alarm's columns (no time/*) still gives its curves
    trimmed = data / "ppo_lr3e-3_nofilter_seed3.csv"
    assert "time/iteration" not in trimmed.read_text().splitlines()[0].split(",")
    assert len(findings.curves(trimmed)["rollout/Bandit/success"]) == 40
    for bad in (["--conditions", "filter top_p 0.5"], ["--seeds", "0"], ["--model.optim.actor_lr=2e-3"],
                ["--conditions", "no filter, KL 0.001", "--seeds", "3"]):
        with pytest.raises(SystemExit):
            findings.main(["--grid", "collapse", "--from-csv", str(data), *bad])
    assert "--from-csv" in capsys.readouterr().err
