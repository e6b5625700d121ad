"""What the machine computes fast: whether this CPU has native bfloat16 instructions; setting torch's threads.

bf16 autocast is a large speed-up where the CPU multiplies bf16 natively (AVX512-BF16, AMX) and a large slow-down
where it does not: on an AMD EPYC (Zen 3, AVX2 only) a SmolLM2-135M forward ran 5x slower under bf16 autocast than
in float32, while on one with avx512_bf16 ragen-pl's update of 16 SmolLM2 FrozenLake trajectories ran 1.9x faster
(787 against 417 tokens/s; ``python benchmarks/train_step.py --compare-only`` prints both on the machine at hand).
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["cpu_has_native_bf16", "set_torch_threads"]

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU lists a bfloat16 instruction set (Linux's /proc/cpuinfo), else oneDNN's own check."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        import torch

        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return any(flag in flags for flag in _BF16_FLAGS)


def set_torch_threads(n: int) -> None:
    """Set torch's intra-op threads to ``n`` through torch's own setter (``torch._C``): vLLM's CPU worker replaces
    ``torch.set_num_threads`` with a no-op for the rest of the process once it binds its threads, so a count set
    through it afterwards (``--torch_threads`` in a notebook or a test session that ran vLLM) was silently ignored."""
    import torch

    torch._C.set_num_threads(n)
