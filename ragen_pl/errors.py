"""Errors that mean "the user's setup is wrong", which the CLI prints as one line instead of a traceback.

Anything else raised while training is a bug and keeps its full traceback (``RAGEN_PL_TRACEBACK=1`` also keeps it
for these).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting, env or plugin that cannot work as configured; the message names the field or component."""


class RolloutError(RuntimeError):
    """Every trajectory of a rollout failed (each env's own error is named); nothing is left to train or evaluate."""


__all__ = ["ConfigError", "RolloutError"]
