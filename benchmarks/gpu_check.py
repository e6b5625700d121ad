"""The GPU path end to end, in one table: rollout tokens/s per engine, and training under each strategy.

Needs: a CUDA GPU, torch, lightning, transformers and ragen-pl (vLLM optional: timed when importable). No model hub:
the model has the Qwen2.5-0.5B shape with random weights, built locally with the tiny model's tokenizer.

1. Engines: ``--prompts`` prompts x ``--new-tokens`` sampled tokens (eos ignored, so every row has the same length)
   with the ``hf`` engine, a bare ``model.generate`` on the same left-padded batch, and vLLM where installed.
2. Training: ``ragen-pl fit`` on Sokoban (bf16 mixed precision, float32 master weights, PPO with a separate critic)
   for ``--steps`` iterations under one GPU without sharding, Lightning's FSDPStrategy (FSDP1) and
   ModelParallelStrategy (FSDP2), and once more on one GPU with the engine's kept prefixes off (every turn's prompt
   prefilled whole). Per strategy: the measured iteration time (median of ``time/iteration`` after the first), the
   generation time, rollout tokens/s, update tokens/s, the update's MFU and peak memory.
3. The paper's shape (``--paper``): 8 groups x 16 trajectories, up to 5 turns of up to 400 tokens (random weights
   rarely close an answer, so turns run to their limit: worst-case lengths), one GPU, bf16.

MFU counts hardware FLOPs: what the update computes, both terms on the positions computed. 6 x the trunk's parameters
(embeddings and LM head excluded) x the positions its forwards ran over (``throughput/update_positions``: padding
included, a shared prompt prefix once), plus 6 x the LM head's parameters x the positions the head computed logits at
(``throughput/update_head_positions``: every row at each column some row scores, padding included, more than the
scored tokens), plus the critic's trunk (no LM head) over the trunk's positions; divided by ``time/update`` (timed
between CUDA synchronizes) and the GPU's dense bf16 peak. Attention's quadratic FLOPs are not counted. The peak is
looked up by the device's exact name (``PEAKS``); any other GPU needs ``--peak-tflops``.

    python benchmarks/gpu_check.py [--steps 3] [--work /tmp/ragen-pl-gpu-check] [--shape qwen2.5-0.5b|tiny]

``--shape tiny`` runs the same plumbing with a tiny model on the CPU (a smoke test of this script). It writes models
and runs under ``--work`` only; it finishes in a few minutes on one H200.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1),
}
# Dense bf16 tensor-core peaks (FLOP/s, without sparsity) by the exact name torch.cuda.get_device_name() reports:
# a substring would give an H100 PCIe or NVL the SXM part's peak, and an "RTX A1000" the A100's. Any other device needs
# --peak-tflops.
PEAKS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12,
}


def peak_flops(name: str, peak_tflops: float | None) -> float | None:
    """The dense bf16 peak of device ``name``: ``--peak-tflops`` if given, else its exact entry in ``PEAKS`` (None
    for a device not listed)."""
    return peak_tflops * 1e12 if peak_tflops else PEAKS.get(name)


def parameter_counts(path: Path) -> dict[str, int]:
    """Trunk (decoder layers and final norm), LM head (vocab x hidden, counted once even when tied) parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())  # a tied head is one tensor, counted once here
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    trunk = total - embed - (0 if tied else head)
    return {"trunk": trunk, "head": head}


def update_flops(row: dict[str, str], counts: dict[str, int], critic: bool) -> float:
    """Hardware FLOPs of one update: trunk and head, each on the positions it computed (see the module docstring)."""
    positions = float(row["throughput/update_positions"])
    head_positions = float(row["throughput/update_head_positions"])
    return 6 * counts["trunk"] * positions * (2 if critic else 1) + 6 * counts["head"] * head_positions


def build_model(work: Path, shape: str) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from ragen_pl.models.tiny import build_tiny_model

    out = work / f"model-{shape}"
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(build_tiny_model())
    dims = dict(SHAPES[shape])
    dims.setdefault("vocab_size", len(tok))
    cfg = Qwen2Config(**dims, max_position_embeddings=32768, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)  # float32 master weights; training runs in bf16 mixed precision
    tok.save_pretrained(out)
    return out


def engine_rates(path: Path, device: str, n_prompts: int, new_tokens: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.rollout.engine import SamplingParams
    from ragen_pl.rollout.hf import HFEngine

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, len(tok) - 10, (int(n),), generator=g).tolist()
               for n in torch.randint(80, 160, (n_prompts,), generator=g)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop=[], ignore_eos=True)
    width = max(map(len, prompts))
    ids = torch.full((n_prompts, width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1
    ids, attn = ids.to(device), attn.to(device)
    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    eager = HFEngine(seed=0, cuda_graphs=False)
    eager.bind(model, tok)

    def timed(fn) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return tokens / (time.perf_counter() - start)

    def hf() -> int:
        return sum(len(x.token_ids) for x in engine.generate(prompts, params))

    def hf_eager() -> int:
        return sum(len(x.token_ids) for x in eager.generate(prompts, params))

    def bare() -> int:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=tok.pad_token_id)
        return (out.shape[1] - width) * n_prompts

    runs = {"hf engine": hf, "hf, eager loop": hf_eager, "model.generate": bare}
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm-up (allocator, kernels)
    for _ in range(2):
        for name, fn in runs.items():
            rates[name].append(timed(fn))
    result = {k: statistics.median(v) for k, v in rates.items()}
    if engine._graphs_failed:
        print("  (the hf engine fell back to its eager loop: CUDA-graph capture failed, see the warning)")
    try:
        import vllm  # noqa: F401
    except ImportError:
        result["vllm"] = float("nan")
    else:
        from ragen_pl.rollout.vllm import VLLMEngine

        del model
        torch.cuda.empty_cache()
        v = VLLMEngine(gpu_memory_utilization=0.4)
        v.bind(AutoModelForCausalLM.from_pretrained(path), tok)
        v.generate(prompts, params)
        result["vllm"] = timed(lambda: sum(len(x.token_ids) for x in v.generate(prompts, params)))
    return result


STRATEGY_ARGS = {
    "1 GPU": ["--trainer.precision=bf16-mixed"],
    "FSDP1": ["--config", str(ROOT / "configs" / "variants" / "fsdp.yaml")],
    "FSDP2": ["--config", str(ROOT / "configs" / "variants" / "fsdp2.yaml"), "--trainer.precision=bf16-mixed",
              "--trainer.strategy.init_args.data_parallel_size=1"],
    # The same as "1 GPU" with every turn's prompt prefilled whole: what the engine's kept prefixes save.
    "1 GPU, no kept prefix": ["--trainer.precision=bf16-mixed", "--data.engine=ragen_pl.rollout.hf.HFEngine",
                              "--data.engine.prefix_cache=false"],
}


def fit(path: Path, work: Path, name: str, steps: int, device: str, counts: dict[str, int], peak: float,
        extra: list[str] | None = None, label: str | None = None) -> dict[str, float]:
    save_dir = work / "runs" / (label or name).replace(" ", "_")
    args = [sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(ROOT / "configs" / "sokoban.yaml"),
            *STRATEGY_ARGS[name], f"--model.model={path}", f"--trainer.max_steps={steps}",
            "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
            f"--trainer.logger.init_args.save_dir={save_dir}", "--data.n_groups=4", "--data.group_size=8",
            "--data.rollout.max_turns=3", "--data.rollout.max_new_tokens=64", *(extra or [])]
    if device == "cpu":  # the smoke test: one CPU process, full precision
        args = [a for a in args if "precision" not in a]
        args += ["--trainer.accelerator=cpu", "--data.n_groups=2", "--data.group_size=2"]
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        print(f"--- {name} failed (exit {proc.returncode}):\n{tail}", flush=True)
        return {"wall": wall, "failed": 1.0}
    files = sorted(save_dir.glob("*/version_*/metrics.csv"))
    with open(files[-1]) as f:
        rows = [r for r in csv.DictReader(f) if r.get("time/update")]
    steady = rows[1:] or rows  # the first iteration includes CUDA warm-up

    def med(key: str) -> float:
        values = [float(r[key]) for r in steady if r.get(key)]
        return statistics.median(values) if values else float("nan")

    mfu = statistics.median([update_flops(r, counts, critic=True) / float(r["time/update"]) / peak for r in steady])
    return {"wall": wall, "iteration": med("time/iteration"), "generate": med("time/rollout_generate"),
            "rollout_tps": med("throughput/rollout_tokens_per_s"),
            "update_tps": med("throughput/update_tokens_per_s"), "mfu": mfu,
            "peak_gib": max((float(r["gpu/peak_memory_gib"]) for r in rows if r.get("gpu/peak_memory_gib")), default=0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", default=os.environ.get("GPU_CHECK_WORK", "/tmp/ragen-pl-gpu-check"))
    parser.add_argument("--shape", choices=list(SHAPES), default=os.environ.get("GPU_CHECK_SHAPE", "qwen2.5-0.5b"))
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGY_ARGS), choices=list(STRATEGY_ARGS))
    parser.add_argument("--paper", action="store_true", help="also one iteration at the paper's shape (see above)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, TFLOP/s")
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.shape != "tiny":
        raise SystemExit("error: no CUDA device; use --shape tiny for a CPU smoke test of this script")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = build_model(work, args.shape)
    counts = parameter_counts(path)
    n_params = counts["trunk"] + counts["head"]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = peak_flops(name, args.peak_tflops)
    if peak is None:
        if device == "cuda":
            raise SystemExit(f"error: no dense bf16 peak known for {name!r} (known: {', '.join(PEAKS)}): give it "
                             f"with --peak-tflops")
        peak = float("nan")  # the CPU smoke test prints no MFU
    import lightning
    import transformers

    print(f"device: {name}; torch {torch.__version__}, lightning {lightning.__version__}, transformers "
          f"{transformers.__version__}; model {args.shape} ({n_params / 1e6:.0f}M parameters, random weights)")
    n_prompts, new_tokens = (args.prompts, args.new_tokens) if device == "cuda" else (8, 8)
    rates = engine_rates(path, device, n_prompts, new_tokens)
    print(f"\nrollout engines, {n_prompts} prompts x {new_tokens} new tokens, {'bf16' if device == 'cuda' else 'fp32'}:")
    for k, v in rates.items():
        print(f"  {k:<16}{v:>10.0f} tokens/s" if v == v else f"  {k:<16}{'n/a':>10} (not installed)")
    print(f"  hf / generate   {rates['hf engine'] / rates['model.generate']:>10.2f}", flush=True)
    strategies = args.strategies if device == "cuda" else ["1 GPU", "1 GPU, no kept prefix"]  # FSDP1 refuses CPUs
    results = {s: fit(path, work, s, args.steps, device, counts, peak) for s in strategies}
    print(f"\ntraining, Sokoban, 32 trajectories x 3 turns x 64 tokens, PPO with a separate critic, {args.steps} "
          f"iterations (medians after the first):")
    head = f"  {'strategy':<22}{'iteration s':>12}{'generate s':>11}{'rollout tok/s':>14}{'update tok/s':>13}{'MFU':>7}{'peak GiB':>9}"
    print(head)
    for s, r in results.items():
        if r.get("failed"):
            print(f"  {s:<22}{'failed':>12}")
            continue
        print(f"  {s:<22}{r['iteration']:>12.2f}{r['generate']:>11.2f}{r['rollout_tps']:>14.0f}{r['update_tps']:>13.0f}"
              f"{100 * r['mfu']:>6.1f}%{r['peak_gib']:>9.2f}")
    if args.paper:
        paper = ["--data.n_groups=8", "--data.group_size=16", "--data.rollout.max_turns=5",
                 "--data.rollout.max_new_tokens=400", "--data.rollout.max_seq_len=4096", "--model.ppo.mini_batch_size=32",
                 "--model.ppo.micro_batch_size=8"] if device == "cuda" else ["--data.rollout.max_new_tokens=16"]
        r = fit(path, work, "1 GPU", max(2, args.steps), device, counts, peak, extra=paper, label="paper shape")
        results["paper shape"] = r
        if not r.get("failed"):
            print(f"\npaper shape (8 x 16 trajectories, 5 turns, up to 400 tokens per turn): iteration "
                  f"{r['iteration']:.1f} s (goal <= 18 s: 200 iterations in an hour), generation {r['generate']:.1f} s, "
                  f"update MFU {100 * r['mfu']:.1f}% (goal >= 25%), peak {r['peak_gib']:.1f} GiB")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if any(r.get("failed") for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
