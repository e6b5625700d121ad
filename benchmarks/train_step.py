"""Per-iteration time of StarPO training on the tiny model, split into rollout, filtering, update and logging; and
the update's tokens/s beside a plain transformers loop on the same rows.

1. A few iterations through the real Trainer (the same code path as ``ragen-pl fit``), printing per phase the median
   seconds and share of the iteration. "Model" time is the engine's generation plus scoring (old log-probs and
   values, forward only) plus the update (forward, backward, optimiser). Target: everything else (env steps,
   tokenisation, filtering, advantage math, logging, Lightning) stays under 15% of the iteration.
2. ``--compare``: one rollout of 32 (``--trajectories``) SmolLM2 FrozenLake trajectories
   (SmolLM2's FrozenLake warm start, in the layout it was taught), then one update over it two ways, side by side,
   in fp32 and in bf16 autocast (``--precisions``): ragen-pl's
   ``StarPOUpdate`` (LM head on scored positions only, length-grouped micro-batches; the shared prompt prefix once,
   the default, or the rows packed without padding, ``--model.ppo.pack``) and a plain loop (micro-batches in order, full logits, float32 log-softmax over
   every position, the same PPO surrogate and AdamW step; each micro-batch cut to its own longest row, as a collator
   pads). Goal: >= 1.5x the plain loop's tokens/s. Then the peak
   memory of log-probs and entropy (forward and backward) over 4,096 scored tokens of SmolLM2's 49,152-token
   vocabulary, computed the plain way (float32 copies kept for backward) and by ``ragen_pl.scoring.token_stats``
   (a float32 chunk at a time), each in its own process.

    python benchmarks/train_step.py [--iterations 6] [--threads 2] [--compare] [--compare-only]
                                    [--trajectories 32] [--precisions fp32 bf16] [--repeats 2]

(The experiments' head-only update is timed by ``python -m ragen_pl_experiments.research.head_only_step``.)
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
    parser.add_argument("--compare", action="store_true", help="also time the update against a plain loop")
    parser.add_argument("--compare-only", action="store_true")
    parser.add_argument("--trajectories", type=int, default=32, help="--compare: SmolLM2 FrozenLake trajectories")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"],
                        help="--compare: float32, and bf16 autocast (several times slower on a CPU without bf16)")
    parser.add_argument("--repeats", type=int, default=2, help="--compare: timed updates per variant (the best)")
    args = parser.parse_args()
    if args.trajectories < 4:
        parser.error(f"--trajectories must be at least 4, one group of 4 (got {args.trajectories})")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (got {args.repeats})")
    torch.set_num_threads(args.threads)
    if not args.compare_only:
        phases(args)
    if args.compare or args.compare_only:
        compare_update(args.trajectories, args.precisions, args.repeats)
        compare_memory()


def phases(args) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from ragen_pl.config import PPOConfig
    from ragen_pl.data import RolloutDataModule
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.filters import VarianceTopP
    from ragen_pl.models.tiny import build_tiny_model, warm_start_rollout
    from ragen_pl.module import RagenModule

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



def smollm2_rollout(n: int = 32):
    """``n`` SmolLM2 FrozenLake trajectories (groups of 4), one action per turn, window of one turn: the layout of
    SmolLM2's FrozenLake warm start, sampled by it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.config import RolloutConfig
    from ragen_pl.envs.frozen_lake import FrozenLake
    from ragen_pl.models.smollm2 import SMOLLM2_WARM, build_smollm2_warm
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine

    recipe = SMOLLM2_WARM["frozenlake"]
    path = build_smollm2_warm("frozenlake", progress=False)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    groups = max(1, n // 4)
    env = FrozenLake(**recipe.env_args)
    specs = [EpisodeSpec(env, seed=g, group_id=g) for g in range(groups) for _ in range(n // groups)]
    batch = Collector(engine, tok, RolloutConfig(**recipe.rollout)).collect(specs).batch
    return model, batch


def plain_update(model, batch, opt, micro: int) -> None:
    """What a straightforward transformers loop does: micro-batches in order, each padded to its own longest row (as
    a collator pads each batch), full logits, float32 log-softmax over every position."""
    n = len(batch)
    count = batch.loss_mask[:, 1:].sum()
    opt.zero_grad(set_to_none=True)
    for start in range(0, n, micro):
        rows = slice(start, start + micro)
        T = int(batch.attention_mask[rows].sum(-1).max())  # this micro-batch's longest row
        ids, attn, mask = batch.input_ids[rows, :T], batch.attention_mask[rows, :T], batch.loss_mask[rows, 1:T]
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        adv = batch.advantages[rows, 1:T]
        loss = torch.where(mask, -adv * ratio, 0.0).sum() / count
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def compare_update(trajectories: int = 32, precisions=("fp32", "bf16"), repeats: int = 2) -> None:
    import copy

    from ragen_pl.advantages import GRPO
    from ragen_pl.config import PPOConfig
    from ragen_pl.policy import Models
    from ragen_pl.update import StarPOUpdate

    model, batch = smollm2_rollout(trajectories)
    model.train()
    updates = {name: StarPOUpdate(GRPO(), PPOConfig(mini_batch_size=len(batch), micro_batch_size=8, entropy_coeff=0.0,
                                                    share_prefix=name == "shared", pack=name == "packed"))
               for name in ("shared", "packed")}
    updates["shared"].prepare(batch, Models(model))
    tokens = float(batch.attention_mask.sum())
    print(f"\nthe update, {trajectories} SmolLM2 FrozenLake trajectories in {len(batch)} rows ({tokens:.0f} tokens, "
          f"{int(batch.loss_mask.sum())} sampled), one optimiser step, micro-batches of 8; ragen-pl with the shared "
          f"prompt prefix (default) and with packed rows (--model.ppo.pack):")
    print(f"{'precision':<15}{'plain loop tok/s':>18}{'shared tok/s':>14}{'packed tok/s':>14}{'shared/plain':>14}"
          f"{'packed/plain':>14}")
    for precision in precisions:
        rates = {}
        for name in ("plain", "shared", "packed"):
            m = copy.deepcopy(model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
            best = float("inf")
            for _ in range(repeats):
                b = copy.deepcopy(batch)
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    if name == "plain":
                        plain_update(m, b, opt, 8)
                    else:
                        updates[name].step(b, Models(m), [opt])
                best = min(best, time.perf_counter() - start)
            rates[name] = tokens / best
        print(f"{'bf16 autocast' if precision == 'bf16' else precision:<15}{rates['plain']:>18.0f}{rates['shared']:>14.0f}{rates['packed']:>14.0f}"
              f"{rates['shared'] / rates['plain']:>13.2f}x{rates['packed'] / rates['plain']:>13.2f}x", flush=True)


MEMORY = """
import sys, torch


def peak_gib():  # this process's peak resident memory: VmHWM, reset below (a forked child inherits its parent's)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    return int(line.split()[1]) / 2**20


torch.set_num_threads(1)
logits = torch.randn(4096, 49152).bfloat16().requires_grad_(True)
labels = torch.randint(0, 49152, (4096,))
open("/proc/self/clear_refs", "w").write("5")
base = peak_gib()
if sys.argv[1] == "plain":
    z = logits.float()
    lp = z.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
    p = torch.softmax(z, -1)
    ent = torch.logsumexp(z, -1) - (p * z).sum(-1)
    del z, p
else:
    from ragen_pl.scoring import token_stats
    lp, ent = token_stats(logits, labels, entropy=True)
(lp.sum() + ent.sum()).backward()
print(peak_gib() - base)
"""


def compare_memory() -> None:
    import subprocess
    import sys

    peaks = {m: float(subprocess.run([sys.executable, "-c", MEMORY, m], capture_output=True, text=True,
                                     check=True).stdout.split()[-1]) for m in ("plain", "chunked")}
    print(f"\nlog-probs and entropy of 4,096 scored tokens (vocabulary 49,152, bf16 logits of 0.38 GiB), forward and "
          f"backward, peak memory beyond the logits: plain {peaks['plain']:.2f} GiB, token_stats "
          f"{peaks['chunked']:.2f} GiB")


if __name__ == "__main__":
    main()
