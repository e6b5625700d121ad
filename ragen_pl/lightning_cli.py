"""RagenCLI: LightningCLI over RagenModule and RolloutDataModule."""

from __future__ import annotations

import difflib
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
from jsonargparse import ActionConfigFile, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from ragen_pl.data import RolloutDataModule
from ragen_pl.module import RagenModule

TRAINER_DEFAULTS = {
    "num_sanity_val_steps": 0,  # evaluation rollouts are expensive; the first validation runs at val_check_interval
    "log_every_n_steps": 1,  # one step is a whole StarPO iteration
    "check_val_every_n_epoch": None,  # the rollout stream has no epochs: validate every `val_check_interval` steps
    "val_check_interval": 10,
    "max_steps": 200,
    "enable_model_summary": False,
    # Without a logger Lightning writes config.yaml and checkpoints into the working folder: keep them under runs/.
    "default_root_dir": "runs",
}


def did_you_mean(word: str, choices) -> str:
    """`` Did you mean '--x'?`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


class RagenArgumentParser(LightningArgumentParser):
    """LightningCLI's parser with short errors and no abbreviated flags.

    jsonargparse prints the whole usage (60-80 lines) before an error. Here an error is at most three lines: what
    is wrong (naming the flag and the value), a did-you-mean where a close name exists, and where the full usage is.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--trainer.max_step=5` must not silently mean max_steps
        kwargs.setdefault("prog", "ragen-pl")  # also under `python -m ragen_pl.cli` and in tests
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {_short_message(message, parser)}\nFull usage: {prog} --help\n")
        self.exit(2)


def _short_message(message: str, parser) -> str:
    """One line from jsonargparse's message, with a did-you-mean for unknown flags."""
    unknown = re.match(r"unrecognized arguments: (.*)", message.strip())
    if unknown:
        flags = unknown.group(1).split()
        first = flags[0].split("=")[0]
        options = [o for o in parser._option_string_actions if o.startswith("--")]
        return f"unrecognized argument {unknown.group(1)!r}.{did_you_mean(first, options)}"
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip(" -")]
    keys = [(i, m.group(1)) for i, ln in enumerate(lines) for m in [re.search(r'Parser key "([^"]+)"', ln)] if m]
    # The flag: nested keys join up (`model.ppo` then `clip_low` -> `--model.ppo.clip_low`).
    flag = ".".join(k for _, k in keys[:1]) if keys else ""
    for _, k in keys[1:]:
        flag = k if k.startswith(flag + ".") else f"{flag}.{k}"
    # The most specific reason: ours ("'grpoo' not found ... Available: ..."), else the line under the innermost key.
    reason = next((ln for ln in lines if "not found" in ln or "Available" in ln), None)
    if reason is None:
        after = keys[-1][0] + 1 if keys else 0
        reason = re.sub(r'^Parser key "[^"]+":\s*', "", lines[after] if after < len(lines) else lines[-1])
    reason = re.sub(r"<class '([\w.]+)'>", r"\1", reason)
    return f"--{flag}: {reason}" if flag else reason


def check_config_files(argv: list[str]) -> str | None:
    """Check each ``--config`` file before LightningCLI reads it: exists, and is valid YAML (file and line)."""
    import yaml

    paths = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    for path in paths:
        if path.lstrip().startswith(("{", "[")) or "\n" in path:
            continue  # an inline config string, not a file
        file = Path(path)
        if not file.is_file():
            return f"--config: no such file: {path}"
        try:
            yaml.safe_load(file.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            return f"--config {path}: invalid YAML at {where}: {problem}"
    return None


class RagenCLI(LightningCLI):
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={pl.__version__}"])
        parser = RagenArgumentParser(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile,
                            help="Path to a configuration file in json or yaml format.")
        return parser

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--torch_threads", type=int, default=0,
                            help="torch threads per process (0 leaves torch's default)")

    def instantiate_trainer(self, **kwargs):
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar, TQDMProgressBar

        from ragen_pl.callbacks import default_callbacks
        from ragen_pl.checkpoint import AtomicCheckpointIO, RunCheckpoint

        trainer = super().instantiate_trainer(**kwargs)
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and type(ckpt) is ModelCheckpoint and ckpt.monitor is None and not ckpt._every_n_train_steps:
            # Lightning's default saves at epoch ends, which a rollout stream never reaches: save every few
            # iterations and at the end instead, and keep `last.ckpt` for resuming after a crash.
            trainer.callbacks[trainer.callbacks.index(ckpt)] = RunCheckpoint(dirpath=ckpt.dirpath)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()  # same-folder temp file, fsync, rename
        have = {type(cb) for cb in trainer.callbacks}
        for cb in default_callbacks():
            if type(cb) in have:
                continue
            if isinstance(cb, ProgressBar):
                bar = trainer.progress_bar_callback
                if bar is None or type(bar) not in (TQDMProgressBar, RichProgressBar):
                    continue  # progress bars are off, or the config chose its own
                trainer.callbacks.remove(bar)  # Lightning's default counts epochs; the rollout stream has none
            trainer.callbacks.append(cb)
        return trainer

    def before_instantiate_classes(self) -> None:
        threads = self.config.get(self.subcommand, self.config).get("torch_threads", 0) if self.subcommand else 0
        if threads:
            import torch

            torch.set_num_threads(threads)


def run_lightning_cli(argv: list[str]) -> int:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    # RagenModule takes `dataloader_iter` on purpose: no prefetch, so each rollout uses the latest weights.
    warnings.filterwarnings("ignore", message=".*dataloader_iter.*")
    warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
    # The checkpoint after an iteration is the one to resume from; manual optimisation makes Lightning say so.
    warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")
    # vLLM initialises torch.distributed even in one process; RagenModule already logs with sync_dist=True.
    warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")
    # main() always passes its argv explicitly (it also serves tests and scripts).
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended.*")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    problem = check_config_files(argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        RagenCLI(
            RagenModule,
            RolloutDataModule,
            args=argv,
            auto_configure_optimizers=False,
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
        )
    except (ValueError, TypeError, ImportError) as err:
        # Config mistakes found while building the components: one line naming the field, not a traceback.
        if os.environ.get("RAGEN_PL_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
