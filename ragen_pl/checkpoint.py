"""Checkpoints that survive crashes: atomic writes, a checksum, a save at the end of every run, clear load errors.

* :class:`AtomicCheckpointIO` writes each checkpoint to a temp file *in the same folder*, fsyncs it and renames it
  over the old one, so a kill at any moment leaves either the previous complete file or the new complete file
  (Lightning's own writer stages the bytes in ``$TMPDIR``; a rename across filesystems is a copy, not atomic).
  Beside ``X.ckpt`` it keeps ``X.ckpt.sha256``: the new digest, then the previous one, so a kill between the two
  renames still verifies.
* :func:`load_checkpoint` reads a checkpoint file and turns every kind of damage (missing, empty, truncated,
  flipped bytes) into one :class:`CheckpointError` line that names the file.
* :class:`RunCheckpoint` saves every ``every_n_train_steps`` iterations *and* when training ends, however it ends
  (``max_steps``, an early stop), so ``last.ckpt`` is always the final state.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ragen_pl.errors import ConfigError
from ragen_pl.registry import class_path


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message is one line naming the file."""


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, fsync it, rename it over ``path`` and fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_atomic(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """``torch.save`` ``checkpoint`` to ``path`` atomically, with its sha256 beside it."""
    import io

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    data = buffer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    sidecar = _digest_path(path)
    if sidecar.exists():
        previous = sidecar.read_text().split()[:1]
    else:  # a file from before digests were kept
        previous = [file_digest(path)] if path.is_file() else []
    # The digest file names the new file first and keeps the old one's, so whichever file a kill leaves verifies.
    _write_atomic(sidecar, ("\n".join([digest, *previous]) + "\n").encode())
    _write_atomic(path, data)
    _write_atomic(sidecar, (digest + "\n").encode())


#: (path, size, mtime) of files whose digest already matched in this process: resuming checks the file in the CLI
#: and again when Lightning loads it, and hashing a multi-GB checkpoint twice buys nothing.
_verified: set[tuple[str, int, int]] = set()


def verify(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a non-empty file whose sha256 (if recorded) matches."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        return  # a sharded (distributed) checkpoint: torch.distributed.checkpoint checks its own metadata
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): a save was interrupted; use an earlier one")
    sidecar = _digest_path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if not sidecar.exists() or key in _verified:
        return
    expected = sidecar.read_text().split()
    if expected and file_digest(path) not in expected:
        raise CheckpointError(f"checkpoint {path} is corrupt: its sha256 does not match {sidecar.name}")
    _verified.add(key)


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint file after :func:`verify`; any damage becomes one :class:`CheckpointError` line.

    ``mmap=True`` maps the tensors instead of reading them (for callers that only need the hyperparameters).
    """
    verify(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, bad pickle, ...: the file is unusable whatever the cause
        first = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else ""
        raise CheckpointError(f"checkpoint {path} cannot be read (truncated or corrupt): "
                              f"{type(err).__name__}{': ' + first if first else ''}") from err


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with same-folder atomic writes, a sha256, and one-line load errors."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        save_atomic(checkpoint, path)

    @override
    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        if Path(path).is_dir():
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return load_checkpoint(path, map_location=map_location if map_location is not None else "cpu")

    @override
    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        sidecar = _digest_path(Path(path))
        if sidecar.exists():
            sidecar.unlink()


class RunCheckpoint(ModelCheckpoint):
    """Save every ``every_n_train_steps`` iterations, keep ``last.ckpt``, and always save when training ends."""

    def __init__(self, every_n_train_steps: int = 5, **kwargs: Any) -> None:
        kwargs.setdefault("save_last", True)
        super().__init__(every_n_train_steps=every_n_train_steps, **kwargs)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_now(trainer)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A stop signal, or a rollout stopped by its failed-episode ceiling: save the last completed iteration before
        the run ends (a rollout under way is undone first: the checkpoint resumes with it). On several processes the
        ranks may stop at different points, so only the periodic checkpoints stand there."""
        from ragen_pl.errors import RolloutError
        from ragen_pl.signals import Terminated

        if not isinstance(exception, (Terminated, RolloutError)) or trainer.world_size > 1:
            return
        dm = getattr(trainer, "datamodule", None)
        if hasattr(dm, "rewind_unfinished_rollout"):
            dm.rewind_unfinished_rollout(trainer.global_step)
        if self._save_now(trainer):
            rank_zero_info(f"saved {self.last_model_path} at iteration {trainer.global_step} (resume with "
                           f"--ckpt_path={self.last_model_path})")

    def _save_now(self, trainer) -> bool:
        """Save ``last`` (and a top-k copy) at this step unless it is saved already or nothing trained; whether it
        saved."""
        if trainer.global_step == 0 or self._last_global_step_saved == trainer.global_step:
            return False
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        self._last_global_step_saved = trainer.global_step
        return True


def find_last(root: str | os.PathLike) -> Path | None:
    """The newest ``last*.ckpt`` below ``root`` (the ``--ckpt_path=last`` of a run folder), or None."""
    found = [p for p in Path(root).rglob("last*.ckpt") if p.is_file() or p.is_dir()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _plain(value: Any) -> Any:
    """JSON-comparable form: tuples become lists, everything else not JSON becomes its string."""
    import json

    return json.loads(json.dumps(value, default=str))


#: Model settings that are components: saved as a class path (and ``<name>_args``), given as {class_path, init_args}.
COMPONENTS = ("advantage", "policy_loss", "updater")


def model_differences(saved: dict[str, Any], given: dict[str, Any], prefix: str = "model") -> list[str]:
    """``--flag: checkpoint X, given Y`` for each model setting in both that differs (nested settings by path)."""
    out = []
    args_keys = {f"{c}_args" for c in COMPONENTS}
    for key, old in saved.items():
        if key not in given or key.startswith("_") or key in args_keys:
            continue
        new, flag = given[key], f"{prefix}.{key}"
        if key in COMPONENTS:  # saved as the class path; the config has {class_path, init_args} (or the class)
            new = new.get("class_path") if isinstance(new, dict) else new
            new = class_path(new) if isinstance(new, type) else new
        if isinstance(old, dict) and isinstance(new, dict):
            out += model_differences(old, new, flag)
        elif _plain(old) != _plain(new):
            out.append(f"--{flag}: checkpoint {old!r}, given {new!r}")
    for component in COMPONENTS:
        args_old, args_new = saved.get(f"{component}_args"), given.get(component)
        if isinstance(args_old, dict) and isinstance(args_new, dict):
            args = args_new.get("init_args") or {}
            out += [f"--{prefix}.{component}.init_args.{k}: checkpoint {v!r}, given {args[k]!r}"
                    for k, v in args_old.items() if k in args and _plain(v) != _plain(args[k])]
    return out


__all__ = ["AtomicCheckpointIO", "CheckpointError", "RunCheckpoint", "find_last", "load_checkpoint",
           "model_differences", "save_atomic", "verify"]
