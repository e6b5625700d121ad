"""An upper-bound probe for the multi-turn learning runs: can SmolLM2-135M learn to *read* the env's text at all?

    python benchmarks/probe_solver_sft.py [--env frozenlake|sokoban] [--episodes 512] [--steps 80]

It fine-tunes SmolLM2-135M-Instruct (supervised) on the env's solver, one action per turn, in the exact rollout
layout of ``configs/smollm2-<env>.yaml``, then evaluates it like the RL runs (same evaluation seeds, temperature and
rollout settings) beside the random policy and the format warm start. This is a diagnostic of what the model can
read, never a result: the RL runs start from the format warm start (random legal play) and nothing here reaches them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_llm import load_config, make_env, random_success  # noqa: E402


def evaluate(path: str, cfg: dict, temperature: float | None = None) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.config import RolloutConfig
    from ragen_pl.metrics import episode_metrics
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine

    data = cfg["data"]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    env = make_env(data["env"])
    start = data.get("val_seed", 1_000_000)
    specs = [EpisodeSpec(env, seed=start + i, group_id=i) for i in range(data["val_episodes"])]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = Collector(engine, tok, RolloutConfig(**data["rollout"])).collect(
            specs, temperature=data.get("val_temperature", 0.5) if temperature is None else temperature)
    m = episode_metrics(result.episodes)
    return {k: float(m[k]) for k in ("success", "format_error_rate", "effective_action_rate")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=("frozenlake", "sokoban"), default="frozenlake")
    parser.add_argument("--episodes", type=int, default=512, help="solver episodes to fine-tune on")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()

    import torch

    from ragen_pl.config import RolloutConfig
    from ragen_pl.models.smollm2 import build_smollm2, build_smollm2_warm
    from ragen_pl.sft import demonstrations, sft

    torch.set_num_threads(2)
    cfg = load_config(args.env)
    rollout = RolloutConfig(**cfg["data"]["rollout"])
    print(f"random policy: {random_success(cfg, 20):.3f}", flush=True)
    warm = build_smollm2_warm(args.env, progress=False)
    print(f"format warm start (the RL runs' step 0): {evaluate(str(warm), cfg)}", flush=True)
    records = demonstrations([make_env(cfg["data"]["env"])], args.episodes, rollout, seed=12345, expert=True)
    out = Path(tempfile.mkdtemp(prefix="ragen-pl-probe-")) / "solver-sft"
    t = time.perf_counter()
    loss = sft(build_smollm2(), records, out, steps=args.steps, lr=args.lr, batch_size=8, progress=False,
               precision="bf16-mixed")
    print(f"SFT on {len(records)} solver episodes, {args.steps} steps: final loss {loss:.3f}, "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    print(f"solver SFT (upper-bound probe): {evaluate(str(out), cfg)}; greedy: {evaluate(str(out), cfg, 0.0)}",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
