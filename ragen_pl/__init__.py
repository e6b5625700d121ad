"""ragen-pl: StarPO / RAGEN multi-turn RL for LLM agents on PyTorch Lightning.

Importing this package scans no entry points; :func:`ragen_pl.registry.load_plugins` does.
"""

from ragen_pl.envs.base import Env

__version__ = "0.1.0"
__all__ = ["Env", "__version__"]
