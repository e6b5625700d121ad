"""The ``ragen-pl`` command.

``ragen-pl plugins`` lists every discovered plugin; ``ragen-pl play`` plays an env with a random or expert (solver) policy.
Plugins are loaded before any config is parsed, so configs can name components by their short entry name.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence

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
    try:
        env_args = json.loads(args.env_args)
    except json.JSONDecodeError as err:
        raise SystemExit(f"error: --env-args must be a JSON object, got {args.env_args!r}: {err}") from None
    if not isinstance(env_args, dict):
        raise SystemExit(f"error: --env-args must be a JSON object, got {args.env_args!r}")
    try:
        env = registry.resolve("envs", args.env, **env_args)
    except (registry.PluginLoadError, ValueError, TypeError) as err:
        raise SystemExit(f"error: --env {args.env!r}: {err}") from None
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        registry.load_plugins()
    except registry.PluginLoadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
