"""Run folders: one run per version folder, and the link from a resumed run back to the run it continues.

* :func:`claim_version` takes the next free ``version_N`` folder with an exclusive ``mkdir``, so two fits started
  together never share one folder (interleaved metrics.csv, an overwritten config.yaml, ``last-v1.ckpt``).
* :func:`lock_run_folder` refuses a second live process in a folder given explicitly (``--...logger.init_args.version``)
  and takes over a lock whose process has died.
* A resumed run writes ``run.json`` with the checkpoint it resumed from; :func:`run_chain` follows those links so
  ``ragen-pl report`` shows the whole run, step-0 baseline included.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path

from ragen_pl.errors import ConfigError

RUN_INFO = "run.json"


def claim_version(root: str | os.PathLike) -> int:
    """Create and return the first free ``root/version_N`` (atomic: ``mkdir`` fails if another run took it)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name.split("_", 1)[1]) for p in root.glob("version_*") if p.name.split("_", 1)[1].isdigit()]
    version = max(taken, default=-1) + 1
    while True:
        try:
            (root / f"version_{version}").mkdir()
            return version
        except FileExistsError:
            version += 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"  # beside it: a file inside makes loggers warn the folder is in use


def _holder(folder: Path) -> int | None:
    """The live process other than this one whose lock holds ``folder``, if any."""
    try:
        pid = int(_lock(folder).read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    return pid if pid and pid != os.getpid() and _alive(pid) else None


def in_use(folder: str | os.PathLike) -> bool:
    """Whether another live process holds ``folder`` (:func:`lock_run_folder`): a run in progress, not one that
    stopped (this process's own runs have ended when it asks, or are its own to exclude)."""
    return _holder(Path(folder)) is not None


def lock_run_folder(folder: str | os.PathLike) -> None:
    """Hold ``folder`` for this process until it exits; a folder held by a live process is a :class:`ConfigError`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = _lock(folder)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pid = _holder(folder)
            if pid is not None:
                raise ConfigError(f"run folder {folder} is in use by process {pid}: give this run another version "
                                  f"(or none, to take the next free one)") from None
            lock.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        atexit.register(lambda: lock.unlink(missing_ok=True))
        return


def remove_unused_run_folders(folders: list[Path]) -> None:
    """Remove the run folders a command claimed and failed to use (a config or setup error before its first logged
    iteration): nothing in them but what Lightning writes at start (config.yaml, hparams.yaml, an empty metrics.csv)."""
    import shutil

    for folder in folders:
        if not folder.is_dir():
            continue
        metrics = folder / "metrics.csv"
        logged = metrics.is_file() and len(metrics.read_text().splitlines()) > 1
        checkpoints = any((folder / "checkpoints").glob("*")) if (folder / "checkpoints").is_dir() else False
        if not logged and not checkpoints and not (folder / "samples").exists():
            shutil.rmtree(folder, ignore_errors=True)
            _lock(folder).unlink(missing_ok=True)


def write_run_info(folder: str | os.PathLike, resumed_from: str | None) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_INFO).write_text(json.dumps({"resumed_from": resumed_from}) + "\n")


def run_folder_of_checkpoint(ckpt: str | os.PathLike) -> Path:
    """``.../version_N/checkpoints/last.ckpt`` -> ``.../version_N``."""
    ckpt = Path(ckpt)
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def run_chain(folder: str | os.PathLike, limit: int = 100) -> list[Path]:
    """The run folders a resumed run continues, oldest first, ending with ``folder`` itself."""
    chain = [Path(folder)]
    while len(chain) < limit:
        info = chain[0] / RUN_INFO
        if not info.is_file():
            break
        try:
            resumed = json.loads(info.read_text()).get("resumed_from")
        except (OSError, ValueError):
            break
        if not resumed:
            break
        previous = run_folder_of_checkpoint(resumed)
        if not previous.is_dir() or previous in chain:
            break
        chain.insert(0, previous)
    return chain


__all__ = ["claim_version", "in_use", "launching_rank", "lock_run_folder", "remove_unused_run_folders", "run_chain",
           "run_folder_of_checkpoint", "write_run_info"]


def launching_rank() -> bool:
    """Whether this process is global rank 0 (or the process that will launch the others)."""
    from lightning.fabric.utilities.rank_zero import _get_rank

    return (_get_rank() or 0) == 0
