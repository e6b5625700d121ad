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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        RagenCLI(
            RagenModule,
            RolloutDataModule,
            args=None if argv == sys.argv[1:] else argv,
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
