"""The resume policy of ``--ckpt_path``: which checkpoint ``last`` means, and a resumed run keeps the model settings it
was trained with (a config that differs is refused, naming each flag)."""

from __future__ import annotations

from pathlib import Path

from ragen_pl.config import OptimConfig, PPOConfig
from ragen_pl.registry import class_path
from ragen_pl.rewards import RewardNorm
from ragen_pl.update import DEFAULT_ADVANTAGE, DEFAULT_POLICY_LOSS, StarPOUpdate

__all__ = ["last_checkpoint", "resolve_checkpoint", "run_root"]


def resolve_checkpoint(cfg, exclude: list[Path] = ()) -> None:
    """Resolve ``--ckpt_path`` (``last`` too), check the file, and refuse model settings that differ from it.

    Lightning's own version loads the checkpoint's hyperparameters *over* the command line, so a flag given on
    resume (``--model.advantage=grpo``) was silently dropped. Here the run keeps the checkpoint's model settings,
    and a config that differs from them is refused, naming each flag (start a new run to change them). Trainer
    and data settings (``max_steps``, envs, ...) apply as given.

    ``--ckpt_path=last`` is the ``last.ckpt`` of the latest run of this config's run folder (the highest
    ``version_N``, not counting ``exclude``, the folder this command itself claimed, nor a folder a live process
    holds): the run that stopped, never an older one whose checkpoint happens to lie beside it. If that run has none,
    that is said in one line.
    """
    from ragen_pl.checkpoint import CheckpointError, load_checkpoint, model_differences

    given = cfg.get("ckpt_path")
    if not given:
        return
    if given in ("last", "best", "hpc", "registry") or given.startswith("registry:"):
        if given != "last":
            raise CheckpointError(f"--ckpt_path={given}: ragen-pl resumes from a file, a folder, or 'last'")
        cfg["ckpt_path"] = given = str(last_checkpoint(run_root(cfg), exclude))
    path = Path(given)
    notice_changed_data(path, cfg)
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


def _flat(value, prefix: str) -> dict[str, str]:
    """``{--data.x.y: value}`` of a nested config dict, values as their YAML-ish text."""
    import json

    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, sub in value.items():
            out.update(_flat(sub, f"{prefix}.{key}"))
        return out
    return {prefix: json.dumps(value, default=str, sort_keys=True)}


def data_differences(saved: dict, given: dict) -> list[str]:
    """``--data.flag: before -> now`` for each data setting that differs between two configs' ``data`` sections."""
    old, new = _flat(saved, "--data"), _flat(given, "--data")
    changed = [key for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]
    # A component replaced by another: its class is the change; the two classes' arguments are not comparable.
    replaced = [key[: -len(".class_path")] for key in changed if key.endswith(".class_path")]
    changed = [key for key in changed if not any(key.startswith(f"{r}.init_args.") for r in replaced)]
    return [f"{key}: {old.get(key, 'unset')} -> {new.get(key, 'unset')}" for key in changed]


def notice_changed_data(checkpoint: Path, cfg) -> None:
    """Warn in one line when a resumed run's data settings (envs, groups, evaluation) differ from those the checkpoint's
    run was started with (its ``config.yaml``): they apply as given, and a resume that changes them is no longer the
    same run."""
    import yaml
    from lightning.pytorch.utilities import rank_zero_warn

    from ragen_pl.runs import run_folder_of_checkpoint

    saved = run_folder_of_checkpoint(checkpoint) / "config.yaml"
    data = cfg.get("data")
    if not saved.is_file() or data is None:
        return
    try:
        before = (yaml.safe_load(saved.read_text()) or {}).get("data") or {}
    except yaml.YAMLError:
        return
    try:
        now = yaml.safe_load(yaml.safe_dump(data.as_dict() if hasattr(data, "as_dict") else dict(data)))
    except (yaml.YAMLError, TypeError, ValueError):
        return  # a value the config file could not hold either: nothing to compare it with
    diffs = data_differences(before, now or {})
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        rank_zero_warn(f"resuming {checkpoint} with other data settings than its run started with (they apply as "
                       f"given): {shown}")


def last_checkpoint(root: Path, exclude: list[Path] = ()) -> Path:
    """The ``last.ckpt`` of the latest run under ``root`` (see :func:`resolve_checkpoint`)."""
    from ragen_pl.checkpoint import CheckpointError, find_last
    from ragen_pl.runs import in_use

    skip = {Path(p).resolve() for p in exclude}
    # Not this command's own folder, nor one a live process holds (a run in progress: on the other ranks of this
    # command, the folder rank 0 claimed): the latest run that stopped.
    runs = sorted((p for p in root.glob("version_*") if p.name[8:].isdigit() and p.resolve() not in skip
                   and not in_use(p)), key=lambda p: int(p.name[8:]))
    if not runs:
        found = find_last(root) if root.is_dir() else None  # a run folder without version_N (its own layout)
        if found is None:
            raise CheckpointError(f"--ckpt_path=last: no run under {root} (the run folder of this config); give the "
                                  f"checkpoint's path")
        return found
    latest = runs[-1]
    found = find_last(latest)
    if found is None:
        earlier = next((p for p in reversed(runs[:-1]) if find_last(p) is not None), None)
        hint = f"; an earlier run's is {find_last(earlier)}" if earlier is not None else ""
        raise CheckpointError(f"--ckpt_path=last: the latest run, {latest}, has no checkpoint (it stopped before its "
                              f"first iteration ended){hint}: give --ckpt_path explicitly")
    return found


def _class_path_of(cls: type):
    return lambda: class_path(cls)


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
