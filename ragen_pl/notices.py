"""What a run says at its start besides its progress: a one-line warning for a setup that runs but poorly (bf16 on a
CPU without bf16 instructions), and nothing of Lightning's advertisements. (A warm start taught another prompt layout:
:func:`ragen_pl.models.smollm2.warn_warm_layout`.)"""

from __future__ import annotations

import logging

__all__ = ["hide_lightning_tips", "warn_slow_precision"]


class _NoTips(logging.Filter):
    """Drops Lightning's advertisements ("💡 Tip: ... litlogger / litmodels") from a run's output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("\N{ELECTRIC LIGHT BULB} Tip")


def hide_lightning_tips() -> None:
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in logger.filters):
        logger.addFilter(_NoTips())


def warn_slow_precision(trainer) -> None:
    """bf16 on a CPU without bf16 instructions runs, but several times slower than float32: say so in one line."""
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.utilities import rank_zero_warn

    from ragen_pl.hardware import cpu_has_native_bf16

    precision = str(trainer.precision)
    if isinstance(trainer.accelerator, CPUAccelerator) and precision.startswith("bf16") and not cpu_has_native_bf16():
        rank_zero_warn(f"`--trainer.precision={precision}` on a CPU without bf16 instructions (avx512_bf16, "
                       f"amx_bf16) runs several times slower than float32 here; drop it (32-true) on this machine")
