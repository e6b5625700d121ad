"""Rollouts played ahead of the update, with bounded staleness (``--data.max_staleness=K``).

With K = 0 ragen-pl plays a rollout, then updates on it. With K >= 1 a background thread of the trainer's process
plays the rollouts of the next K iterations while the current one updates; the engine samples from its *own* copy of
the weights (``holds_weights``: ``process``, ``vllm``), so the update never changes what a rollout in flight samples
with.

The schedule, at the start of training step t (the trainer's weights are then version t: t updates done):

1. take rollout t (wait for it if it is still playing);
2. queue rollout t + K, which may sample with weights no older than version t;
3. if a queued rollout needs newer weights than the engine holds, wait until the engine is between rollouts and
   write version t into it (never during a rollout: each rollout samples with one version).

With one engine and K = 1, step 3 writes after every rollout: rollout t + 1 samples with version t while update t
runs, exactly one update old; the trainer waits only for what the rollout takes beyond the update. Every decision
depends on the step and K alone, never on timing, so every rank syncs at the same steps (a sharded policy's weight
gather is collective) and a resumed run replays the same schedule. Filtering, failure counting and padding, the
parts with collectives, run on the trainer's thread (:meth:`ragen_pl.data.RolloutDataModule.finish_rollout`).

The trajectories of a rollout carry the version that sampled them (``TrajectoryBatch.policy_versions``); the update
recomputes log-probs with the current weights (the *proximal* policy) and its PPO ratio is taken against them, while
the engine's log-probs are the *behaviour* policy's: TIS / MIS weigh by proximal / behaviour (AReaL's decoupled
objective, with the behaviour weight truncated), so ``max_staleness`` requires ``--model.ppo.tis_cap`` or ``mis_bound``.

A checkpoint waits for the rollouts in flight and keeps them (batch, metrics, version); a resumed run trains on them
first, so none is trained twice or lost, and the sampling state saved is the one after them.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from torch import Tensor

from ragen_pl.rollout.collector import RolloutResult
from ragen_pl.types import TrajectoryBatch


@dataclass
class Played:
    """One rank's rollout of one training iteration, before filtering."""

    iteration: int
    """The training iteration (env seed counter) it plays."""
    batch: TrajectoryBatch | None
    metrics: dict[str, Tensor]
    failures: list[tuple[str, int, str]]
    """(env tag, seed, reason) of every failed episode."""
    played: int
    """Episodes played, failed ones included."""
    result: RolloutResult | None = None
    """The full rollout (None once restored from a checkpoint)."""
    version: int | None = None
    """The trainer step whose weights sampled it (None: on-policy, the synchronous loop)."""
    waited: float = 0.0
    """Seconds the trainer waited for it."""
    step: int | None = None
    """The training step that took it."""
    empty_filters_before: int = 0

    def state(self) -> dict[str, Any]:
        """Plain values (tensors, numbers, strings), as a checkpoint loaded with ``weights_only`` takes them."""
        batch = None
        if self.batch is not None:
            batch = {f.name: getattr(self.batch, f.name) for f in fields(TrajectoryBatch)}
            batch["env_tags"] = list(batch["env_tags"])
        return {"iteration": self.iteration, "batch": batch, "metrics": dict(self.metrics),
                "failures": [list(f) for f in self.failures], "played": self.played, "version": self.version}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Played:
        batch = None
        if state["batch"] is not None:
            batch = TrajectoryBatch(**{**state["batch"], "env_tags": tuple(state["batch"]["env_tags"])})
        return cls(state["iteration"], batch, dict(state["metrics"]), [tuple(f) for f in state["failures"]],
                   state["played"], version=state["version"])


@dataclass
class _Job:
    iteration: int
    min_version: int
    done: threading.Event = field(default_factory=threading.Event)
    played: Played | None = None
    error: BaseException | None = None
    engine_state: dict | None = None
    """The engine's sampling state before this rollout (what a checkpoint keeps if the rollout failed)."""


class RolloutsAhead:
    """The background rollouts of a :class:`~ragen_pl.data.RolloutDataModule` (see the module docstring)."""

    def __init__(self, play: Callable[[int], Played], sync: Callable[[], None], engine, max_staleness: int,
                 first_iteration: int) -> None:
        """
        Args:
            play: plays training iteration i on this rank with the engine's current weights (no collective).
            sync: writes the trainer's current weights into the engine (the trainer's thread; may be collective).
            engine: the rollout engine (its sampling state is checkpointed between rollouts).
            max_staleness: K >= 1.
            first_iteration: the next iteration to play (the data module's seed counter).
        """
        self._play, self._sync, self.engine, self.k = play, sync, engine, max_staleness
        self.next_iteration = first_iteration
        self.engine_step: int | None = None
        """The trainer step whose weights the engine holds (None: none handed over yet)."""
        self._jobs: deque[_Job] = deque()
        self._todo: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._engine = threading.Lock()  # held while a rollout samples, and while weights are written
        self._closed = False
        self._failed: _Job | None = None
        self._thread = threading.Thread(target=self._run, name="ragen-pl-rollouts-ahead", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- the trainer's side
    def take(self, step: int) -> Played:
        """Rollout ``step`` (queued if it is not), waiting for it; its errors surface here."""
        if not self._jobs:
            self._submit(step)
        job = self._jobs[0]
        t0 = time.perf_counter()
        job.done.wait()
        self._jobs.popleft()
        if job.error is not None:
            self._failed = job
            raise job.error
        played = job.played
        played.waited = time.perf_counter() - t0
        return played

    def refill(self, step: int) -> None:
        """Queue the rollouts up to ``step + K``, handing the engine version ``step`` first where one needs it."""
        while self.next_iteration <= step + self.k:
            self._submit(step)

    def _submit(self, step: int) -> None:
        i = self.next_iteration
        job = _Job(i, min_version=max(0, i - self.k))
        if self.engine_step is None or self.engine_step < job.min_version:
            with self.engine_idle():  # every rollout before it has played
                self._sync()
                self.engine_step = step
        self.next_iteration += 1
        self._jobs.append(job)
        with self._cond:
            self._todo.append(job)
            self._cond.notify_all()

    @contextmanager
    def engine_idle(self) -> Iterator[None]:
        """Within: no rollout samples (the queued ones wait). Waits for every queued rollout to finish first, so
        that what runs within (a weight write, an evaluation) never reorders the sampling stream."""
        self.drain()
        with self._engine:
            yield

    def drain(self) -> list[_Job]:
        """Wait for every rollout in flight; the jobs, oldest first (for a checkpoint)."""
        for job in self._jobs:
            job.done.wait()
        return list(self._jobs)

    def state(self, wait: bool = True) -> dict[str, Any]:
        """What a checkpoint keeps: the rollouts played ahead (in order) and where the sampling stream stands.

        ``wait``: first let the rollouts in flight finish (a periodic checkpoint: the resumed run continues exactly).
        Without it (a run that stops now) the first unfinished rollout and everything after it are left out, and the
        stream goes back to before it: the resumed run plays them again, with the weights it resumes with. A rollout
        that failed is left out the same way."""
        if self._failed is not None:  # (the engine may be gone with it: a dead rollout process)
            return {"ahead": [], "iteration": self._failed.iteration, "engine": self._failed.engine_state}
        jobs = self.drain() if wait else list(self._jobs)
        kept = []
        for job in jobs:
            if job.done.is_set() and job.error is None:
                kept.append(job.played.state())
                continue
            # Unfinished or failed: the stream goes back to before it (not started: to where the engine stands).
            return {"ahead": kept, "iteration": job.iteration, "engine": job.engine_state or self._engine_state(job)}
        return {"ahead": kept, "iteration": self.next_iteration, "engine": self._engine_state()}

    def _engine_state(self, job: _Job | None = None) -> dict:
        """The engine's sampling state between two rollouts (before ``job``, had it started while this waited)."""
        with self._engine:
            return (job.engine_state if job is not None else None) or copy.deepcopy(self.engine.state_dict())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)  # a rollout under way ends on its own (a daemon thread)

    # ---------------------------------------------------------------------------- the background thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._todo and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._todo.popleft()
            try:
                with self._engine:
                    job.engine_state = copy.deepcopy(self.engine.state_dict())
                    if self.engine_step is None or self.engine_step < job.min_version:
                        raise RuntimeError(f"rollout {job.iteration} would sample with the weights of step "
                                           f"{self.engine_step}, older than --data.max_staleness={self.k} allows")
                    version = self.engine_step
                    played = self._play(job.iteration)
                played.version = version
                job.played = played
            except BaseException as err:  # noqa: BLE001 - re-raised on the trainer's thread by take()
                job.error = err
            finally:
                job.done.set()
