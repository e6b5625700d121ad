"""An upper-bound probe for the multi-turn learning runs: can SmolLM2-135M learn to *read* the env's text at all?

    python -m ragen_pl_experiments.research.probe_solver_sft [--env frozenlake|sokoban] [--episodes 512] [--stages 80 160 320]

It fine-tunes SmolLM2-135M-Instruct (supervised) on the env's solver, one action per turn, in the exact rollout
layout of ``configs/smollm2-<env>.yaml``, in stages (the total steps after each), and after each stage measures its
*reading accuracy*: on the first turn of 256 evaluation seeds, how often its greedy first action is an optimal one
(FrozenLake: the actions of highest success probability by value iteration; Sokoban: the first moves of a shortest
solution), beside the chance level of a uniformly random action. At the end it is evaluated like the RL runs (same
evaluation seeds, temperature and rollout settings) beside the random policy and the format warm start. This is a
diagnostic of what the model can read, never a result: the RL runs start from the format warm start (random legal
play) and nothing here reaches them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ragen_pl.hardware import cpu_has_native_bf16  # noqa: E402
from ragen_pl_experiments.research.common import load_config, make_env, optimal_first_actions, random_success


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
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_native_bf16()):
        result = Collector(engine, tok, RolloutConfig(**data["rollout"])).collect(
            specs, temperature=data.get("val_temperature", 0.5) if temperature is None else temperature)
    m = episode_metrics(result.episodes)
    return {k: float(m[k]) for k in ("success", "format_error_rate", "effective_action_rate")}


def action_values(env, budget: int = 10) -> dict[str, float] | None:
    """FrozenLake: each action's probability of reaching the goal within the episode's ``budget`` actions when
    acting optimally afterwards (:func:`ragen_pl.envs.frozen_lake.action_values`); None elsewhere."""
    from ragen_pl.envs.frozen_lake import FrozenLake
    from ragen_pl.envs.frozen_lake import action_values as values

    return values(env, budget) if isinstance(env, FrozenLake) else None


def reading_accuracy(path: str, cfg: dict, n: int = 256) -> str:
    """Over the first turns of n eval seeds, in the config's prompt layout: how often the greedy first action is
    optimal (and a uniformly random one's chance), and for FrozenLake the mean success probability of the chosen
    action (uniformly random: the mean over actions; optimal: the best)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.config import RolloutConfig
    from ragen_pl.rollout.chat import ChatTokens
    from ragen_pl.rollout.engine import SamplingParams
    from ragen_pl.rollout.hf import HFEngine
    from ragen_pl.rollout.prompt import parse_answer
    from ragen_pl_experiments.research.probe_reading import first_turn

    data = cfg["data"]
    rollout = RolloutConfig(**data["rollout"])
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    prompts, optimal, values = [], [], []
    for i in range(n):
        env = make_env(data["env"])
        obs = env.reset(data.get("val_seed", 1_000_000) + i)
        prompts.append(ChatTokens(tok, rollout.system_prompt, first_turn(cfg, env, obs), rollout.think).ids)
        optimal.append(optimal_first_actions(env))
        values.append(action_values(env))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_native_bf16()):
        gens = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=rollout.max_new_tokens))
    hits, q_model = 0, 0.0
    for gen, best, qs in zip(gens, optimal, values):
        parsed = parse_answer(tok.decode(gen.token_ids, skip_special_tokens=True), think=rollout.think)
        action = parsed.actions[0].strip().capitalize() if parsed.actions else None
        hits += action in best
        q_model += qs.get(action, 0.0) if qs else 0.0
    chance = sum(len(b) for b in optimal) / (4 * n)
    text = f"first action optimal {hits / n:.3f} (random {chance:.3f})"
    if values[0] is not None:
        q_random = sum(sum(q.values()) / 4 for q in values) / n
        q_best = sum(max(q.values()) for q in values) / n
        text += (f", its success probability {q_model / n:.3f} (random action {q_random:.3f}, best action "
                 f"{q_best:.3f})")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=("frozenlake", "sokoban"), default="frozenlake")
    parser.add_argument("--episodes", type=int, default=512, help="solver episodes to fine-tune on")
    parser.add_argument("--stages", type=int, nargs="+", default=[80, 160, 320], help="total SFT steps after each")
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
    print(f"format warm start (the RL runs' step 0): {reading_accuracy(str(warm), cfg)}; {evaluate(str(warm), cfg)}",
          flush=True)
    records = demonstrations([make_env(cfg["data"]["env"])], args.episodes, rollout, seed=12345, play="expert")
    root = Path(tempfile.mkdtemp(prefix="ragen-pl-probe-"))
    model, done = str(build_smollm2()), 0
    for total in args.stages:
        out = root / f"solver-sft-{total}"
        t = time.perf_counter()
        loss = sft(model, records, out, steps=total - done, lr=args.lr, batch_size=8, seed=total, progress=False,
                   precision="bf16-mixed" if cpu_has_native_bf16() else "32-true", accumulate=4)
        model, done = str(out), total
        print(f"solver SFT, {total} steps ({len(records)} episodes, final loss {loss:.3f}, "
              f"{time.perf_counter() - t:.0f} s): {reading_accuracy(model, cfg)}", flush=True)
    print(f"solver SFT, {done} steps, evaluated as the RL runs: {evaluate(model, cfg)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
