"""The head-only update's speed: the issue-20 Sokoban recipe, where only a LoRA readout on the LM head trains
(``experiments/configs/smollm2-sokoban.yaml``: the whitened centred head on the four action tokens). One rollout of
``--trajectories`` trajectories, then scoring and update (the config's mini-batches and micro-batches) in bf16
autocast two ways side by side: each micro-batch through the whole model, and through the head alone on what it read
when the rollout was scored (ReadoutUpdate's default for a frozen trunk); and how far apart the two trained policies'
log-probs of the sampled tokens are, beside how far the update moved them.

    python -m ragen_pl_experiments.research.head_only_step [--trajectories 32] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from ragen_pl_experiments.update import ReadoutUpdate


def readout_rollout(n: int):
    """``n`` SmolLM2 Sokoban trajectories (groups of 4) sampled with the config's warm start, settings and readout
    head (its adapters are 0: the warm start's own policy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl import registry
    from ragen_pl.config import LoraSettings, RolloutConfig
    from ragen_pl.lora import add_lora
    from ragen_pl.models import resolve_model
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine
    from ragen_pl_experiments.readout import ReadoutHead
    from ragen_pl_experiments.research.common import load_config, make_env, readout

    cfg = load_config("sokoban")
    path = resolve_model(cfg["model"]["model"])
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    model = ReadoutHead(**readout(cfg)).after_load(add_lora(model, LoraSettings(**cfg["model"]["lora"])), tok)
    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    groups = max(1, n // 4)
    registry.load_plugins()
    env = make_env(cfg["data"]["env"])
    specs = [EpisodeSpec(env, seed=g, group_id=g) for g in range(groups) for _ in range(n // groups)]
    batch = Collector(engine, tok, RolloutConfig(**cfg["data"]["rollout"])).collect(specs).batch
    return model, batch, cfg


def main(trajectories: int = 32, repeats: int = 2) -> None:

    from ragen_pl.advantages import GRPO
    from ragen_pl.config import PPOConfig
    from ragen_pl.policy import Models
    from ragen_pl.scoring import score

    model, batch, cfg = readout_rollout(trajectories)
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
            update = ReadoutUpdate(GRPO(), PPOConfig(**ppo), reuse_head_inputs=name.startswith("head"))
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
    # log-probs of the rollout's sampled tokens, in float32.
    mask = batch.loss_mask
    with torch.no_grad():
        lp = {k: score(m.eval(), batch.input_ids, batch.attention_mask, mask, batch.temperature).logprobs[mask]
              for k, m in {"before": model, **trained}.items()}
    a, b = (lp[k] for k in trained)
    print(f"scoring + update: {whole / head:.2f}x faster with the head alone. The sampled tokens' log-probs after the "
          f"update: mean |difference| between the two {float((a - b).abs().mean()):.4f} nats (max "
          f"{float((a - b).abs().max()):.3f}), against a mean change of {float((b - lp['before']).abs().mean()):.4f} "
          f"from before the update")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.trajectories < 4 or args.repeats < 1:
        parser.error(f"--trajectories must be >= 4 and --repeats >= 1, got {args.trajectories}, {args.repeats}")
    torch.set_num_threads(args.threads)
    main(args.trajectories, args.repeats)
