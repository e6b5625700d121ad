"""A server started on this machine for a block: ``ragen-pl serve`` for an OpenEnv env, ``vllm serve`` for rollouts.

Tests, benchmarks and one-machine runs start them the same way: a free port of 127.0.0.1, the server in its own
process group (a server that starts workers of its own, as vLLM does, stops with all of them), its output in a file
(a pipe nobody reads fills up and stalls it), ready once a URL answers, stopped when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url`` answers a GET with a 2xx status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return 200 <= r.status < 300
    except OSError:
        return False


@contextlib.contextmanager
def local_server(command: Callable[[int], Sequence[str]], ready_path: str, what: str, *,
                 env: Mapping[str, str] | None = None, wait_s: float = 90.0, log: str | None = None,
                 error: type[Exception] = RuntimeError, stop_s: float = 30.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``command(port)`` on a free port; yield ``(http://127.0.0.1:port, process)`` once ``ready_path`` answers.

    Args:
        command: the server's argv for a port.
        ready_path: the path that answers once the server is up (``/health``, ``/v1/models``).
        what: the server in words, for errors.
        env: the environment of the server (default: this process's).
        wait_s: how long it may take to come up; a server that exits first, or is not up by then, raises ``error``
            with the end of what it printed.
        log: a file that keeps the server's output (default: a temporary file, deleted after).
        stop_s: how long SIGTERM to its process group may take before SIGKILL.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = open(log, "w+") if log else tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed below
    process = subprocess.Popen(list(command(port)), env=dict(env) if env is not None else None, stdout=out,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + wait_s
        while not answers(url + ready_path):
            if process.poll() is not None or time.monotonic() > deadline:
                out.flush()
                out.seek(0)
                state = f"exited with code {process.returncode}" if process.poll() is not None else \
                    f"did not answer {ready_path} within {wait_s:g} s"
                raise error(f"{what} at {url} {state}{f' (its log: {log})' if log else ''}: {out.read()[-2000:]}")
            time.sleep(0.3)
        yield url, process
    finally:
        stop(process, stop_s)
        out.close()


def stop(process: subprocess.Popen, wait_s: float = 30.0) -> None:
    """SIGTERM to the process group of ``process`` (started with ``start_new_session``), SIGKILL after ``wait_s``."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


__all__ = ["answers", "free_port", "local_server", "stop"]
