"""Text environments. Each env is registered in the ``ragen_pl.envs`` entry-point group."""

from ragen_pl.envs.base import Env

__all__ = ["Env"]
