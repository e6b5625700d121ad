"""RagenCLI: LightningCLI over RagenModule and RolloutDataModule."""

from __future__ import annotations

import difflib
import os
import re
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
from jsonargparse import ActionConfigFile, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from ragen_pl.config import OptimConfig, PPOConfig
from ragen_pl.data import RolloutDataModule
from ragen_pl.errors import ConfigError, RolloutError
from ragen_pl.module import RagenModule
from ragen_pl.registry import PluginLoadError
from ragen_pl.rewards import RewardNorm
from ragen_pl.runs import claim_version, lock_run_folder, write_run_info

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
    ours = own_reason(message)
    if ours is not None:  # a config object's own sentence names the full flag already
        return ours
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip(" -")]
    keys = [(i, m.group(1)) for i, ln in enumerate(lines) for m in [re.search(r'Parser key "([^"]+)"', ln)] if m]
    # The flag: nested keys join up (`model.ppo` then `clip_low` -> `--model.ppo.clip_low`).
    flag = ".".join(k for _, k in keys[:1]) if keys else ""
    for _, k in keys[1:]:
        flag = k if k.startswith(flag + ".") else f"{flag}.{k}"
    nested = re.search(r"NestedArg\(key='([^']+)'", message)
    fields = _union_fields(message)
    if nested and fields is not None and nested.group(1) not in fields:  # `--model.ppo.nope=1`
        flag = f"{flag}.{nested.group(1)}"
        return f"--{flag}: {REMOVED.get(flag, 'no such setting')}.{did_you_mean(nested.group(1), fields)}"
    # The most specific reason: ours ("'grpoo' not found ... Available: ..."), else the line under the innermost key.
    reason = next((ln for ln in lines if "not found" in ln or "Available" in ln), None)
    if reason is None:
        after = keys[-1][0] + 1 if keys else 0
        reason = re.sub(r'^Parser key "[^"]+":\s*', "", lines[after] if after < len(lines) else lines[-1])
    reason = re.sub(r"<class '([\w.]+)'>", r"\1", reason)
    return f"--{flag}: {reason}" if flag else reason


#: Settings earlier versions had, and what replaced them.
REMOVED = {"model.ppo.temperature": "removed: the update scores log-probs at the temperature the batch was sampled "
                                    "with, --data.rollout.temperature"}


def own_reason(message: str) -> str | None:
    """The sentence a ragen-pl config object raised (it starts with a backticked full flag), found inside whatever
    jsonargparse wrapped it in (a Union's "Does not validate against any of the Union subtypes ..." lists each
    subtype's error, ours among them)."""
    for line in message.splitlines():
        line = line.strip(" -")
        if line.startswith("`--"):
            return line
    return None


def _union_fields(message: str) -> list[str] | None:
    """The fields of the dataclass a jsonargparse Union message names first (``PPOConfig | None``), or None."""
    import dataclasses
    import importlib

    found = re.search(r"Subtypes: \[<class '([\w.]+)\.(\w+)'>", message)
    if not found:
        return None
    try:
        cls = getattr(importlib.import_module(found.group(1)), found.group(2))
    except (ImportError, AttributeError):
        return None
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else None


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
        if _launching_rank():
            for logger in trainer.loggers:  # one run per version folder, even for two fits started together
                if hasattr(logger, "_version") and hasattr(logger, "root_dir"):
                    if logger._version is None:
                        logger._version = claim_version(logger.root_dir)
                    lock_run_folder(logger.log_dir)
        _warn_slow_precision(trainer)
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
        _warn_warm_layout(self.model, self.datamodule)

    def _parse_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path`` (``last`` too), check the file, and refuse model settings that differ from it.

        Lightning's own version loads the checkpoint's hyperparameters *over* the command line, so a flag given on
        resume (``--model.advantage=grpo``) was silently dropped. Here the run keeps the checkpoint's model settings,
        and a config that differs from them is refused, naming each flag (start a new run to change them). Trainer
        and data settings (``max_steps``, envs, ...) apply as given.
        """
        from ragen_pl.checkpoint import CheckpointError, find_last, load_checkpoint, model_differences

        sub = self.config.get("subcommand")
        cfg = self.config.get(sub) if sub else None
        given = cfg.get("ckpt_path") if cfg is not None else None
        if not given:
            return
        if given in ("last", "best", "hpc", "registry") or given.startswith("registry:"):
            if given != "last":
                raise CheckpointError(f"--ckpt_path={given}: ragen-pl resumes from a file, a folder, or 'last'")
            root = _run_root(cfg)
            found = find_last(root)
            if found is None:
                raise CheckpointError(f"--ckpt_path=last: no last.ckpt under {root} (the run folder of this config); "
                                      f"give the checkpoint's path")
            cfg["ckpt_path"] = given = str(found)
        path = Path(given)
        if path.is_dir():
            return  # a sharded checkpoint: its shards are checked as they load
        checkpoint = load_checkpoint(path, mmap=True)  # only the hyperparameters are read here; Lightning loads it
        saved = checkpoint.get("hyper_parameters") or {}
        model = cfg.get("model")
        as_dict = model.as_dict() if hasattr(model, "as_dict") else dict(model or {})
        # Settings left out of the config are the module's defaults, which the checkpoint recorded in full.
        for key, default in _MODEL_DEFAULTS.items():
            if as_dict.get(key) is None:
                as_dict[key] = default()
        diffs = model_differences(saved, as_dict)
        if diffs:
            shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
            raise CheckpointError(f"--ckpt_path {path} keeps the model settings it was trained with, but the config "
                                  f"differs: {shown}. Drop those flags to resume, or start a new run to change them")

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


def _warn_warm_layout(model, datamodule) -> None:
    """A SmolLM2 warm start run in a prompt layout it was not taught (another turn header, window or action budget)
    still runs, but reads prompts it never saw: say so in one line."""
    from lightning.pytorch.utilities import rank_zero_warn

    from ragen_pl.models.smollm2 import warm_layout_mismatch

    name, rollout = getattr(model, "hparams", {}).get("model"), getattr(datamodule, "rollout_config", None)
    problem = warm_layout_mismatch(name, rollout) if isinstance(name, str) and rollout is not None else None
    if problem:
        rank_zero_warn(problem)


def _warn_slow_precision(trainer) -> None:
    """bf16 on a CPU without bf16 instructions runs, but several times slower than float32: say so in one line."""
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.utilities import rank_zero_warn

    from ragen_pl.hardware import cpu_has_native_bf16

    precision = str(trainer.precision)
    if isinstance(trainer.accelerator, CPUAccelerator) and precision.startswith("bf16") and not cpu_has_native_bf16():
        rank_zero_warn(f"`--trainer.precision={precision}` on a CPU without bf16 instructions (avx512_bf16, "
                       f"amx_bf16) runs several times slower than float32 here; drop it (32-true) on this machine")


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
    previous = _stop_on_sigterm()
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
    except (ConfigError, PluginLoadError, RolloutError) as err:
        # The user's setup, not a bug: one line naming the field, file or env, not a traceback.
        if os.environ.get("RAGEN_PL_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Terminated:
        print("stopped by SIGTERM; the last checkpoint is whole (resume with --ckpt_path=last)", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


class Terminated(BaseException):
    """SIGTERM arrived (``timeout``, a cluster's pre-emption): the run stops where it is.

    A ``BaseException``, so no ``except Exception`` in a plugin or library swallows it; Lightning runs its
    ``on_exception`` hooks and tears down. Checkpoints are written atomically, so the last one stays whole.
    """


def _stop_on_sigterm():
    """Make SIGTERM stop a run at once; return the handler it replaced (None off the main thread).

    Lightning's own SIGTERM handler only notes the signal and lets the step run on (a long rollout then ignores
    ``timeout`` and needs SIGKILL). Lightning calls the handler that was there before its own, so this one still
    runs inside ``fit``: the first SIGTERM raises :class:`Terminated`; a second one (Lightning may have put this
    handler back while tearing down) ends the process at once with the default action.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    received = []

    def handler(signum, frame):
        if received:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        received.append(signum)
        raise Terminated()

    return signal.signal(signal.SIGTERM, handler)


def _launching_rank() -> bool:
    """Whether this process is global rank 0 (or the process that will launch the others)."""
    from lightning.fabric.utilities.rank_zero import _get_rank

    return (_get_rank() or 0) == 0


def _class_path_of(path: str):
    def default() -> str:
        from ragen_pl.registry import import_target

        cls = import_target(path)
        return f"{cls.__module__}.{cls.__qualname__}"

    return default


def _dataclass_defaults(cls):
    from dataclasses import asdict

    return lambda: asdict(cls())


_MODEL_DEFAULTS = {
    "ppo": _dataclass_defaults(PPOConfig),
    "optim": _dataclass_defaults(OptimConfig),
    "reward_norm": _dataclass_defaults(RewardNorm),
    "advantage": _class_path_of("ragen_pl.advantages:GAE"),
    "policy_loss": _class_path_of("ragen_pl.losses:PPOClip"),
}


def _run_root(cfg) -> Path:
    """The folder this config's runs are written to: the logger's ``save_dir/name``, else ``default_root_dir``."""
    trainer = cfg.get("trainer")
    logger = trainer.get("logger") if trainer is not None else None
    if isinstance(logger, list):
        logger = logger[0] if logger else None
    args = logger.get("init_args") if logger is not None and hasattr(logger, "get") else None
    if args is not None and args.get("save_dir"):
        return Path(args.get("save_dir")) / (args.get("name") or "")
    return Path((trainer.get("default_root_dir") if trainer is not None else None) or "runs")
