"""The paper's findings in miniature: a small grid on the CPU quickstart, one table beside the paper's claims.

Each condition changes one thing of the quickstart's StarPO-S (PPO with a critic, variance filter keeping the top
50% of groups, clip-higher 0.2 / 0.28, no KL) and trains the tiny model on Bandit and FrozenLake (4x4, not slippery)
from the warm start of each seed (each seed rebuilds the tiny model and its warm start: another float path):

* GRPO instead of PPO; the variance filter at top_p 0.25 / 0.75 / 1.0 (no filtering); KL 0.001 to the reference;
  symmetric clipping 0.2 / 0.2.

Per condition it prints the evaluation success per env after the last iteration (range over seeds) and the Echo
Trap alarm's firings (the iteration of collapse: an env's training success falling, significantly for the
episodes counted, to half its best, see ``ragen_pl.callbacks.EchoTrapAlarm``; replayed on the logged metrics, so a
table rebuilt with ``--from-runs`` uses the alarm's current rule), beside what the paper found. It writes the
``ragen-pl report`` figures of each comparison (baseline against the variants) under ``--out``.

    python -m benchmarks.findings [--seeds 0 1 2] [--steps 20] [--out runs/findings]
    python -m benchmarks.findings --quick     # a smoke test: 1 seed, 2 conditions, 2 iterations
    python -m benchmarks.findings --from-runs # the table and figures again, from the runs under --out
    python -m benchmarks.findings --grid collapse --from-csv tests/data/echo_trap/heldout tests/data/collapse_grid \
        --seeds 9 10 11
        # the table of the collapse grid's runs kept in the repository
    python -m benchmarks.findings --grid collapse [--conditions NAME ...] [ragen-pl fit flags, e.g.
        --model.optim.actor_lr=2e-3]      # the setting where PPO collapses; fit flags come last and override

The full grid (7 conditions x 3 seeds x 20 iterations) takes about 40 minutes on the 2-core dev machine.
"""

from __future__ import annotations

import argparse
import csv
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.learning_seeds import ROOT, eval_success, fit_seed

BASE = "PPO (StarPO-S)"
#: condition -> (flags on top of the quickstart, the paper's finding it mirrors)
CONDITIONS: dict[str, tuple[list[str], str]] = {
    BASE: ([], "reference: PPO with the variance filter and clip-higher"),
    "GRPO": (["--config", str(ROOT / "configs" / "variants" / "grpo.yaml")],
             "PPO more stable than GRPO on Bandit (GRPO collapses ~step 20); GRPO the more stable on FrozenLake"),
    "filter top_p 0.25": (["--data.filter.init_args.top_p=0.25"],
                          "keeping 25% of groups: same result in about half the updates"),
    "filter top_p 0.75": (["--data.filter.init_args.top_p=0.75"], "keeping 75%: collapse delayed (100 -> 140)"),
    "no filter (top_p 1.0)": (["--data.filter.init_args.top_p=1.0"],
                              "no filter: collapses earliest (the Echo Trap, 'vanilla StarPO')"),
    "KL 0.001": (["--model.ppo.kl_coeff=0.001"], "StarPO-S drops the KL term; vanilla StarPO uses 0.001"),
    "symmetric clip 0.2": (["--model.ppo.clip_high=0.2"], "clip-higher (0.28) helps stability and exploration"),
}
COMPARISONS = {
    "ppo_vs_grpo": [BASE, "GRPO"],
    "filter": ["filter top_p 0.25", BASE, "filter top_p 0.75", "no filter (top_p 1.0)"],
    "kl": [BASE, "KL 0.001"],
    "clip": [BASE, "symmetric clip 0.2"],
}

COLLAPSE_LR = 3e-3
"""The actor learning rate at which PPO itself collapses in the miniature (3x the quickstart's). Searched on seed 0
without the filter: at 1e-3 and 2e-3 60 iterations learn both envs (Bandit dips to 0.6 and recovers), at 5e-3 both
envs fall to 0 at iteration 2 (entropy rising to 1.4: divergence, not the Echo Trap), at 3e-3 Bandit reaches 1.00,
its entropy falls from 0.55 to 0.12 over 15 iterations and then success drops to 0.00 at iteration 20. The search,
one rate at a time: ``python -m benchmarks.findings --grid collapse --conditions "PPO, no filter" --seeds 0
--steps 60 --model.optim.actor_lr=2e-3 --out runs/lr-2e-3``."""
MEASURED_WITH = ["--model.ppo.entropy_coeff=0.001"]
"""The quickstart's entropy bonus when both grids' tables were measured (2026-11-30, 12-02); the quickstart has none
since 2026-12-04 (at its rate the bonus broke the answer format once Bandit was solved), so the grids keep theirs."""
COLLAPSE_BASE = [*MEASURED_WITH, f"--model.optim.actor_lr={COLLAPSE_LR}", "--model.collapse.samples=16",
                 "--model.collapse.every_n_steps=3"]
COLLAPSE_NONE = "PPO, no filter"
COLLAPSE_CONDITIONS: dict[str, tuple[list[str], str]] = {
    COLLAPSE_NONE: (["--data.filter.init_args.top_p=1.0"], "no filter: collapses earliest"),
    "filter top_p 0.75": (["--data.filter.init_args.top_p=0.75"], "keeping 75%: collapse delayed (100 -> 140)"),
    "filter top_p 0.5": (["--data.filter.init_args.top_p=0.5"], "keeping 50%: no collapse within 200 steps"),
    "filter top_p 0.25": (["--data.filter.init_args.top_p=0.25"], "keeping 25%: the same in half the updates"),
    "no filter, KL 0.001": (["--data.filter.init_args.top_p=1.0", "--model.ppo.kl_coeff=0.001"],
                            "vanilla StarPO's KL term"),
    "no filter, symmetric clip 0.2": (["--data.filter.init_args.top_p=1.0", "--model.ppo.clip_high=0.2"],
                                      "clip-higher (0.28) helps stability"),
    # Where the batch carries no reward variance, whitened GAE advantages are the critic's error scaled to unit size:
    # an update on noise. These two remove only that (2026-12-05): nothing kept from a group whose rewards are all
    # equal (RAGEN-2's filters without zero-variance groups), or advantages left at the returns' own scale.
    "drop zero-variance groups": (["--data.filter=ragen_pl.filters.DropZeroVariance"],
                                  "RAGEN-2: groups without reward variance carry no signal"),
    "no filter, not whitened": (["--data.filter.init_args.top_p=1.0", "--model.advantage.init_args.whiten=false"],
                                "(not in the paper)"),
}
COLLAPSE_RECORDED = {COLLAPSE_NONE: "ppo_lr3e-3_nofilter", "filter top_p 0.75": "ppo_lr3e-3_top0.75",
                     "filter top_p 0.5": "ppo_lr3e-3_top0.5", "filter top_p 0.25": "ppo_lr3e-3_top0.25",
                     "no filter, KL 0.001": "ppo_lr3e-3_nofilter_kl1e-3",
                     "no filter, symmetric clip 0.2": "ppo_lr3e-3_nofilter_clip0.2",
                     "drop zero-variance groups": "ppo_lr3e-3_dropzero",
                     "no filter, not whitened": "ppo_lr3e-3_notwhitened"}
"""The collapse grid's runs kept in the repository, 40 iterations each: ``tests/data/echo_trap/heldout`` (seeds 3-11
without the filter, 9-11 dropping zero-variance groups and not whitened) and ``tests/data/collapse_grid`` (seeds
9-11 of the filter ratios, KL and symmetric clipping). ``--from-csv tests/data/echo_trap/heldout
tests/data/collapse_grid`` prints their table."""
COLLAPSE_COMPARISONS = {
    "filter": [COLLAPSE_NONE, "filter top_p 0.75", "filter top_p 0.5", "filter top_p 0.25"],
    "kl": [COLLAPSE_NONE, "no filter, KL 0.001"],
    "clip": [COLLAPSE_NONE, "no filter, symmetric clip 0.2"],
    "noise": [COLLAPSE_NONE, "drop zero-variance groups", "no filter, not whitened"],
}


@dataclass
class Grid:
    flags: list[str]
    """Flags of every condition, on top of the quickstart."""
    steps: int
    conditions: dict[str, tuple[list[str], str]]
    comparisons: dict[str, list[str]]
    quick: tuple[str, str]
    """The two conditions of ``--quick``."""
    quick_flags: tuple[str, ...] = ()
    """Flags ``--quick`` adds to the grid's own (besides its smaller rollout)."""
    collapse_table: bool = False
    """Print the collapse columns (collapse iteration, reward std, entropy, I(X;Z))."""
    recorded: dict[str, str] | None = None
    """Condition -> the name its runs' metrics were recorded under (``<name>_seed<k>.csv``), for ``--from-csv``."""


GRIDS = {
    "quickstart": Grid(MEASURED_WITH, 20, CONDITIONS, COMPARISONS, (BASE, "GRPO")),
    "collapse": Grid(COLLAPSE_BASE, 30, COLLAPSE_CONDITIONS, COLLAPSE_COMPARISONS, (COLLAPSE_NONE, "filter top_p 0.5"),
                     quick_flags=("--model.collapse.samples=4", "--model.collapse.every_n_steps=1"),
                     collapse_table=True, recorded=COLLAPSE_RECORDED),
}

HALVED_FROM = 0.3
"""A training success curve collapses where its 2-iteration mean falls to half the best it had reached (that best at
least this) and stays there to the end of the run, for at least :data:`COLLAPSE_MIN` iterations."""
COLLAPSE_MIN = 3


def curves(metrics: Path) -> dict[str, list[float]]:
    """The logged per-iteration series of a run that the collapse table reads (name -> values in step order)."""
    with open(metrics) as f:
        rows = [r for r in csv.DictReader(f)  # the training steps' rows (a recorded run may keep no time/*)
                if r.get("rollout/success") or r.get("time/iteration") or r.get("collapse/mi")]
    keys = {k for r in rows for k in r if (k.startswith("rollout/") and k.endswith("/success") and k.count("/") == 2)
            or k in ("rollout/group_reward_std", "rollout/token_entropy", "collapse/mi", "collapse/mi_upper_bound")}
    return {k: [float(r[k]) for r in rows if r.get(k)] for k in sorted(keys)}


def two_iteration_means(series: list[float]) -> list[float]:
    """Each value's mean with the one before it (the first value alone)."""
    return [(series[max(0, i - 1)] + series[i]) / 2 for i in range(len(series))]


def collapse_iteration(success: list[float]) -> int | None:
    """The iteration (1-based) where a collapse of training success began: its 2-iteration mean at most half the best
    earlier mean (that best at least :data:`HALVED_FROM`) from there to the end, :data:`COLLAPSE_MIN` iterations or
    more. None if the curve never collapses; a dip it recovers from is not a collapse (the alarm column shows those)."""
    means = two_iteration_means(success)
    for i in range(1, len(means) - COLLAPSE_MIN + 1):
        best = max(means[:i])
        if best >= HALVED_FROM and all(m <= best / 2 for m in means[i:]):
            return i + 1
    return None


def alarm_steps(metrics: Path) -> list[int]:
    """Iterations (1-based, as the table's other columns) at which the Echo Trap alarm (its current defaults) fires
    on a run's logged metrics, replayed as ``benchmarks/echo_trap.py`` does (a step's rows merged; a record kept with
    the alarm's columns only will do)."""
    from benchmarks.echo_trap import load, replay
    from ragen_pl.echo_trap import EchoTrapAlarm

    return sorted(step + 1 for step in replay(load(metrics), EchoTrapAlarm()).fired.values())


def fmt_range(values: list[float]) -> str:
    return f"{min(values):.2f}" if min(values) == max(values) else f"{min(values):.2f}-{max(values):.2f}"


def halved_from_start(series: list[float]) -> int | None:
    """The first iteration (1-based) whose 2-iteration mean is at most half the series' first value; None if never
    (the token entropy's fall, read as a warning of the collapse it comes before)."""
    means = two_iteration_means(series)
    return next((i + 1 for i in range(1, len(means)) if means[i] <= series[0] / 2), None)


def count_at(iterations: list[int | None]) -> str:
    """``k of n (at i, -, j)``: how many runs an event happened in, and at which iteration in each, in the order of
    the seeds (``-``: not in that one)."""
    seen = [i for i in iterations if i is not None]
    at = ", ".join("-" if i is None else str(i) for i in iterations)
    return f"{len(seen)} of {len(iterations)}" + (f" (at {at})" if seen else "")


def trend(runs: list[dict], key: str) -> str:
    """``first -> last`` of a logged series, averaged over the runs that logged it."""
    series = [run["curves"][key] for run in runs if run["curves"].get(key)]
    if not series:
        return "-"
    return f"{sum(c[0] for c in series) / len(series):.2f} -> {sum(c[-1] for c in series) / len(series):.2f}"


def print_table(results: dict[str, dict], envs: list[str], collapse: bool) -> None:
    if not collapse:
        print("| condition | " + " | ".join(envs) + " | Echo Trap alarm (collapse) | the paper |")
        print("|" + " --- |" * (len(envs) + 3))
    else:
        print("| condition | " + " | ".join(f"{env}: final, collapse at" for env in envs)
              + " | group reward std | reward std halved at | entropy | entropy halved at | I(X;Z) (of log N)"
              " | Echo Trap alarm | the paper |")
        print("|" + " --- |" * (len(envs) + 8))
    for name, r in results.items():
        runs = r["runs"]
        alarm = count_at([run["alarms"][0] if run["alarms"] else None for run in runs])
        cells = []
        for env in envs:
            final = fmt_range([run["success"][env][1] for run in runs if env in run["success"]])
            if collapse:
                final += "; " + count_at([collapse_iteration(run["curves"].get(f"rollout/{env}/success", []))
                                          for run in runs])
            cells.append(final)
        if collapse:
            cells += [trend(runs, "rollout/group_reward_std"),
                      count_at([halved_from_start(run["curves"].get("rollout/group_reward_std", [])) for run in runs]),
                      trend(runs, "rollout/token_entropy"),
                      count_at([halved_from_start(run["curves"].get("rollout/token_entropy", [])) for run in runs]),
                      f"{trend(runs, 'collapse/mi')} (of {trend(runs, 'collapse/mi_upper_bound')})"]
        print(f"| {name} | " + " | ".join(cells) + f" | {alarm} | {r['claim']} |")


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=list(GRIDS), default="quickstart",
                        help="quickstart: the quickstart's settings; collapse: the setting where PPO collapses")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="iterations per run (default: the grid's)")
    parser.add_argument("--val-episodes", type=int, default=64)
    parser.add_argument("--conditions", nargs="+", default=None, metavar="NAME",
                        help="run only these conditions of the grid (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="default: runs/findings (runs/findings-collapse)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 conditions, 2 iterations (a smoke test)")
    parser.add_argument("--from-runs", action="store_true",
                        help="train nothing: rebuild the table and figures from the runs already under --out")
    parser.add_argument("--from-csv", type=Path, nargs="+", default=None, metavar="DIR",
                        help="train nothing: the table (no figures) from recorded metrics, DIR/<name>_seed<k>.csv in "
                             "the first DIR that has it, <name> the grid's record of each condition (collapse grid: "
                             "tests/data/echo_trap/heldout tests/data/collapse_grid); without --conditions, each "
                             "condition recorded for every seed")
    args, fit_flags = parser.parse_known_args(argv)  # the rest goes to `ragen-pl fit`, after the grid's own flags
    grid = GRIDS[args.grid]
    replay = "--from-runs" if args.from_runs else "--from-csv" if args.from_csv else None
    if replay and fit_flags:
        parser.error(f"{replay} trains nothing, so the fit flags {fit_flags} would not apply; drop them")
    stray = [f for f in fit_flags if not f.startswith("--")]
    if stray:
        parser.error(f"unrecognised arguments {stray}: the fit flags after the script's own are --key=value")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    args.steps = args.steps or grid.steps
    args.out = args.out or Path("runs") / ("findings" if args.grid == "quickstart" else f"findings-{args.grid}")
    conditions = dict(grid.conditions)
    if args.conditions:
        unknown = [c for c in args.conditions if c not in conditions]
        if unknown:
            parser.error(f"--conditions: {unknown} not in the {args.grid} grid; choose from {list(conditions)}")
        conditions = {k: v for k, v in conditions.items() if k in args.conditions}
    if args.from_csv:
        recorded = grid.recorded or {}
        unrecorded = [c for c in conditions if c not in recorded] if args.conditions else []
        if unrecorded:
            parser.error(f"--from-csv: no recorded runs of {unrecorded} in the {args.grid} grid; "
                         f"--conditions from {list(recorded)}")
        found = {(c, s): next((p for d in args.from_csv if (p := d / f"{recorded[c]}_seed{s}.csv").is_file()), None)
                 for c in conditions if c in recorded for s in args.seeds}
        if not args.conditions:  # every recorded condition whose seeds are all in the folders
            conditions = {c: v for c, v in conditions.items()
                          if c in recorded and all(found[c, s] for s in args.seeds)}
            found = {(c, s): p for (c, s), p in found.items() if c in conditions}
            if not conditions:
                parser.error(f"--from-csv: no condition has records of seeds {args.seeds} in "
                             f"{[str(d) for d in args.from_csv]}; --seeds names the recorded seeds")
        missing = [f"{recorded[c]}_seed{s}.csv" for (c, s), p in found.items() if p is None]
        if missing:
            parser.error(f"--from-csv: no recorded metrics {missing} in {[str(d) for d in args.from_csv]}; "
                         "--seeds names the recorded seeds")
    extra: list[str] = list(grid.flags)
    if args.quick:
        args.seeds, args.steps, args.val_episodes = args.seeds[:1], 2, 4
        conditions = {k: conditions[k] for k in grid.quick}
        extra += ["--data.n_groups=4", "--data.group_size=4", *grid.quick_flags]
    start = time.perf_counter()
    results: dict[str, dict] = {}
    for name, (flags, claim) in conditions.items():
        runs = []
        for seed in args.seeds:
            folder = args.out / f"{name.replace(' ', '_').replace('(', '').replace(')', '').replace(',', '')}_seed{seed}"
            t0 = time.perf_counter()
            if args.from_csv:
                folder = metrics = found[name, seed]
            elif args.from_runs:
                metrics = max(folder.glob("*/version_*/metrics.csv"), key=lambda m: m.stat().st_mtime)
            else:
                metrics = fit_seed(seed, args.steps, args.val_episodes, [*extra, *flags, *fit_flags], folder)
            runs.append({"folder": folder, "success": eval_success(metrics), "alarms": alarm_steps(metrics),
                         "curves": curves(metrics)})
            print(f"[{time.perf_counter() - start:6.0f}s] {name}, seed {seed}: "
                  + ", ".join(f"{env} {a:.2f} -> {b:.2f}" for env, (a, b, _) in runs[-1]["success"].items())
                  + (f"; Echo Trap alarm at {runs[-1]['alarms']}" if runs[-1]["alarms"] else "")
                  + f" ({time.perf_counter() - t0:.0f}s)", flush=True)
        results[name] = {"runs": runs, "claim": claim}

    envs = sorted({env for r in results.values() for run in r["runs"] for env in run["success"]})
    steps = sorted({len(c) for r in results.values() for run in r["runs"] for k, c in run["curves"].items()
                    if k.endswith("/success")}) if replay else [args.steps]
    print(f"\nfindings ({args.grid}): {len(args.seeds)} seeds x {'/'.join(map(str, steps))} iterations, "
          "evaluation success after the "
          f"last one (range over seeds), Echo Trap alarms; iterations counted from 1:\n")
    print_table(results, envs, collapse=grid.collapse_table)

    if args.from_csv:
        return results
    from ragen_pl.report import report

    for comparison, names in grid.comparisons.items():
        folders = [run["folder"] for n in names if n in results for run in results[n]["runs"]]
        if len({n for n in names if n in results}) > 1:
            report(folders, args.out / "report" / comparison)
    print(f"\nfigures per comparison under {args.out / 'report'}; total {time.perf_counter() - start:.0f}s")
    return results


if __name__ == "__main__":
    main()
