"""The resume policy of ``--ckpt_path``: which checkpoint ``last`` means, and a resumed run keeps the model settings it
was trained with (a config that differs is refused, naming each flag)."""

from __future__ import annotations

from pathlib import Path

from ragen_pl.config import OptimConfig, PPOConfig
from ragen_pl.rewards import RewardNorm
from ragen_pl.update import DEFAULT_ADVANTAGE, DEFAULT_POLICY_LOSS, StarPOUpdate

__all__ = ["resolve_checkpoint", "run_root"]


def resolve_checkpoint(cfg) -> None:
    """Resolve ``--ckpt_path`` (``last`` too), check the file, and refuse model settings that differ from it.

    Lightning's own version loads the checkpoint's hyperparameters *over* the command line, so a flag given on
    resume (``--model.advantage=grpo``) was silently dropped. Here the run keeps the checkpoint's model settings,
    and a config that differs from them is refused, naming each flag (start a new run to change them). Trainer
    and data settings (``max_steps``, envs, ...) apply as given.
    """
    from ragen_pl.checkpoint import CheckpointError, find_last, load_checkpoint, model_differences

    given = cfg.get("ckpt_path")
    if not given:
        return
    if given in ("last", "best", "hpc", "registry") or given.startswith("registry:"):
        if given != "last":
            raise CheckpointError(f"--ckpt_path={given}: ragen-pl resumes from a file, a folder, or 'last'")
        root = run_root(cfg)
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


def _class_path_of(cls: type):
    return lambda: f"{cls.__module__}.{cls.__qualname__}"


def _dataclass_defaults(cls):
    from dataclasses import asdict

    return lambda: asdict(cls())


_MODEL_DEFAULTS = {
    "ppo": _dataclass_defaults(PPOConfig),
    "optim": _dataclass_defaults(OptimConfig),
    "reward_norm": _dataclass_defaults(RewardNorm),
    "advantage": _class_path_of(DEFAULT_ADVANTAGE),
    "policy_loss": _class_path_of(DEFAULT_POLICY_LOSS),
    "updater": _class_path_of(StarPOUpdate),
    "hooks": list,
}


def run_root(cfg) -> Path:
    """The folder this config's runs are written to: the logger's ``save_dir/name``, else ``default_root_dir``."""
    trainer = cfg.get("trainer")
    logger = trainer.get("logger") if trainer is not None else None
    if isinstance(logger, list):
        logger = logger[0] if logger else None
    args = logger.get("init_args") if logger is not None and hasattr(logger, "get") else None
    if args is not None and args.get("save_dir"):
        return Path(args.get("save_dir")) / (args.get("name") or "")
    return Path((trainer.get("default_root_dir") if trainer is not None else None) or "runs")
