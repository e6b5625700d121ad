"""Who this process is, and reductions over the processes of a run (torch.distributed's default group).

Every function here works without torch.distributed (one process): it then returns its input. Under DDP or FSDP each
call is collective, so every rank must make it at the same point.

torchmetrics' ``gather_all_tensors`` gathers the filter's per-trajectory statistics (ranks may hold different numbers
of trajectories: it pads and trims). Metrics do *not* go through torchmetrics' ``Metric`` aggregators: those reduce
one named metric at a time and need the same metrics on every rank, while a rank that played only some envs of a
run has no per-env metrics of the others (:func:`mean_over_ranks` reduces whatever each rank reports).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["gather_objects", "gather_rows", "is_sharded", "max_over_processes", "mean_over_ranks", "process_count", "process_rank",
           "sum_over_processes"]


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def process_rank() -> int:
    """This process's rank under torch.distributed, 0 without it. Engines offset their sampling seed by it, so that
    ranks sampling the same prompt (a Bandit's every group) draw different answers."""
    return dist.get_rank() if _active() else 0


def process_count() -> int:
    """The number of processes under torch.distributed, 1 without it."""
    return dist.get_world_size() if _active() else 1


def is_sharded(model) -> bool:
    """Whether ``model`` is an FSDP1 or FSDP2 root (its forward gathers parameters: a collective)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(model, (FullyShardedDataParallel, FSDPModule))


def sum_over_processes(t: Tensor) -> Tensor:
    """``t`` summed over every process (``t`` itself on one process)."""
    if process_count() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t


def max_over_processes(value: int, device: torch.device | str = "cpu") -> int:
    """The largest ``value`` over every process."""
    if process_count() == 1:
        return value
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gather_rows(t: Tensor, device: torch.device | str = "cpu") -> list[Tensor]:
    """Every process's ``t`` (the first dimension may differ between processes), in rank order, on the CPU.

    ``device`` is where the collective runs (NCCL needs CUDA tensors; gloo takes CPU ones).
    """
    if process_count() == 1:
        return [t]
    from torchmetrics.utilities.distributed import gather_all_tensors

    return [x.cpu() for x in gather_all_tensors(t.to(device))]


def gather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in rank order; ``[obj]`` on one process."""
    if process_count() == 1:
        return [obj]
    gathered: list = [None] * process_count()
    dist.all_gather_object(gathered, obj)
    return gathered


def mean_over_ranks(metrics: Mapping[str, float | Tensor], weights: Mapping[str, float], default_weight: float
                    ) -> dict[str, float]:
    """Each metric averaged over the processes that report it, each process weighted by what its value averages
    over (``weights[key]``, else ``default_weight``): one ``all_gather_object`` per call.

    Processes may report different metrics: one that played only some envs has no per-env metrics of the others.
    Lightning's ``sync_dist`` reduces key by key and needs the same keys in the same order on every process (else it
    pairs the wrong values, or hangs). On one process the metrics come back as they are, as floats.
    """
    mine = {k: float(v) for k, v in metrics.items()}
    world = process_count()
    if world == 1:
        return mine
    gathered = gather_objects((mine, {k: float(weights.get(k, default_weight)) for k in mine}))
    sums: dict[str, float] = defaultdict(float)
    total: dict[str, float] = defaultdict(float)
    for values, weight in gathered:
        for k, v in values.items():
            if weight[k] > 0:
                sums[k] += weight[k] * v
                total[k] += weight[k]
    keys = sorted({k for values, _ in gathered for k in values})  # the same order on every rank
    return {k: sums[k] / total[k] if total[k] > 0 else float("nan") for k in keys}
