"""Does a trained policy read the board the right way? Its greedy first action on held-out boards, start and end.

    python -m ragen_pl_experiments.research.policy_reading RUN [RUN ...] [--boards 256] [--threads 2]

RUN is a run's version folder (its ``config.yaml`` and ``checkpoints/last.ckpt``), e.g.
``runs/fl15/seed15/smollm2-frozenlake/version_0``. For the model the run started from (its config's ``model``) and
its last weights (the policy of ``last.ckpt``, LoRA merged as ``ragen-pl export`` writes it), on the first turn of
``--boards`` evaluation seeds in the run's own prompt layout (``turn_header`` included): how often the greedy action
is an optimal one (FrozenLake: the highest success probability by value iteration; chance: a uniformly random
action), and on FrozenLake that action's success probability under optimal play after it, beside a uniformly random
action's and the best action's (:func:`probe_solver_sft.reading_accuracy`).

The collapse metrics say whether the answers depend on the board (I(X;Z), retrieval); this says whether they depend
on it the right way: a policy can fit board-specific answers that win no more often. A diagnostic, nothing trains.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

from ragen_pl_experiments.research.probe_solver_sft import reading_accuracy


def run_files(parser: argparse.ArgumentParser, run: str) -> tuple[dict, Path]:
    """The run's saved config and its last checkpoint; a folder without them is refused in one line."""
    folder = Path(run)
    config, ckpt = folder / "config.yaml", folder / "checkpoints" / "last.ckpt"
    for path in (config, ckpt):
        if not path.is_file():
            parser.error(f"RUN {run}: no {path.relative_to(folder)} (give a run's version folder, the one that "
                         f"holds config.yaml and checkpoints/)")
    with open(config) as f:
        return yaml.safe_load(f), ckpt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run's version folder")
    parser.add_argument("--boards", type=int, default=256, help="evaluation seeds whose first turn is read")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.boards < 1:
        parser.error(f"--boards must be >= 1, got {args.boards}")
    found = [(run, *run_files(parser, run)) for run in args.runs]

    import torch

    from ragen_pl.export import export
    from ragen_pl.models import resolve_model

    torch.set_num_threads(args.threads)
    for run, cfg, ckpt in found:
        start = resolve_model(cfg["model"]["model"])
        print(f"{run}: first turn of {args.boards} evaluation seeds, greedy action", flush=True)
        print(f"  start ({cfg['model']['model']}): {reading_accuracy(start, cfg, args.boards)}", flush=True)
        with tempfile.TemporaryDirectory(prefix="ragen-pl-policy-reading-") as tmp:
            print(f"  last weights ({ckpt.name}): {reading_accuracy(str(export(ckpt, tmp)), cfg, args.boards)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
