"""RagenCLI: LightningCLI over RagenModule and RolloutDataModule, wired to ragen-pl's parser (``cli_parser``), resume
policy (``resume``), signals (``signals``), run folders and checkpoints (``runs``, ``checkpoint``), default callbacks and
start-up notices (``notices``)."""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from jsonargparse import ActionConfigFile, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from ragen_pl.cli_parser import RagenArgumentParser, check_config_files, own_reason
from ragen_pl.data import RolloutDataModule
from ragen_pl.errors import ConfigError, RolloutError
from ragen_pl.models.smollm2 import warn_warm_layout
from ragen_pl.module import RagenModule
from ragen_pl.notices import hide_lightning_tips, warn_slow_precision
from ragen_pl.registry import PluginLoadError
from ragen_pl.resume import resolve_checkpoint
from ragen_pl.runs import (
    claim_version,
    launching_rank,
    lock_run_folder,
    remove_unused_run_folders,
    write_run_info,
)
from ragen_pl.signals import Terminated, stop_on_signals

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


class RagenCLI(LightningCLI):
    def __init__(self, *args: Any, claimed: list[Path] | None = None, **kwargs: Any) -> None:
        self.claimed = claimed if claimed is not None else []
        """The run folders this command claimed (the caller's list, which outlives a command that raises)."""
        super().__init__(*args, **kwargs)

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
        if launching_rank():
            for logger in trainer.loggers:  # one run per version folder, even for two fits started together
                if hasattr(logger, "_version") and hasattr(logger, "root_dir"):
                    if logger._version is None:
                        logger._version = claim_version(logger.root_dir)
                        self.claimed.append(Path(logger.log_dir))
                    lock_run_folder(logger.log_dir)
        warn_slow_precision(trainer)
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

    def instantiate_classes(self) -> None:
        """Config mistakes found while building the components become one-line :class:`ConfigError`s.

        Only here: an error raised later, inside training, is a bug and keeps its traceback.
        """
        try:
            super().instantiate_classes()
        except (ConfigError, PluginLoadError):
            raise
        except (ValueError, TypeError, ImportError) as err:
            raise ConfigError(own_reason(str(err)) or str(err)) from err
        warn_warm_layout(self.model, self.datamodule)

    def _parse_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path`` and refuse model settings that differ from the checkpoint's
        (:func:`ragen_pl.resume.resolve_checkpoint`)."""
        sub = self.config.get("subcommand")
        cfg = self.config.get(sub) if sub else None
        if cfg is not None:
            resolve_checkpoint(cfg, exclude=self.claimed)

    def before_fit(self) -> None:
        """A resumed run records the checkpoint it continues, so `ragen-pl report` can show the whole run."""
        ckpt = self.config[self.subcommand].get("ckpt_path")
        if ckpt and self.trainer.is_global_zero and self.trainer.log_dir:
            write_run_info(self.trainer.log_dir, str(Path(ckpt).resolve()))

    def before_instantiate_classes(self) -> None:
        threads = self.config.get(self.subcommand, self.config).get("torch_threads", 0) if self.subcommand else 0
        if threads:
            from ragen_pl.hardware import set_torch_threads

            set_torch_threads(threads)


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
    hide_lightning_tips()
    problem = check_config_files(argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    previous = stop_on_signals()
    claimed: list[Path] = []  # the run folder this command claims (RagenCLI.instantiate_trainer)
    try:
        RagenCLI(
            RagenModule,
            RolloutDataModule,
            args=argv,
            auto_configure_optimizers=False,
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
            claimed=claimed,
        )
    except (ConfigError, PluginLoadError, RolloutError) as err:
        # The user's setup, not a bug: one line naming the field, file or env, not a traceback.
        remove_unused_run_folders(claimed)
        if os.environ.get("RAGEN_PL_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Terminated as stop:
        print(_stopped(stop.signum, claimed), file=sys.stderr)
        return 128 + stop.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def _stopped(signum: int, claimed: list[Path]) -> str:
    """The one line a stopped run ends with: which signal, and the checkpoint to resume from (or that there is none)."""
    name = signal.Signals(signum).name
    last = next((p for folder in claimed for p in [folder / "checkpoints" / "last.ckpt"] if p.exists()), None)
    if last is not None:
        return f"stopped by {name}; resume with --ckpt_path={last}"
    where = f" ({claimed[0]})" if claimed else ""
    return f"stopped by {name} before its first iteration ended: this run{where} has no checkpoint to resume from"


