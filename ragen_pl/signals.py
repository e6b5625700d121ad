"""How a run stops on SIGTERM (``timeout``, a cluster's pre-emption): at once, even mid-rollout."""

from __future__ import annotations

import os
import signal

__all__ = ["Terminated", "stop_on_sigterm"]


class Terminated(BaseException):
    """SIGTERM arrived (``timeout``, a cluster's pre-emption): the run stops where it is.

    A ``BaseException``, so no ``except Exception`` in a plugin or library swallows it; Lightning runs its
    ``on_exception`` hooks and tears down. Checkpoints are written atomically, so the last one stays whole.
    """


def stop_on_sigterm():
    """Make SIGTERM stop a run at once; return the handler it replaced (None off the main thread).

    Lightning's own SIGTERM handler only notes the signal and lets the step run on (a long rollout then ignores
    ``timeout`` and needs SIGKILL). Lightning calls the handler that was there before its own, so this one still
    runs inside ``fit``: the first SIGTERM raises :class:`Terminated`; a second one (Lightning may have put this
    handler back while tearing down) ends the process at once with the default action.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    received = []

    def handler(signum, frame):
        if received:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        received.append(signum)
        raise Terminated()

    return signal.signal(signal.SIGTERM, handler)
