"""Rollout wall time split into generation, env stepping and tokenisation, and the hf engine against bare generate.

Part 1 plays 128 Sokoban trajectories (8 groups x 16) with the tiny model and prints where the time went, with the
``hf`` engine's kept prefixes on and off, alternating: a turn's prompt extends the previous turn's, so with them on
only the env's message is prefilled. Both sample the same tokens (the engine's seed is the same).
Part 2 measures tokens/s of the ``hf`` engine and of a bare ``model.generate`` call on the same batch of prompts,
side by side, alternating, several repeats (the machine is shared and noisy: compare the medians), twice: on the
rollout's prompts cut to 200 tokens (a group's 16 share one, so the engine's prefill-once of identical prompts and of
their common prefix is part of its gain) and on one distinct prompt per trajectory with the engine's prefix sharing
off (``share_prefix=False``: the system message and the rules every prompt starts with are prefilled for each row, as
bare generate does, so the comparison is the prefill and decode loop alone; the printout says how many leading
tokens the prompts share). Both sample with
a KV cache and left padding; ``min_new_tokens`` makes both produce the same number of tokens. Target: the engine
reaches at least 90% of bare generate's tokens/s. With ``--vllm`` (and vLLM installed) the vLLM engine is timed too.

    python benchmarks/rollout.py [--trajectories 128] [--new-tokens 32] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.models.tiny import build_tiny_model, warm_start_rollout
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.engine import SamplingParams
    from ragen_pl.rollout.hf import HFEngine

    path = build_tiny_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    # Part 1: a full multi-turn rollout, kept prefixes on and off.
    config = warm_start_rollout()
    config.max_new_tokens = args.new_tokens
    groups = max(1, args.trajectories // 16)
    specs = [EpisodeSpec(Sokoban(), seed=g, group_id=g) for g in range(groups) for _ in range(16)]
    runs: dict[bool, list[tuple[float, dict, int, int]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for keep in (True, False):
            engine = HFEngine(seed=0, prefix_cache=keep)
            engine.bind(model, tok)
            start = time.perf_counter()
            result = Collector(engine, tok, config).collect(specs)
            wall = time.perf_counter() - start
            runs[keep].append((wall, result.timings, engine.prefilled_tokens, int(result.batch.loss_mask.sum())))
    for keep, label in ((True, "kept prefixes"), (False, "whole prompts")):
        wall, t, fed, sampled = sorted(runs[keep], key=lambda r: r[0])[len(runs[keep]) // 2]  # the median run
        print(f"rollout, {label}: {len(specs)} trajectories, {config.max_turns} turns max, {args.new_tokens} tokens "
              f"per turn max, {sampled} tokens sampled, {fed} prompt tokens prefilled ({fed / sampled:.1f} per "
              f"sampled), {wall:.2f}s (median of {args.repeats}; runs "
              f"{', '.join(f'{r[0]:.2f}' for r in runs[keep])})")
        for name, secs in [*t.items(), ("other", wall - sum(t.values()))]:
            print(f"  {name:<10}{secs:8.3f}s {100 * secs / wall:6.1f}%")
    kept_gen = statistics.median(r[1]["generate"] for r in runs[True])
    whole_gen = statistics.median(r[1]["generate"] for r in runs[False])
    print(f"generation time, kept / whole: {kept_gen / whole_gen:.2f}\n")
    engine = HFEngine(seed=0)
    engine.bind(model, tok)

    # Part 2: the hf engine against bare model.generate on the same prompts: the rollout's (16 per group share a
    # prompt, so the engine's prefill-once of identical prompts is part of its gain), then one prompt per seed.
    grouped = [list(ep.chat.ids)[:200] for ep in result.episodes][: args.trajectories]
    distinct_specs = [EpisodeSpec(Sokoban(), seed=10_000 + i, group_id=i) for i in range(len(grouped))]
    distinct = [list(ep.chat.ids)[:200] for ep in Collector(engine, tok, config).collect(distinct_specs).episodes]
    unshared = HFEngine(seed=0, share_prefix=False)  # every row prefilled whole, as bare generate does
    unshared.bind(model, tok)
    ratios = {}
    for label, prompts, eng in (
            (f"{len({tuple(p) for p in grouped})} distinct of {len(grouped)}, prefix sharing on", grouped, engine),
            (f"{len({tuple(p) for p in distinct})} distinct of {len(distinct)}, prefix sharing off", distinct,
             unshared)):
        shared = common_prefix(prompts)
        print(f"\n{label}: the prompts share their first {shared} of {max(len(p) for p in prompts)} tokens")
        ratios[label] = compare(eng, model, tok, prompts, args)
    print("\nengine / model.generate: " + "; ".join(f"{r:.2f} ({label})" for label, r in ratios.items())
          + ". The second is the prefill and decode loop alone; the first adds the prefill of identical prompts and "
          "of their common prefix done once")
    if args.vllm:
        from ragen_pl.rollout.vllm import VLLMEngine

        v = VLLMEngine(dtype="float32")
        v.bind(model, tok)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop=[], ignore_eos=True)
        v.generate(distinct, params)
        s = time.perf_counter()
        gens = v.generate(distinct, params)
        rate = sum(len(g.token_ids) for g in gens) / (time.perf_counter() - s)
        print(f"  vllm engine      {rate:10.0f} tokens/s (distinct prompts)")


def common_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares."""
    n = 0
    for column in zip(*prompts):
        if len(set(column)) > 1:
            break
        n += 1
    return n


def compare(engine, model, tok, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Median tokens/s of the engine and of bare ``model.generate`` on ``prompts``, alternating; print both and
    return their ratio. Fixed lengths on both sides: the engine ignores eos, bare generate gets min_new_tokens."""
    from ragen_pl.rollout.engine import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop=[], ignore_eos=True)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1

    def run_engine() -> float:
        s = time.perf_counter()
        gens = engine.generate(prompts, params)
        return sum(len(g.token_ids) for g in gens) / (time.perf_counter() - s)

    def run_bare() -> float:
        s = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 pad_token_id=tok.pad_token_id)
        return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - s)

    engine_rates, bare_rates = [], []
    run_engine(), run_bare()  # warm up
    for _ in range(args.repeats):
        engine_rates.append(run_engine())
        bare_rates.append(run_bare())
    e, b = statistics.median(engine_rates), statistics.median(bare_rates)
    distinct = len({tuple(p) for p in prompts})
    print(f"\ngeneration, {len(prompts)} prompts ({distinct} distinct) x {args.new_tokens} new tokens, {args.threads} "
          f"threads, median of {args.repeats}:")
    print(f"  hf engine        {e:10.0f} tokens/s   runs: {', '.join(f'{x:.0f}' for x in engine_rates)}")
    print(f"  model.generate   {b:10.0f} tokens/s   runs: {', '.join(f'{x:.0f}' for x in bare_rates)}")
    print(f"  ratio            {e / b:10.2f}   (target >= 0.90)")
    return e / b


if __name__ == "__main__":
    main()
