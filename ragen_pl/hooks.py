"""Model hooks (``--model.hooks``, entry-point group ``ragen_pl.model_hooks``): change the models a run builds.

A hook is the extension point for what a plugin does to the policy itself: wrap or replace modules after the model is
loaded (and after LoRA adapters are added), build the value head that sits on the policy's trunk
(``--model.critic=shared``), and hold a context around every merge of LoRA adapters into the weights (the weights a
rollout engine receives, ``ragen-pl export``), for a hook whose modules must present plain LoRA weights then.

Hooks are saved in the checkpoint (class path and constructor arguments), so ``ragen-pl export`` and a resumed run
rebuild the same modules before loading the weights. ``ragen_pl_experiments.readout`` is a complete example.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["ModelHook", "hooks_from_hparams"]


class ModelHook:
    """Does nothing by default: override what the plugin needs. Keep constructor arguments plain (numbers, strings,
    lists of them), stored as attributes of the same names, so that the checkpoint can rebuild the hook."""

    def after_load(self, policy: nn.Module, tokenizer: Any) -> nn.Module:
        """The policy to train, given the loaded one (with its LoRA adapters, if any) and its tokenizer."""
        return policy

    def value_head(self, hidden_size: int) -> nn.Module | None:
        """A value head on the policy's last hidden state (``(..., hidden_size) -> (..., 1)``, with a ``weight``
        parameter), or None for the default: a linear head that starts at 0. Asked only with
        ``--model.critic=shared``; at most one hook may build it."""
        return None

    @contextmanager
    def merging(self, policy: nn.Module) -> Iterator[None]:
        """Held while LoRA adapters are merged into the weights and unmerged again."""
        yield


def hooks_from_hparams(hparams: dict[str, Any]) -> list[ModelHook]:
    """The hooks a checkpoint's ``hyper_parameters`` recorded (``hooks``: class paths and constructor arguments)."""
    from ragen_pl.registry import import_class_path

    return [import_class_path(saved["class_path"])(**(saved.get("init_args") or {}))
            for saved in hparams.get("hooks") or []]
