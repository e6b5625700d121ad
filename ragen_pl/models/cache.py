"""Where built models live: ``$RAGEN_PL_CACHE`` (default ``~/.cache/ragen-pl``), one folder per recipe hash."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["BUILD_THREADS", "PREFIX", "build_threads", "cache_dir", "replace_dir"]

PREFIX = "ragen-pl/"
"""The prefix of named models (``ragen-pl/tiny``, ``ragen-pl/<plugin entry name>``): built offline, not a hub id."""

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

    Through :func:`~ragen_pl.hardware.set_torch_threads`, which a process where vLLM's CPU worker ran still obeys
    (a build after it in a test session kept whatever count it found)."""
    import torch

    from ragen_pl.hardware import set_torch_threads

    before = torch.get_num_threads()
    set_torch_threads(BUILD_THREADS)
    try:
        yield
    finally:
        set_torch_threads(before)
