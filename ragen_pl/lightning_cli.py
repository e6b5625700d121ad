"""RagenCLI: LightningCLI over RagenModule and RolloutDataModule."""

from __future__ import annotations

import os
import sys
import warnings

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI

from ragen_pl.data import RolloutDataModule
from ragen_pl.module import RagenModule

TRAINER_DEFAULTS = {
    "num_sanity_val_steps": 0,  # evaluation rollouts are expensive; the first validation runs at val_check_interval
    "log_every_n_steps": 1,  # one step is a whole StarPO iteration
    "check_val_every_n_epoch": None,  # the rollout stream has no epochs: validate every `val_check_interval` steps
    "val_check_interval": 10,
    "max_steps": 200,
    "enable_model_summary": False,
}


class RagenCLI(LightningCLI):
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
