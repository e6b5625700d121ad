"""The quickstart's learning claim over several seeds, each with its own warm start rebuilt from scratch.

Float results differ between CPUs (a warm start or a sampled token can change), so a learning test must hold for
any of them. Each seed builds the tiny model and its warm start with that seed (another tokenizer, other weights,
other demonstrations), then trains the quickstart with ``seed_everything`` = that seed, and prints the evaluation
success per env at step 0 and at the end, and how far the training success rose (the first iteration to the mean of
the last 3). ``tests/test_quickstart.py`` takes its margins from this table.

    python benchmarks/learning_seeds.py [--seeds 0 1 2 3 4] [--steps 20] [--val-episodes 64]
        [--config configs/variants/grpo.yaml] [--keep DIR] [ragen-pl fit flags, e.g. --model.ppo.entropy_coeff=0.001]

``--beside "FLAGS"`` also trains every seed with FLAGS added and prints both, e.g. ``--beside "--config
configs/variants/async.yaml --torch_threads=1"`` (rollouts one update ahead, the trainer and the rollout process on one
core each) beside the synchronous quickstart, then per env the difference at the end paired by seed (FLAGS less the
base): its mean, its standard error over seeds and their ratio t (|t| below 2: within the seeds' noise).

``--config`` adds a config on top of the quickstart (e.g. the GRPO variant); ``--keep DIR`` copies each run's
metrics.csv to ``DIR/seed<k>.csv`` (the Echo Trap alarm's recorded traces come from such runs), and
``--from-kept DIR`` prints the table of such runs again without training (with ``--beside``, whose runs are kept in
``DIR/beside/``, both tables and their paired difference).
"""

from __future__ import annotations

import argparse
import csv
import math
import shlex
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fit_seed(seed: int, steps: int, val_episodes: int, extra: list[str], save_dir: Path) -> Path:
    """Train the quickstart (plus ``extra`` flags) from the warm start of ``seed``; return its metrics.csv."""
    from ragen_pl.cli import main as cli
    from ragen_pl.models.tiny import TinyConfig, build_warm_tiny_model

    model = build_warm_tiny_model(TinyConfig(seed=seed))
    code = cli(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), *extra, f"--model.model={model}",
                f"--seed_everything={seed}", f"--data.seed={1000 * seed}", f"--trainer.max_steps={steps}",
                f"--trainer.val_check_interval={steps}", f"--data.val_episodes={val_episodes}",
                "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={save_dir}",
                "--trainer.enable_checkpointing=false"])
    if code:
        raise SystemExit(code)
    return next(save_dir.glob("*/version_*/metrics.csv"))


def eval_success(metrics: Path) -> dict[str, tuple[float, float, float]]:
    """env tag -> (evaluation success at step 0, at the end, and the training success's rise: the mean of the last 3
    iterations less the first, NaN for an env that is evaluated but not trained; the training rollouts sample at
    temperature 1, the evaluation at the config's)."""
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    result = {}
    for key in sorted({k for r in rows for k in r if k.startswith("val/") and k.endswith("/success")}):
        env = key.split("/")[1]
        curve = [float(r[key]) for r in rows if r.get(key)]
        train = [float(r[f"rollout/{env}/success"]) for r in rows if r.get(f"rollout/{env}/success")]
        rise = sum(train[-3:]) / len(train[-3:]) - train[0] if train else math.nan
        result[env] = (curve[0], curve[-1], rise)
    return result


def run(seed: int, steps: int, val_episodes: int, extra: list[str], keep: Path | None
        ) -> dict[str, tuple[float, float, float]]:
    metrics = fit_seed(seed, steps, val_episodes, extra, Path(tempfile.mkdtemp(prefix=f"ragen-pl-seed{seed}-")))
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(metrics, keep / f"seed{seed}.csv")
    return eval_success(metrics)


def paired_difference(base: dict[int, dict], other: dict[int, dict], env: str) -> tuple[float, float, int]:
    """(mean, standard error, seeds) of the final evaluation success of ``other`` less ``base``, paired by seed (the
    seeds both tables hold); the standard error is NaN with fewer than 2 seeds."""
    diffs = [other[s][env][1] - base[s][env][1] for s in base if s in other and env in base[s] and env in other[s]]
    n = len(diffs)
    mean = statistics.mean(diffs) if n else math.nan
    return mean, statistics.stdev(diffs) / math.sqrt(n) if n >= 2 else math.nan, n


def runs_folder(root: Path, beside: bool) -> Path:
    """Where ``--keep`` / ``--from-kept`` ``root`` holds the base layout's runs, or the ``--beside`` layout's."""
    return root / "beside" if beside else root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--val-episodes", type=int, default=64)
    parser.add_argument("--config", action="append", default=[], help="extra config on top of the quickstart")
    parser.add_argument("--keep", type=Path, default=None, help="copy each run's metrics.csv here")
    parser.add_argument("--beside", default=None, metavar="FLAGS",
                        help="also train every seed with these fit flags added, and print both")
    parser.add_argument("--from-kept", type=Path, default=None, metavar="DIR",
                        help="print the table of the runs --keep DIR kept (seeds --seeds) instead of training")
    args, flags = parser.parse_known_args()  # anything else goes to `ragen-pl fit`, after the configs
    extra = [*(a for c in args.config for a in ("--config", c)), *flags]
    layouts = {"": extra}
    if args.beside is not None:
        layouts[args.beside] = [*extra, *shlex.split(args.beside)]
    tables: dict[str, dict] = {name: {} for name in layouts}
    for seed in args.seeds:
        for name, flags_of in layouts.items():
            table, start = tables[name], time.perf_counter()
            if args.from_kept is None:
                keep = runs_folder(args.keep, bool(name)) if args.keep is not None else None
                table[seed] = run(seed, args.steps, args.val_episodes, flags_of, keep)
            elif (kept := runs_folder(args.from_kept, bool(name)) / f"seed{seed}.csv").exists():
                table[seed] = eval_success(kept)
            else:
                raise SystemExit(f"error: --from-kept {args.from_kept}: no {kept.relative_to(args.from_kept)} there "
                                 f"(give the --seeds it kept{', and --beside only if it ran with it' if name else ''})")
            cells = "  ".join(f"{env} {a:.3f} -> {b:.3f} (training {t:+.3f})" for env, (a, b, t) in table[seed].items())
            took = f"  ({time.perf_counter() - start:.0f}s with the warm start)" if args.from_kept is None else ""
            print(f"seed {seed}{f' [{name}]' if name else ''}: {cells}{took}", flush=True)
    for name, table in tables.items():
        if name:
            print(f"with {name}:")
        for env in next(iter(table.values())):
            starts = [table[s][env][0] for s in table]
            ends = [table[s][env][1] for s in table]
            gains = [table[s][env][1] - table[s][env][0] for s in table]
            rises = [table[s][env][2] for s in table]
            print(f"{env}: step 0 {min(starts):.3f}-{max(starts):.3f}; step {args.steps} {min(ends):.3f}-{max(ends):.3f}; "
                  f"mean {sum(ends) / len(ends):.3f}; gain {min(gains):+.3f} to {max(gains):+.3f}; training success "
                  f"(first iteration to the mean of the last 3) {min(rises):+.3f} to {max(rises):+.3f} over {len(table)} "
                  f"seeds")
    if args.beside is not None:
        base, other = tables[""], tables[args.beside]
        print(f"{args.beside} less the base, at step {args.steps}, paired by seed:")
        for env in next(iter(base.values())):
            mean, se, n = paired_difference(base, other, env)
            t = f"{mean / se:+.2f}" if se > 0 else "undefined (no spread)"
            print(f"{env}: mean {mean:+.3f}, standard error {se:.3f}, t {t} over {n} seeds")


if __name__ == "__main__":
    main()
