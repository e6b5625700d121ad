"""Per-iteration time of StarPO training on the tiny model, split into rollout, filtering, update and logging.

Runs a few iterations through the real Trainer (the same code path as ``ragen-pl fit``) and prints, per phase, the
median seconds and share of the iteration. "Model" time is the engine's generation plus scoring (old log-probs and
values, forward only) plus the update (forward, backward, optimiser). Target: everything else (env steps,
tokenisation, filtering, advantage math, logging, Lightning) stays under 15% of the iteration.

    python benchmarks/train_step.py [--iterations 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from ragen_pl.data import RolloutDataModule
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.filters import VarianceTopP
    from ragen_pl.models.tiny import build_tiny_model, warm_start_rollout
    from ragen_pl.module import PPOConfig, RagenModule

    class Clock(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []
            self.start = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            m = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("time/")}
            m["iteration"] = time.perf_counter() - self.start
            self.rows.append(m)

    module = RagenModule(str(build_tiny_model()), ppo=PPOConfig(mini_batch_size=16, micro_batch_size=8))
    dm = RolloutDataModule(Sokoban(), n_groups=args.groups, group_size=args.group_size,
                           filter=VarianceTopP(top_p=0.5), rollout=warm_start_rollout())
    clock = Clock()
    from lightning.pytorch.loggers import CSVLogger

    trainer = pl.Trainer(max_steps=args.iterations + 1, limit_val_batches=0, num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         logger=CSVLogger("/tmp/ragen-pl-bench"), callbacks=[clock])
    trainer.fit(module, dm)
    rows = clock.rows[1:]  # the first iteration warms up allocators and caches
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]}
    total = med["iteration"]
    phases = {
        "rollout: generate": med.get("time/rollout_generate", 0.0),
        "rollout: env": med.get("time/rollout_env", 0.0),
        "rollout: tokenize": med.get("time/rollout_tokenize", 0.0),
        "filter": med.get("time/filter", 0.0),
        "score (old logprobs, values)": med.get("time/prepare", 0.0),
        "update (fwd, bwd, optim)": med.get("time/update", 0.0),
    }
    phases["logging + Lightning + rest"] = total - sum(phases.values())
    print(f"{args.groups} groups x {args.group_size} trajectories, {len(rows)} iterations timed, {args.threads} threads")
    print(f"{'phase':<32}{'median s':>10}{'share':>9}")
    for name, secs in phases.items():
        print(f"{name:<32}{secs:>10.3f}{100 * secs / total:>8.1f}%")
    print(f"{'iteration':<32}{total:>10.3f}")
    model = phases["rollout: generate"] + phases["score (old logprobs, values)"] + phases["update (fwd, bwd, optim)"]
    outside = 100 * (total - model) / total
    print(f"\noutside generation and forward/backward: {outside:.1f}% of the iteration (target < 15%)")


if __name__ == "__main__":
    main()
