"""Masked reductions and group statistics shared by advantages, losses, filters and reward normalisation.

Pure tensor functions over token-aligned ``(B, T)`` tensors (see :mod:`ragen_pl.types`) or per-trajectory ``(B,)``
vectors. ``masked_whiten`` is the only one that talks to other processes (its statistics are the global batch's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ragen_pl.dist import sum_over_processes

__all__ = ["group_stats", "last_true", "masked_mean", "masked_whiten"]


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is true (0 where nothing is valid)."""
    x = torch.where(mask.bool(), x, 0.0)  # not x * mask: nan * 0 is nan
    count = mask.to(x.dtype)
    if dim is None:
        return x.sum() / count.sum().clamp(min=1)
    return x.sum(dim) / count.sum(dim).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean and unit (unbiased) variance over the valid positions; zeros elsewhere.

    The same rule as verl's ``masked_whiten``, which RAGEN uses. Under several processes (DDP, FSDP) the mean and
    variance are those of the *global* batch (sums all-reduced over the default process group), so N processes
    give the advantages one process would; every process must call it, as the estimators are in each update.
    """
    valid = torch.where(mask, x, 0.0).double()
    first = sum_over_processes(torch.stack([valid.sum(), mask.sum().double()]))
    total, n = first[0], first[1]
    mean = total / n.clamp(min=1)
    squares = sum_over_processes(torch.where(mask, (x.double() - mean) ** 2, 0.0).sum())
    var = squares / (n - 1).clamp(min=1)
    out = (x.double() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return (out * mask).to(x.dtype)


def group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-trajectory mean, unbiased std and size of its group. All three are (B,).

    Groups of one have std 0.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    G = int(inverse.max()) + 1 if inverse.numel() else 0
    scores = scores.to(torch.float64)  # the sums of squares below lose precision in float32
    count = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, inverse, scores)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, inverse, (scores - mean[inverse]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return mean[inverse], std[inverse], count[inverse]


def last_true(mask: Tensor) -> Tensor:
    """(B,) index of the last true position of each row of ``mask`` (B, T) (0 if none)."""
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, pos, -1).max(-1).values.clamp(min=0)
