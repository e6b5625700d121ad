"""Learning benchmark: wall time and iterations to Bandit success 0.9, and the success curves of the quickstart.

Runs ``configs/quickstart.yaml`` (or ``--config``) through the real CLI, then prints from its metrics.csv: the
first iteration whose training-rollout success reached the threshold for each env, the wall time until then, and a
table of evaluation success per env against iteration. The tiny model's one-time build is timed separately.

    python benchmarks/learning.py [--config configs/quickstart.yaml] [--steps 30] [--threshold 0.9]
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threshold", type=float, default=0.9)
    args = parser.parse_args()

    from ragen_pl.cli import main as cli
    from ragen_pl.models.tiny import build_warm_tiny_model

    start = time.perf_counter()
    build_warm_tiny_model()
    built = time.perf_counter() - start
    out = Path(tempfile.mkdtemp(prefix="ragen-pl-learning-"))
    start = time.perf_counter()
    code = cli(["fit", "--config", args.config, f"--trainer.max_steps={args.steps}",
                "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={out}",
                "--trainer.enable_checkpointing=false"])
    wall = time.perf_counter() - start
    if code:
        raise SystemExit(code)
    with open(next(out.glob("*/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    keys = sorted({k for r in rows for k in r if k.startswith("val/") and k.endswith("/success")})
    train = sorted({k for r in rows for k in r if k.startswith("rollout/") and k.endswith("/success")}) or \
        ["rollout/success"]
    times = {int(r["step"]): None for r in rows if r.get("step")}
    print(f"model build or cache lookup: {built:.1f}s; training {args.steps} iterations: {wall:.1f}s "
          f"({wall / args.steps:.2f}s per iteration)")
    for key in train:
        hit = next((int(r["step"]) for r in rows if r.get(key) and float(r[key]) >= args.threshold), None)
        label = key.replace("rollout/", "").replace("/success", "").replace("success", "all envs")
        if hit is None:
            print(f"{label}: training success never reached {args.threshold}")
        else:
            print(f"{label}: training success >= {args.threshold} at iteration {hit} "
                  f"(about {wall * (hit + 1) / args.steps:.0f}s of training)")
    print(f"\n{'iteration':>9}  " + "  ".join(f"{k.split('/')[1]:>14}" for k in keys))
    for step in sorted(times):
        vals = [next((r[k] for r in rows if r.get("step") == str(step) and r.get(k)), "") for k in keys]
        if any(vals):
            print(f"{step:>9}  " + "  ".join(f"{float(v):>14.3f}" if v else f"{'':>14}" for v in vals))


if __name__ == "__main__":
    main()
