"""Where built models live: ``$RAGEN_PL_CACHE`` (default ``~/.cache/ragen-pl``), one folder per recipe hash."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["cache_dir", "replace_dir"]


def cache_dir() -> Path:
    return Path(os.environ.get("RAGEN_PL_CACHE", Path.home() / ".cache" / "ragen-pl"))


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished build ``tmp`` to ``out`` (replacing an older build there)."""
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # atomic: a crash mid-build never leaves a half-written model behind
