"""Turn-level credit on 2 CPU cores: GiGPO against GRPO and PPO with bi-level GAE, over seeds (issue 58).

The setting is the quickstart's FrozenLake alone (4x4, not slippery, corner start and goal: up to 4 turns of up to
3 actions, reward 1 at the goal only), where a turn's credit matters: turns of a group pass through the same cells.
Every recipe keeps the quickstart's settings (warm-started tiny model, learning rates, StarPO-S filter, 16 groups x
8) and changes only the advantage, with its published defaults and nothing tuned here:

* ``gigpo``: configs/variants/gigpo.yaml (verl-agent's step_advantage_w 1, mean_norm, gamma 0.95);
* ``grpo``: configs/variants/grpo.yaml;
* ``ppo_bilevel_gae``: PPO with a critic and bi-level GAE over the model's turns (gamma_turn 0.95, lambda 1).

Each seed rebuilds the tiny model and its warm start with that seed (as benchmarks/learning_seeds.py does) and trains
every recipe from it, one process per run on one core each, ``--jobs`` at a time. It prints the evaluation success
(128 fixed episodes, temperature 0.5) at every evaluation per run and the mean over seeds per recipe, draws
the mean curves (``credit_success.png``) and every run side by side with ``ragen-pl report``.

    python -m benchmarks.credit [--seeds 0 1 2] [--steps 30] [--jobs 2] [--out runs/credit] [--replot]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ragen_pl.report import read_series

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ROOT / "configs" / "variants"
RECIPES = {
    "gigpo": ["--config", str(VARIANTS / "gigpo.yaml")],
    "grpo": ["--config", str(VARIANTS / "grpo.yaml")],
    "ppo_bilevel_gae": ["--model.advantage=ragen_pl.advantages.BiLevelGAE",
                        "--model.advantage.init_args.segments=turn_ids",
                        "--model.advantage.init_args.gamma_turn=0.95"],
}
FROZEN_LAKE_ONLY = """\
data:
  env:
    - class_path: ragen_pl.envs.frozen_lake.FrozenLake
      init_args: {slippery: false, layout: corners, tag: FrozenLakeNoSlip}
"""


def fit_args(recipe: str, seed: int, model: str, steps: int, val_episodes: int, out: Path) -> list[str]:
    overlay = out / "frozenlake_only.yaml"
    return [sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
            "--config", str(overlay), *RECIPES[recipe], f"--model.model={model}", f"--seed_everything={seed}",
            f"--data.seed={1000 * seed}", f"--trainer.max_steps={steps}", "--trainer.val_check_interval=10",
            f"--data.val_episodes={val_episodes}", "--torch_threads=1", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--trainer.logger.init_args.save_dir={out / recipe}",
            f"--trainer.logger.init_args.name=seed{seed}"]


def run(recipe: str, seed: int, model: str, steps: int, val_episodes: int, out: Path) -> Path:
    """Train one recipe from one seed's warm start in its own process; return its run folder."""
    log = out / recipe / f"seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(fit_args(recipe, seed, model, steps, val_episodes, out), stdout=f,
                              stderr=subprocess.STDOUT, env=env, cwd=out).returncode
    if code:
        raise SystemExit(f"error: {recipe} seed {seed} failed (exit {code}); see {log}")
    print(f"{recipe} seed {seed}: {time.perf_counter() - start:.0f}s", flush=True)
    return latest_run(out, recipe, seed)


def evaluation(run_dir: Path, tag: str = "FrozenLakeNoSlip") -> list[tuple[int, float]]:
    """(step, evaluation success) of every evaluation of a run."""
    return read_series(run_dir / "metrics.csv").get(f"val/{tag}/success", [])


def latest_run(out: Path, recipe: str, seed: int) -> Path:
    runs = sorted((out / recipe / f"seed{seed}").glob("version_*"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit(f"error: no run of {recipe} seed {seed} under {out} (train it first: drop --replot)")
    return runs[-1]


def plot_means(curves: dict[str, dict[int, list[tuple[int, float]]]], path: Path) -> None:
    """One line per seed (thin) and the mean over seeds (thick) per recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for colour, (recipe, by_seed) in zip(("C0", "C1", "C2", "C3"), curves.items()):
        for points in by_seed.values():
            ax.plot(*zip(*points), color=colour, alpha=0.25, linewidth=1)
        steps = sorted({s for points in by_seed.values() for s, _ in points})
        mean = [statistics.mean(dict(points)[s] for points in by_seed.values() if s in dict(points)) for s in steps]
        ax.plot(steps, mean, color=colour, linewidth=2.5, marker="o", label=f"{recipe} (mean of {len(by_seed)} seeds)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("evaluation success")
    ax.set_title("FrozenLake 4x4 (not slippery, corners), tiny model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--val-episodes", type=int, default=128)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one core each")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--out", type=Path, default=Path("runs/credit"))
    parser.add_argument("--replot", action="store_true", help="print and draw the runs already in --out")
    args = parser.parse_args()
    out = args.out.resolve()
    jobs = [(recipe, seed) for seed in args.seeds for recipe in args.recipes]
    if not args.replot:
        from ragen_pl.models.tiny import TinyConfig, build_warm_tiny_model

        out.mkdir(parents=True, exist_ok=True)
        (out / "frozenlake_only.yaml").write_text(FROZEN_LAKE_ONLY)
        models = {seed: str(build_warm_tiny_model(TinyConfig(seed=seed))) for seed in args.seeds}
        print(f"{len(jobs)} runs, {args.jobs} at a time, one core each; {args.steps} iterations of 16 groups x 8",
              flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            for future in [pool.submit(run, *job, models[job[1]], args.steps, args.val_episodes, out) for job in jobs]:
                future.result()
    runs = {job: latest_run(out, *job) for job in jobs}
    curves = {recipe: {seed: evaluation(runs[recipe, seed]) for seed in args.seeds} for recipe in args.recipes}
    print(f"\nFrozenLakeNoSlip evaluation success ({args.val_episodes} episodes, temperature 0.5) at each evaluation "
          f"(every 10 iterations, {args.steps} in all):")
    for recipe, by_seed in curves.items():
        cells = "  ".join(f"seed {s} " + " / ".join(f"{v:.3f}" for _, v in c) for s, c in by_seed.items())
        ends = [c[-1][1] for c in by_seed.values()]
        gains = [c[-1][1] - c[0][1] for c in by_seed.values()]
        steps = sorted({s for c in by_seed.values() for s, _ in c})
        means = " / ".join(f"{statistics.mean(dict(c)[s] for c in by_seed.values() if s in dict(c)):.3f}" for s in steps)
        print(f"{recipe:>16}: {cells}  | mean end {statistics.mean(ends):.3f}, mean gain "
              f"{statistics.mean(gains):+.3f}; mean at iterations {' / '.join(map(str, steps))}: {means}")
    plot_means(curves, out / "credit_success.png")
    subprocess.run([sys.executable, "-m", "ragen_pl.cli", "report", "--out", str(out / "report"),
                    *(str(runs[job]) for job in jobs)], check=True)
    print(f"curves: {out / 'credit_success.png'} (means), {out / 'report'} (every run, ragen-pl report)")


if __name__ == "__main__":
    main()
