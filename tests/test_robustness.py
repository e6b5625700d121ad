"""Numerical robustness that verl has (issue 11): clamped log-ratios, k3 KL at -inf, GRPO/RLOO groups with an
empty row, and advantage whitening over the global batch when several processes train."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from ragen_pl.advantages import GAE, GRPO, RLOO
from ragen_pl.losses import kl_penalty, policy_loss
from ragen_pl.ops import masked_whiten
from tests.helpers import make_batch, random_batch


def test_policy_loss_clamps_the_log_ratio():
    # log-ratio 99.9 on a token with negative advantage: exp(99.9) overflows float32 to inf without the clamp.
    logprobs, old = torch.tensor([[0.0, -0.1]]), torch.tensor([[-99.9, -0.1]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = policy_loss(logprobs, old, torch.tensor([[-1.0, 1.0]]), mask, 0.2, 0.28)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    # Clamped at 20: token 0's unclipped loss is -A * e^20 = e^20 (the max with the clipped term), token 1's -1.
    assert_close(loss, torch.tensor((torch.exp(torch.tensor(20.0)).item() - 1.0) / 2))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_is_finite_for_an_impossible_token(kind):
    kl = kl_penalty(torch.tensor([float("-inf"), -1.0]), torch.tensor([-2.0, -1.0]), kind)
    assert torch.isfinite(kl).all()
    assert kl[1] == 0.0
    if kind == "k3":  # log r clamped to -20: 1/r - 1 + log r = e^20 - 21, then k3's own clamp to 10
        assert kl[0] == 10.0


@pytest.mark.parametrize("estimator", [GRPO(), RLOO()], ids=["grpo", "rloo"])
def test_group_of_two_with_an_empty_row(estimator):
    """A row without sampled tokens leaves its group-mate alone: advantage 0 for both, no error."""
    b = make_batch([[0, 1, 1], [0, 0, 0], [0, 1, 1], [0, 1, 0]], rewards=[[0, 0, 1], [0, 0, 0], [0, 0, 3], [0, 2, 0]],
                   group_ids=[0, 0, 1, 1])
    adv, _ = estimator(b)
    assert adv[:2].abs().sum() == 0
    assert adv[2].abs().sum() > 0 and adv[3].abs().sum() > 0  # the full group still gets its signal


def _whiten_worker(rank: int, world: int, init: str, x: torch.Tensor, mask: torch.Tensor, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        half = x.shape[0] // world
        part = slice(rank * half, (rank + 1) * half)
        torch.save(masked_whiten(x[part], mask[part]), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_whitening_over_two_processes_equals_one_process(tmp_path):
    b = random_batch(6, 20, seed=3)
    x, mask = b.values, b.loss_mask
    mask[:3] &= torch.rand(3, 20, generator=torch.Generator().manual_seed(1)) < 0.3  # ranks with unequal counts
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_whiten_worker, args=(2, init, x, mask, str(tmp_path / "out")), nprocs=2, join=True)
    parts = torch.cat([torch.load(tmp_path / f"out.{r}") for r in range(2)])
    assert_close(parts, masked_whiten(x, mask))
    assert not torch.allclose(torch.cat([masked_whiten(x[:3], mask[:3]), masked_whiten(x[3:], mask[3:])]), parts)


def test_gae_whitening_unchanged_in_one_process():
    b = random_batch(4, 16, seed=0)
    adv, _ = GAE(whiten=True)(b)
    valid = adv[b.loss_mask]
    assert abs(float(valid.mean())) < 1e-5 and abs(float(valid.std()) - 1) < 1e-3
