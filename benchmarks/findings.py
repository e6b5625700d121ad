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

    python benchmarks/findings.py [--seeds 0 1 2] [--steps 20] [--out runs/findings]
    python benchmarks/findings.py --quick     # a smoke test: 1 seed, 2 conditions, 2 iterations
    python benchmarks/findings.py --from-runs # the table and figures again, from the runs under --out

The full grid (7 conditions x 3 seeds x 20 iterations) takes about 40 minutes on the 2-core dev machine.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learning_seeds import ROOT, eval_success, fit_seed  # noqa: E402

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


def alarm_steps(metrics: Path) -> list[int]:
    """Iterations at which the Echo Trap alarm (its current defaults) fires on a run's logged metrics."""
    from ragen_pl.callbacks import EchoTrapAlarm

    alarm, fired = EchoTrapAlarm(), []
    with open(metrics) as f:
        for row in csv.DictReader(f):
            if not row.get("loss/policy"):
                continue
            alarm.observe({k: float(v) for k, v in row.items() if v not in ("", None)})
            if alarm.firing:
                fired.append(int(row["step"]))
                alarm.fired_tags.add(alarm.last_tag or "")
    return fired


def fmt_range(values: list[float]) -> str:
    return f"{min(values):.2f}" if min(values) == max(values) else f"{min(values):.2f}-{max(values):.2f}"


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--val-episodes", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/findings"))
    parser.add_argument("--quick", action="store_true", help="1 seed, PPO and GRPO, 2 iterations (a smoke test)")
    parser.add_argument("--from-runs", action="store_true",
                        help="train nothing: rebuild the table and figures from the runs already under --out")
    args = parser.parse_args(argv)
    conditions = dict(CONDITIONS)
    extra: list[str] = []
    if args.quick:
        args.seeds, args.steps, args.val_episodes = args.seeds[:1], 2, 4
        conditions = {k: conditions[k] for k in (BASE, "GRPO")}
        extra = ["--data.n_groups=4", "--data.group_size=4"]
    start = time.perf_counter()
    results: dict[str, dict] = {}
    for name, (flags, claim) in conditions.items():
        runs = []
        for seed in args.seeds:
            folder = args.out / f"{name.replace(' ', '_').replace('(', '').replace(')', '')}_seed{seed}"
            t0 = time.perf_counter()
            if args.from_runs:
                metrics = max(folder.glob("*/version_*/metrics.csv"), key=lambda m: m.stat().st_mtime)
            else:
                metrics = fit_seed(seed, args.steps, args.val_episodes, [*flags, *extra], folder)
            runs.append({"folder": folder, "success": eval_success(metrics), "alarms": alarm_steps(metrics)})
            print(f"[{time.perf_counter() - start:6.0f}s] {name}, seed {seed}: "
                  + ", ".join(f"{env} {a:.2f} -> {b:.2f}" for env, (a, b) in runs[-1]["success"].items())
                  + (f"; Echo Trap alarm at {runs[-1]['alarms']}" if runs[-1]["alarms"] else "")
                  + f" ({time.perf_counter() - t0:.0f}s)", flush=True)
        results[name] = {"runs": runs, "claim": claim}

    envs = sorted({env for r in results.values() for run in r["runs"] for env in run["success"]})
    print(f"\nfindings: {len(args.seeds)} seeds x {args.steps} iterations, evaluation success after the last one "
          f"(range over seeds), Echo Trap alarms:\n")
    header = "| condition | " + " | ".join(envs) + " | Echo Trap alarm (collapse) | the paper |"
    print(header)
    print("|" + " --- |" * (len(envs) + 3))
    for name, r in results.items():
        cells = [fmt_range([run["success"][env][1] for run in r["runs"] if env in run["success"]]) for env in envs]
        fired = [run["alarms"][0] for run in r["runs"] if run["alarms"]]
        alarm = f"{len(fired)} of {len(r['runs'])} seeds, at {fired}" if fired else f"none in {len(r['runs'])} seeds"
        print(f"| {name} | " + " | ".join(cells) + f" | {alarm} | {r['claim']} |")

    from ragen_pl.report import report

    for comparison, names in COMPARISONS.items():
        folders = [run["folder"] for n in names if n in results for run in results[n]["runs"]]
        if len({n for n in names if n in results}) > 1:
            report(folders, args.out / "report" / comparison)
    print(f"\nfigures per comparison under {args.out / 'report'}; total {time.perf_counter() - start:.0f}s")
    return results


if __name__ == "__main__":
    main()
