"""The ``ragen-pl`` command.

``ragen-pl fit | validate | test`` run StarPO through LightningCLI (``--config configs/sokoban.yaml``,
``--print_config``). ``ragen-pl plugins`` lists every discovered plugin; ``ragen-pl play`` plays an env with a
random or expert (solver) policy; ``ragen-pl tiny`` builds the embedded tiny model; ``ragen-pl demos`` and
``ragen-pl sft`` make and train on supervised trajectories; ``ragen-pl report`` draws training curves;
``ragen-pl export`` writes a checkpoint's policy as a Hugging Face folder.

Plugins are loaded before any config is parsed, so a config can name a component by its class path, its class name
(``GRPO``) or its entry name (``grpo``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ragen_pl import registry


def _cmd_plugins(args: argparse.Namespace) -> int:
    plugins = registry.load_plugins()
    rows = [("GROUP", "NAME", "CLASS", "DISTRIBUTION")]
    for group, entries in plugins.items():
        for name, info in sorted(entries.items()):
            rows.append((group, name, info.value, f"{info.dist} {info.version}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def _cmd_play(args: argparse.Namespace) -> int:
    env = _env_from_args(args)
    rng = random.Random(args.seed)
    successes = 0
    print(env.instructions, end="\n\n")
    for episode in range(args.episodes):
        obs = env.reset(args.seed + episode)
        print(f"=== episode {episode} (seed {args.seed + episode})\n{obs}")
        total, done, success = 0.0, False, False
        for _ in range(args.max_actions):
            if args.policy == "expert":
                try:
                    action = env.expert_action()
                except NotImplementedError as err:
                    raise SystemExit(f"error: --policy expert: {err}; use --policy random") from None
            else:
                action = rng.choice(env.actions or ["1 + 1"])
            obs, reward, done, info = env.step(action)
            total += reward
            success = bool(info.get("success"))
            print(f"> {action}  reward {reward:+.2f}\n{obs}")
            if done:
                break
        successes += success
        print(f"return {total:+.2f}  success {success}\n")
    print(f"success rate {successes / args.episodes:.2f} over {args.episodes} episodes ({args.policy} policy)")
    return 0


def _env_from_args(args: argparse.Namespace):
    """The env ``--env`` / ``--env-args`` name; a bad name or setting exits with one line."""
    try:
        env_args = json.loads(args.env_args)
    except json.JSONDecodeError as err:
        raise SystemExit(f"error: --env-args must be a JSON object, got {args.env_args!r}: {err}") from None
    if not isinstance(env_args, dict):
        raise SystemExit(f"error: --env-args must be a JSON object, got {args.env_args!r}")
    try:
        return registry.resolve("envs", args.env, **env_args)
    except (registry.PluginLoadError, ValueError, TypeError, ImportError) as err:
        raise SystemExit(f"error: --env {args.env!r}: {err}") from None


def _cmd_serve(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:
        raise SystemExit(f"error: --port must be in [1, 65535], got {args.port}")
    if args.max_sessions < 1:
        raise SystemExit(f"error: --max-sessions must be >= 1, got {args.max_sessions}")
    env = _env_from_args(args)
    try:
        from ragen_pl.envs.openenv import serve
    except ImportError as err:
        raise SystemExit(f"error: {err}") from None
    serve(env, args.host, args.port, args.max_sessions)
    return 0


def install_entry_name_resolver() -> None:
    """Let jsonargparse resolve entry names (``grpo``) to the registered class, besides class names and paths.

    jsonargparse resolves ``class_path`` values through ``resolve_class_path_by_name``; wrapping it is the one seam
    it offers (a private one: tests/test_registry.py pins it, so a jsonargparse release that moves it fails the
    suite). Without it, entry names stop resolving but class paths and class names keep working.
    """
    from jsonargparse import _typehints

    original = getattr(_typehints, "resolve_class_path_by_name", None)
    if original is None or getattr(original, "_ragen_pl", False):
        return
    bases = {registry.import_target(target): group for group, target in registry.GROUPS.items()}

    def resolve(cls, name):
        groups = [bases[b] for b in (cls if isinstance(cls, tuple) else (cls,)) if b in bases]
        if isinstance(name, str) and "." not in name and groups:
            for group in groups:
                info = registry.load_plugins()[group].get(name)
                if info is not None:
                    return registry.class_path(info.cls)
            resolved = original(cls, name)
            if "." not in resolved:  # neither an entry name nor a known class name: list the valid ones
                from ragen_pl.cli_parser import did_you_mean

                names = sorted(n for g in groups for n in registry.load_plugins()[g])
                raise ValueError(f"'{name}' not found in {', '.join(groups)}. Available: {', '.join(names)}."
                                 f"{did_you_mean(name, names)}")
            return resolved
        return original(cls, name)

    resolve._ragen_pl = True  # type: ignore[attr-defined]
    _typehints.resolve_class_path_by_name = resolve


def _cmd_tiny(args: argparse.Namespace) -> int:
    from ragen_pl.models.tiny import build_tiny_model, build_warm_tiny_model

    if args.warm:
        print(build_warm_tiny_model(overwrite=args.overwrite))
    else:
        print(build_tiny_model(args.path, overwrite=args.overwrite))
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from ragen_pl.models import resolve_model
    from ragen_pl.sft import read_jsonl, sft

    try:
        records = read_jsonl(args.data)
        loss = sft(resolve_model(args.model), records, args.out, steps=args.steps, lr=args.lr,
                   batch_size=args.batch_size, seed=args.seed)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    print(f"saved {args.out} (final loss {loss:.4f}, {len(records)} trajectories)")
    return 0


def _demo_layout(args: argparse.Namespace):
    """The envs and rollout layout of ``ragen-pl demos``: a training config's ``data.env`` and ``data.rollout`` (so the
    warm start is taught the prompts that run will feed), or ``--env`` with ``--max-turns`` / ``--max-new-tokens``."""
    from ragen_pl.config import RolloutConfig

    if args.config is None:
        envs = [registry.resolve("envs", name) for name in args.env]
        return envs, RolloutConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens)
    import yaml

    try:
        data = (yaml.safe_load(Path(args.config).read_text()) or {}).get("data") or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"--config {args.config}: {err}") from err
    specs = data.get("env")
    if not specs:
        raise ValueError(f"--config {args.config}: no data.env to play")
    specs = [{"class_path": s} if isinstance(s, str) else s for s in (specs if isinstance(specs, list) else [specs])]
    envs = [registry.resolve("envs", s["class_path"], **(s.get("init_args") or {})) for s in specs]
    return envs, RolloutConfig(**(data.get("rollout") or {}))


def _cmd_demos(args: argparse.Namespace) -> int:
    from ragen_pl.sft import demonstrations, write_jsonl

    try:
        envs, config = _demo_layout(args)
        records = demonstrations(envs, args.episodes, config, seed=args.seed, play=args.play)
    except (registry.PluginLoadError, ValueError, TypeError) as err:
        raise SystemExit(f"error: {err}") from None
    write_jsonl(records, args.out)
    print(f"wrote {len(records)} trajectories of {args.play} play to {args.out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from ragen_pl.report import FIGURES, report

    try:
        report(args.runs, args.out)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {', '.join(FIGURES)} and trajectories.html to {args.out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ragen_pl.errors import ConfigError
    from ragen_pl.export import export

    try:
        out = export(args.checkpoint, args.out)
    except (OSError, ConfigError) as err:
        raise SystemExit(f"error: {err}") from None
    print(f"exported the policy of {args.checkpoint} to {out} (loads with AutoModelForCausalLM.from_pretrained)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragen-pl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list every discovered plugin: group, name, class, distribution")
    p.set_defaults(func=_cmd_plugins)
    p = sub.add_parser("play", help="play an env with a random or expert (solver) policy and print each step")
    p.add_argument("--env", default="sokoban", help="entry name or class path of the env (default: sokoban)")
    p.add_argument("--env-args", default="{}", help='JSON object of env arguments, e.g. \'{"dim_room": [8, 8]}\'')
    p.add_argument("--policy", choices=("random", "expert"), default="expert")
    p.add_argument("--episodes", type=int, default=3)
    p.add_argument("--max-actions", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_play)
    p = sub.add_parser("serve", help="serve an env (built in or a plugin) as an OpenEnv server "
                                     "(pip install 'ragen-pl[openenv]')")
    p.add_argument("--env", required=True, help="entry name or class path (ragen-pl plugins lists them)")
    p.add_argument("--env-args", default="{}", help="JSON object of the env's settings")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-sessions", type=int, default=256,
                   help="episodes played at once (a rollout holds one per trajectory)")
    p.set_defaults(func=_cmd_serve)
    p = sub.add_parser("tiny", help="build (once) the embedded tiny Qwen2 model and print its folder")
    p.add_argument("--path", default=None, help="where to save it (default: the ragen-pl cache)")
    p.add_argument("--warm", action="store_true", help="also warm-start it with SFT on random legal play")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_tiny)
    p = sub.add_parser("sft", help="supervised fine-tuning on a JSONL of multi-turn trajectories")
    p.add_argument("--model", required=True, help="hub id, local folder, or ragen-pl/tiny")
    p.add_argument("--data", required=True, help="JSONL of trajectories (see ragen_pl/sft.py for the layout)")
    p.add_argument("--out", required=True, help="folder to save the fine-tuned model and tokenizer to")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_sft)
    p = sub.add_parser("demos", help="write SFT trajectories of random legal play (format without skill)")
    p.add_argument("--config", default=None, help="a training config: play its data.env in its data.rollout layout "
                   "(the prompts that run will feed); --env, --max-turns and --max-new-tokens are then ignored")
    p.add_argument("--play", choices=["random", "effective"], default="random",
                   help="random legal actions, or random among those that change the state (Env.effective_actions)")
    p.add_argument("--env", nargs="+", default=["sokoban"], help="entry names of the envs")
    p.add_argument("--episodes", type=int, default=100, help="episodes per env")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_demos)
    p = sub.add_parser("export", help="the trained policy of a checkpoint as a Hugging Face folder (LoRA merged)")
    p.add_argument("checkpoint", metavar="CKPT", help="a .ckpt file, or the folder of a sharded (FSDP) checkpoint")
    p.add_argument("--out", required=True, help="folder to write the model and tokenizer to")
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("report", help="PNG training curves (runs overlaid) and an HTML trajectory viewer")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="CSV logger run folders (with metrics.csv)")
    p.add_argument("--out", default="report", help="output folder (default: report)")
    p.set_defaults(func=_cmd_report)
    return parser


LIGHTNING_COMMANDS = {"fit", "validate", "test", "predict"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        registry.load_plugins()
    except registry.PluginLoadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if argv and (argv[0] in LIGHTNING_COMMANDS or argv[0].startswith("--") and argv[0] != "--help"):
        from ragen_pl.lightning_cli import run_lightning_cli

        install_entry_name_resolver()
        return run_lightning_cli(argv)
    if argv and argv[0] in ("-h", "--help"):
        build_parser().print_help()
        print("\nTraining: ragen-pl fit|validate|test --config CONFIG.yaml (see `ragen-pl fit --help`)")
        return 0
    args = build_parser().parse_args(argv)
    return args.func(args)


def leave(code: int) -> NoReturn:
    """End the ``ragen-pl`` process with ``code``; a multi-process run leaves without interpreter finalization.

    A run's gloo/NCCL group and its sharded tensors outlive ``destroy_process_group``: a collective's worker thread
    that frees the last tensor after Python began to shut down cannot take the GIL, and CPython 3.11-3.13 then unwinds
    it through C++ frames, which aborts the finished run ("terminate called without an active exception", exit code
    -6; about 1 two-process run in 15 on CPU). So a distributed run closes its group, runs the atexit handlers (run
    folder locks, loggers) and flushes itself, then exits at once. One-process runs exit normally.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        sys.exit(code)
    dist.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> NoReturn:
    """The console script: :func:`main` with the process's arguments, then :func:`leave`."""
    leave(main())


if __name__ == "__main__":
    run()
