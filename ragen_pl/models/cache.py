"""Where built models live: ``$RAGEN_PL_CACHE`` (default ``~/.cache/ragen-pl``), one folder per recipe hash."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["BUILD_THREADS", "build_threads", "cache_dir", "replace_dir"]

#: Torch threads a cached build runs with, whoever calls it. A CPU's float sums depend on how many threads split them,
#: so the same recipe built first by a test (one thread) or by the CLI (two) gave different weights under one cache
#: key, and a learning test passed or failed by which of them built it first.
BUILD_THREADS = 2


def cache_dir() -> Path:
    return Path(os.environ.get("RAGEN_PL_CACHE", Path.home() / ".cache" / "ragen-pl"))


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished build ``tmp`` to ``out`` (replacing an older build there)."""
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # atomic: a crash mid-build never leaves a half-written model behind


@contextmanager
def build_threads() -> Iterator[None]:
    """Run a build with :data:`BUILD_THREADS` torch threads, then give the caller its own count back.

    Through torch's own setter (``torch._C``): vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for
    the rest of the process once it binds its threads, and a build after it (a test session) kept whatever count
    it found."""
    import torch

    before = torch.get_num_threads()
    torch._C.set_num_threads(BUILD_THREADS)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)
