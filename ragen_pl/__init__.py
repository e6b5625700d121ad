"""ragen-pl: StarPO / RAGEN multi-turn RL for LLM agents on PyTorch Lightning.

Importing this package scans no entry points (:func:`ragen_pl.registry.load_plugins` does) and loads Lightning
and transformers only when ``RagenModule`` or ``RolloutDataModule`` is first touched.
"""

from typing import Any

from ragen_pl.advantages import Advantage
from ragen_pl.envs.base import Env
from ragen_pl.filters import Filter
from ragen_pl.rollout.engine import RolloutEngine
from ragen_pl.types import TrajectoryBatch

__version__ = "0.1.0"
__all__ = ["Advantage", "Env", "Filter", "RagenModule", "RolloutDataModule", "RolloutEngine", "TrajectoryBatch",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name == "RagenModule":
        from ragen_pl.module import RagenModule

        return RagenModule
    if name == "RolloutDataModule":
        from ragen_pl.data import RolloutDataModule

        return RolloutDataModule
    raise AttributeError(f"module 'ragen_pl' has no attribute {name!r}")
