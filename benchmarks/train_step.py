"""Per-iteration time of StarPO training on the tiny model, split into rollout, filtering, update and logging; and
the update's tokens/s beside a plain transformers loop on the same rows.

1. A few iterations through the real Trainer (the same code path as ``ragen-pl fit``), printing per phase the median
   seconds and share of the iteration. "Model" time is the engine's generation plus scoring (old log-probs and
   values, forward only) plus the update (forward, backward, optimiser). Target: everything else (env steps,
   tokenisation, filtering, advantage math, logging, Lightning) stays under 15% of the iteration.
2. ``--compare``: one rollout of 32 (``--trajectories``) SmolLM2 FrozenLake trajectories
   (``configs/smollm2-frozenlake.yaml``'s warm start and settings), then one update over it two ways, side by side,
   in fp32 and in bf16 autocast (``--precisions``): ragen-pl's
   ``StarPOUpdate`` (LM head on scored positions only, length-grouped micro-batches; the shared prompt prefix once,
   the default, or the rows packed without padding, ``--model.ppo.pack``) and a plain loop (micro-batches in order padded to the batch's longest row, full logits, float32 log-softmax over
   every position, the same PPO surrogate and AdamW step). Goal: >= 1.5x the plain loop's tokens/s. Then the peak
   memory of log-probs and entropy (forward and backward) over 4,096 scored tokens of SmolLM2's 49,152-token
   vocabulary, computed the plain way (float32 copies kept for backward) and by ``ragen_pl.scoring.token_stats``
   (a float32 chunk at a time), each in its own process.
3. ``--head-only``: the issue-20 Sokoban recipe, where only a LoRA readout on the LM head trains
   (``configs/smollm2-sokoban.yaml`` with ``--model.lora.target_modules=[lm_head]``, the whitened centred head on the
   four action tokens): one rollout of ``--trajectories`` trajectories, then scoring and update (the config's
   mini-batches of 256 rows, micro-batches of 16) in bf16 autocast two ways side by side: each micro-batch through
   the whole model, and through the head alone on what it read when the rollout was scored (the update's default
   for a frozen trunk, ``StarPOUpdate.reuses_head_inputs``); and how far apart the two trained policies' log-probs
   of the sampled tokens are, beside how far the update moved them.

    python benchmarks/train_step.py [--iterations 6] [--threads 2] [--compare] [--compare-only] [--head-only]
                                    [--trajectories 32] [--precisions fp32 bf16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--compare", action="store_true", help="also time the update against a plain loop")
    parser.add_argument("--compare-only", action="store_true")
    parser.add_argument("--head-only", action="store_true", help="only time a head-only update reusing the trunk's "
                        "output against one running the whole model (SmolLM2 Sokoban)")
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
    if args.head_only:
        compare_head_only(args.trajectories, args.repeats)
        return
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



def smollm2_rollout(n: int = 32, env: str = "frozenlake", lora=None):
    """``n`` SmolLM2 trajectories (groups of 4) of ``env`` sampled with its config's warm start and settings; the
    model with ``lora`` adapters (``LoraSettings``) if given."""
    import importlib

    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.config import RolloutConfig
    from ragen_pl.lora import add_lora
    from ragen_pl.models.smollm2 import build_smollm2_warm
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine

    cfg = yaml.safe_load((ROOT / "configs" / f"smollm2-{env}.yaml").read_text())
    path = build_smollm2_warm(env, progress=False)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    if lora is not None:
        model = add_lora(model, lora, tok)
    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    groups = max(1, n // 4)
    module, name = cfg["data"]["env"]["class_path"].rsplit(".", 1)
    env_obj = getattr(importlib.import_module(module), name)(**(cfg["data"]["env"].get("init_args") or {}))
    specs = [EpisodeSpec(env_obj, seed=g, group_id=g) for g in range(groups) for _ in range(n // groups)]
    batch = Collector(engine, tok, RolloutConfig(**cfg["data"]["rollout"])).collect(specs).batch
    return model, batch, cfg


def plain_update(model, batch, opt, micro: int) -> None:
    """What a straightforward transformers loop does: full logits, float32 log-softmax everywhere, padded rows."""
    n = len(batch)
    mask = batch.loss_mask[:, 1:]
    count = mask.sum()
    opt.zero_grad(set_to_none=True)
    for start in range(0, n, micro):
        rows = slice(start, start + micro)
        logits = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows]).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[rows, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        adv = batch.advantages[rows, 1:]
        loss = torch.where(mask[rows], -adv * ratio, 0.0).sum() / count
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def compare_update(trajectories: int = 32, precisions=("fp32", "bf16"), repeats: int = 2) -> None:
    import copy

    from ragen_pl.advantages import GRPO
    from ragen_pl.config import PPOConfig
    from ragen_pl.policy import Models
    from ragen_pl.update import StarPOUpdate

    model, batch, _ = smollm2_rollout(trajectories)
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


def compare_head_only(trajectories: int = 32, repeats: int = 2) -> None:
    import copy

    from ragen_pl.advantages import GRPO
    from ragen_pl.config import LoraSettings, PPOConfig
    from ragen_pl.policy import Models
    from ragen_pl.scoring import score
    from ragen_pl.update import StarPOUpdate

    lora = LoraSettings(target_modules=["lm_head"], last_layers=None, center_head=4, whiten_head=True,
                        head_tokens=["Up", "Down", "Left", "Right"])
    model, batch, cfg = smollm2_rollout(trajectories, "sokoban", lora)
    model.train()
    ppo = {k: v for k, v in cfg["model"]["ppo"].items()}
    scored = int(batch.loss_mask.sum())
    print(f"\nhead-only update (LoRA readout on the LM head), {trajectories} SmolLM2 Sokoban trajectories in "
          f"{len(batch)} rows ({float(batch.attention_mask.sum()):.0f} tokens, {scored} sampled), mini-batches of "
          f"{ppo['mini_batch_size']}, micro-batches of {ppo['micro_batch_size']}, bf16 autocast, best of {repeats}:")
    print(f"{'update':<34}{'scoring s':>10}{'update s':>10}{'total s':>9}")
    trained, totals = {}, {}
    for name in ("whole model each micro-batch", "head alone (reused trunk output)"):
        best = (float("inf"), float("inf"))
        for _ in range(repeats):
            m = copy.deepcopy(model)
            update = StarPOUpdate(GRPO(), PPOConfig(**ppo))
            if name.startswith("whole"):
                update.reuses_head_inputs = lambda models: False
            b = copy.deepcopy(batch)
            opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                t0 = time.perf_counter()
                update.prepare(b, Models(m, lora=True))
                t1 = time.perf_counter()
                update.step(b, Models(m, lora=True), [opt])
                t2 = time.perf_counter()
            if t2 - t0 < sum(best):
                best = (t1 - t0, t2 - t1)
        trained[name], totals[name] = m, sum(best)
        print(f"{name:<34}{best[0]:>10.1f}{best[1]:>10.1f}{sum(best):>9.1f}", flush=True)
    whole, head = totals.values()
    # The trained policies compared as functions (the centred head's directions, fixed in bf16 from slightly
    # different numbers, may turn within a near-degenerate spectrum, so raw weights are not comparable): the
    # log-probs of the rollout's sampled tokens, in float32, the head run on the trunk's output (the same for all).
    features = update._head_inputs[1].float()
    mask = batch.loss_mask
    slots = torch.arange(features.shape[1]) < mask[:, 1:].sum(-1, keepdim=True)
    with torch.no_grad():
        lp = {k: score(m, batch.input_ids, batch.attention_mask, mask, batch.temperature,
                       head_inputs=features[slots]).logprobs[mask] for k, m in {"before": model, **trained}.items()}
    a, b = (lp[k] for k in trained)
    print(f"scoring + update: {whole / head:.2f}x faster with the head alone. The sampled tokens' log-probs after the "
          f"update: mean |difference| between the two {float((a - b).abs().mean()):.4f} nats (max "
          f"{float((a - b).abs().max()):.3f}), against a mean change of {float((b - lp['before']).abs().mean()):.4f} "
          f"from before the update")


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
