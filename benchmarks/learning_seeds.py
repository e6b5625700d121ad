"""The quickstart's learning claim over several seeds, each with its own warm start rebuilt from scratch.

Float results differ between CPUs (a warm start or a sampled token can change), so a learning test must hold for
any of them. Each seed builds the tiny model and its warm start with that seed (another tokenizer, other weights,
other demonstrations), then trains the quickstart with ``seed_everything`` = that seed, and prints the evaluation
success per env at step 0 and at the end. ``tests/test_quickstart.py`` takes its margins from this table.

    python benchmarks/learning_seeds.py [--seeds 0 1 2 3 4] [--steps 20] [--val-episodes 64]
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(seed: int, steps: int, val_episodes: int) -> dict[str, tuple[float, float]]:
    from ragen_pl.cli import main as cli
    from ragen_pl.tiny import TinyConfig, build_warm_tiny_model

    model = build_warm_tiny_model(TinyConfig(seed=seed))
    out = Path(tempfile.mkdtemp(prefix=f"ragen-pl-seed{seed}-"))
    code = cli(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), f"--model.model={model}",
                f"--seed_everything={seed}", f"--data.seed={1000 * seed}", f"--trainer.max_steps={steps}",
                f"--trainer.val_check_interval={steps}", f"--data.val_episodes={val_episodes}",
                "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={out}",
                "--trainer.enable_checkpointing=false"])
    if code:
        raise SystemExit(code)
    with open(next(out.glob("*/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    result = {}
    for key in sorted({k for r in rows for k in r if k.startswith("val/") and k.endswith("/success")}):
        curve = [float(r[key]) for r in rows if r.get(key)]
        result[key.split("/")[1]] = (curve[0], curve[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--val-episodes", type=int, default=64)
    args = parser.parse_args()
    table = {}
    for seed in args.seeds:
        start = time.perf_counter()
        table[seed] = run(seed, args.steps, args.val_episodes)
        cells = "  ".join(f"{env} {a:.3f} -> {b:.3f}" for env, (a, b) in table[seed].items())
        print(f"seed {seed}: {cells}  ({time.perf_counter() - start:.0f}s with the warm start)", flush=True)
    for env in next(iter(table.values())):
        starts = [table[s][env][0] for s in table]
        ends = [table[s][env][1] for s in table]
        gains = [table[s][env][1] - table[s][env][0] for s in table]
        print(f"{env}: step 0 {min(starts):.3f}-{max(starts):.3f}; step {args.steps} {min(ends):.3f}-{max(ends):.3f}; "
              f"gain {min(gains):+.3f} to {max(gains):+.3f} over {len(table)} seeds")


if __name__ == "__main__":
    main()
