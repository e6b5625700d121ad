"""How a run stops on SIGTERM (``timeout``, a cluster's pre-emption) or SIGINT (Ctrl-C): at once, even mid-rollout,
but never between an update's first optimiser step and the end of its iteration.

A rollout or an evaluation changes nothing a checkpoint keeps but the data module's seed counter and sampling state,
which :meth:`ragen_pl.data.RolloutDataModule.rewind_unfinished_rollout` puts back; so a signal there stops the run at
once, and :class:`ragen_pl.checkpoint.RunCheckpoint` saves the last completed iteration. The update changes the
weights step by step, so from the end of the rollout to the end of the iteration (:func:`defer_stop` ...
:func:`allow_stop`) a signal only marks the stop, which then happens with the iteration complete.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["Terminated", "allow_stop", "defer_stop", "stop_on_signals", "stop_received"]


class Terminated(BaseException):
    """SIGTERM or SIGINT arrived: the run stops (``signum`` says which).

    A ``BaseException``, so no ``except Exception`` in a plugin or library swallows it; Lightning runs its
    ``on_exception`` hooks (the last completed iteration's checkpoint) and tears down.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _State:
    received: int | None = None
    deferring: bool = False
    pending: bool = False


_STATE = _State()  # the process's signal handler state (signals are per process)


def _handler(signum, frame) -> None:
    if _STATE.received is not None:  # a second signal: the default action, now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _STATE.received = signum
    if _STATE.deferring:
        _STATE.pending = True
        return
    raise Terminated(signum)


def defer_stop() -> None:
    """From here until :func:`allow_stop`, a stop signal is only noted (the iteration's update is under way)."""
    _STATE.deferring = True


def allow_stop() -> None:
    """End of the deferred stretch: a signal noted during it stops the run now (:class:`Terminated`)."""
    _STATE.deferring = False
    if _STATE.pending:
        _STATE.pending = False
        raise Terminated(_STATE.received or signal.SIGTERM)


def stop_received() -> int | None:
    """The signal that asked this run to stop, if one did."""
    return _STATE.received


def stop_on_signals() -> dict[int, object]:
    """Install the handler for SIGTERM and SIGINT; return the handlers it replaced (none off the main thread).

    Lightning's own SIGTERM handler only notes the signal and lets the step run on (a long rollout then ignores
    ``timeout`` and needs SIGKILL). Lightning calls the handler that was there before its own, so this one still
    runs inside ``fit``.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    _STATE.received, _STATE.deferring, _STATE.pending = None, False, False
    return {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
