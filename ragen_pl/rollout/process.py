"""A rollout engine in its own process (entry name ``process``): its own copy of the weights, its own cores or GPU.

The trainer keeps the policy; a worker process (``spawn``) builds the same architecture from the policy's config and
samples with any inner engine (``hf`` by default) bound to that copy. This is what lets a rollout run while the
trainer updates (``--data.max_staleness``, :mod:`ragen_pl.rollout.ahead`): the two sides no longer share weights,
threads or a device.

Weights: the worker's parameters live in shared memory (CUDA IPC on a GPU); the trainer writes the policy's
weights into them tensor by tensor (``load_weights``), between two rollouts, without a copy of the whole state dict
(with LoRA, each merged tensor is written and dropped in turn: :func:`ragen_pl.policy.policy_weights`).

Faults: a worker that dies (killed, out of memory) ends the call that waits for it with a one-line
:class:`~ragen_pl.errors.RolloutError` naming its pid and exit code within ``poll_s`` seconds. The worker ignores
SIGINT and SIGTERM (the trainer stops it after its own graceful stop, so an in-flight rollout can still be kept in the
checkpoint) and exits as soon as its pipe to the trainer closes (the trainer exited or was killed): no orphan.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.util  # (its exit handler registered before ours: see _close_all)
import os
import signal
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ragen_pl.dist import process_rank
from ragen_pl.errors import RolloutError
from ragen_pl.rollout.engine import Generation, RolloutEngine, SamplingParams


class ProcessEngine(RolloutEngine):
    """Sample in a worker process with its own copy of the weights (see the module docstring)."""

    holds_weights = True
    streams_weights = True
    """``load_weights`` takes (name, tensor) pairs one at a time."""

    def __init__(self, engine: RolloutEngine | None = None, threads: int | None = None, device: str | None = None,
                 dtype: str | None = None, poll_s: float = 1.0, start_timeout_s: float = 300.0) -> None:
        """
        Args:
            engine: the engine the worker samples with (default: ``hf`` with its defaults); it is built here and
                sent to the worker unbound.
            threads: torch threads of the worker (on CPU, the cores it takes from the trainer; default: torch's).
            device: where the worker's copy lives: ``cpu``, ``cuda:1``, or ``cuda:+N``, the trainer's GPU index + N
                (several trainer processes each take their own: ``--trainer.devices=2`` and ``cuda:+2`` sample rank 0 on
                GPU 2 and rank 1 on GPU 3). Default: the trainer's device.
            dtype: the copy's dtype (``float32``, ``bfloat16``, ``float16``; default: the policy's). Under
                ``bf16-mixed`` the worker samples in the trainer's autocast dtype either way.
            poll_s: how often a wait checks that the worker is alive.
            start_timeout_s: how long the worker may take to build its copy.
        """
        from ragen_pl.rollout.hf import HFEngine

        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"`--data.engine.threads` must be an integer >= 1 (or null), got {threads!r}")
        if dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"`--data.engine.dtype` must be float32, bfloat16, float16 or null, got {dtype!r}")
        if isinstance(engine, ProcessEngine):
            raise ValueError("`--data.engine.engine` cannot itself be a process engine")
        self.engine = engine if engine is not None else HFEngine()
        self.threads, self.device, self.dtype = threads, device, dtype
        self.poll_s, self.start_timeout_s = poll_s, start_timeout_s
        self.process: mp.process.BaseProcess | None = None
        self._conn = None
        self._weights: dict[str, Tensor] | None = None
        self._aliases: dict[str, str] = {}  # a tied weight's other names -> the name the worker shares it under
        self._autocast: str | None = None  # the trainer's autocast dtype, seen where it hands over weights
        self._pending: dict | None = None  # a sampling state loaded before the worker started
        self._lock = threading.Lock()  # one request at a time on the pipe

    # ----------------------------------------------------------------------------------------- lifecycle
    def bind(self, model, tokenizer) -> None:
        """Take the policy; the worker starts at the first weight write, once the strategy has moved the policy to
        its device (Lightning binds engines before that)."""
        super().bind(model, tokenizer)

    def _ensure(self) -> None:
        if self.process is None:
            if self.model is None:
                raise RolloutError("the process engine was never bound to a policy")
            self._start(self.model, self.tokenizer)

    def _start(self, model, tokenizer) -> None:
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            raise ValueError(f"`--data.engine=process` needs a transformers policy with a config; "
                             f"{type(model).__name__} has none")
        param = next(model.parameters())
        device = self.device or str(param.device)
        if device.startswith("cuda:+"):
            here = param.device.index if param.device.type == "cuda" else 0
            device = f"cuda:{here + int(device[len('cuda:+'):])}"
        dtype = self.dtype or str(param.dtype).replace("torch.", "")
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        spec = {"config": _base_config(model), "tokenizer": tokenizer, "engine": self.engine, "device": device,
                "dtype": dtype, "threads": self.threads, "rank": process_rank()}
        self.process = ctx.Process(target=_worker, args=(theirs, spec), name="ragen-pl-rollout", daemon=True)
        self.process.start()
        _LIVE.add(self)
        theirs.close()
        self._conn = ours
        self._weights, self._aliases = self._wait("start", self.start_timeout_s)
        pending, self._pending = self._pending, None
        if pending:
            self._call("load_state_dict", pending)

    def close(self) -> None:
        """Stop the worker (the data module's teardown; also at exit, as a daemon process)."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(("stop", None))
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
        self._conn.close()
        self._weights = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    # ------------------------------------------------------------------------------------------- requests
    def _call(self, op: str, payload: Any = None, timeout: float | None = None) -> Any:
        self._ensure()
        with self._lock:
            try:
                self._conn.send((op, payload))
            except (OSError, ValueError) as err:  # the pipe broke: the worker is gone
                raise self._died(op) from err
            return self._wait(op, timeout)

    def _wait(self, op: str, timeout: float | None) -> Any:
        waited = 0.0
        while not self._conn.poll(self.poll_s):
            waited += self.poll_s
            if not self.process.is_alive():
                raise self._died(op)
            if timeout is not None and waited >= timeout:
                raise RolloutError(f"the rollout process (pid {self.process.pid}) did not answer {op!r} within "
                                   f"{timeout:g}s")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as err:
            raise self._died(op) from err
        if status == "error":
            raise RolloutError(f"the rollout process failed in {op!r}: {value}")
        return value

    def _died(self, op: str) -> RolloutError:
        process = self.process
        process.join(timeout=self.poll_s)
        return RolloutError(f"the rollout process (pid {process.pid}) died during {op!r} (exit code "
                            f"{process.exitcode}); the run stops here")

    def load_weights(self, state_dict: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Write the policy's weights into the worker's shared copy, one tensor at a time."""
        self._ensure()
        device = next(iter(self._weights.values())).device
        self._autocast = (str(torch.get_autocast_dtype(device.type)).replace("torch.", "")
                          if torch.is_autocast_enabled(device.type) else None)
        items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
        written: set[str] = set()
        with self._lock, torch.no_grad():  # never while the worker samples: requests hold the lock
            for name, value in items:
                shared = self._aliases.get(name, name)
                target = self._weights.get(shared)
                if target is None:
                    continue
                if target.shape != value.shape:
                    raise RolloutError(f"weight {name!r}: the policy has shape {tuple(value.shape)}, the rollout "
                                       f"process {tuple(target.shape)}")
                if shared in written:  # the worker ties this name to one written already: the policy must too
                    if not torch.equal(target, value.to(target.device, target.dtype)):
                        raise RolloutError(f"the rollout process ties weight {name!r} to {shared!r}, but the "
                                           f"policy's differ; it would sample with another model")
                    continue
                target.copy_(value)
                written.add(shared)
        missing = sorted(set(self._weights) - written)
        if missing:
            raise RolloutError(f"the policy's weights lack {len(missing)} of the rollout process's tensors (first: "
                               f"{missing[0]!r}); it would sample with stale ones")
        self._call("weights_changed")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return self._call("generate", (prompts, params, self._autocast))

    def next_call_extends(self, extends: bool) -> None:
        self._call("next_call_extends", extends)

    def end_rollout(self) -> None:
        if self.process is not None:
            self._call("end_rollout")

    def state_dict(self) -> dict[str, Any]:
        if self.process is None:  # not started yet: a state loaded before waits for it
            return dict(self._pending) if self._pending is not None else {}
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.process is None:
            self._pending = state
        else:
            self._call("load_state_dict", state)

    def __getstate__(self) -> dict[str, Any]:  # (a config dump or a deepcopy: the worker does not travel)
        state = dict(self.__dict__)
        state.update(process=None, _conn=None, _weights=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


_LIVE: weakref.WeakSet[ProcessEngine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop every worker still running at exit. Registered after ``multiprocessing``'s own exit handler, so it runs
    first: that one would SIGTERM the daemon workers (which ignore it) and wait for them forever."""
    for engine in list(_LIVE):
        engine.close()


def _base_config(model):
    """The transformers config of the policy's base model (under a peft wrapper, the base's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


def _worker(conn, spec: dict[str, Any]) -> None:
    """The rollout process: build the copy, share its tensors, answer requests until told to stop or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from transformers import AutoModelForCausalLM

        if spec["threads"] is not None:
            torch.set_num_threads(spec["threads"])
        dtype = getattr(torch, spec["dtype"])
        with torch.device(spec["device"]):
            model = AutoModelForCausalLM.from_config(spec["config"], dtype=dtype)
        model.eval().requires_grad_(False)
        if model.device.type == "cpu":
            model.share_memory()
        engine: RolloutEngine = spec["engine"]
        if hasattr(engine, "seed"):  # each trainer process samples its own stream, as in-process engines do
            engine.seed = engine.seed + spec["rank"]
        engine.bind(model, spec["tokenizer"])
        shared = dict(model.state_dict())  # tied weights: one tensor under the first name, the others its aliases
        first: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name in list(shared):
            ptr = shared[name].data_ptr()
            if ptr in first:
                aliases[name] = first[ptr]
                del shared[name]
            else:
                first[ptr] = name
        conn.send(("ok", (shared, aliases)))
    except BaseException as err:  # noqa: BLE001 - the trainer shows it in one line
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    while True:
        try:
            op, payload = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            os._exit(0)
        if op == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", _serve(engine, op, payload)))
        except BaseException as err:  # noqa: BLE001
            import traceback

            conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def _serve(engine: RolloutEngine, op: str, payload: Any) -> Any:
    if op == "generate":
        prompts, params, autocast = payload
        device = next(engine.model.parameters()).device
        if autocast is None:
            return engine.generate(prompts, params)
        with torch.autocast(device.type, dtype=getattr(torch, autocast)):
            return engine.generate(prompts, params)
    if op == "weights_changed":
        engine.end_rollout()  # kept KV prefixes belong to the old weights
        return None
    if op == "next_call_extends":
        return engine.next_call_extends(payload)
    if op == "end_rollout":
        return engine.end_rollout()
    if op == "state_dict":
        return engine.state_dict()
    if op == "load_state_dict":
        return engine.load_state_dict(payload)
    raise ValueError(f"unknown request {op!r}")
