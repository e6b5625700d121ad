import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from ragen_pl.config import PPOConfig
from ragen_pl.losses import aggregate, kl_penalty, policy_loss, value_loss
from ragen_pl.scoring import entropy_from_logits, logprobs_from_logits


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_policy_loss_hand_derived_asymmetric_clip():
    # Four tokens, old logprob 0; ratios r = exp(lp) = [1.5, 1.5, 0.5, 0.5]; advantages [1, -1, 1, -1].
    # clip_low 0.2, clip_high 0.28: clip(r) = [1.28, 1.28, 0.8, 0.8]
    # per-token max(-A r, -A clip(r)):
    #   t0 A=+1: max(-1.5, -1.28) = -1.28 (clipped high)
    #   t1 A=-1: max( 1.5,  1.28) =  1.5
    #   t2 A=+1: max(-0.5, -0.8)  = -0.5
    #   t3 A=-1: max( 0.5,  0.8)  =  0.8  (clipped low)
    # token-mean = (-1.28 + 1.5 - 0.5 + 0.8) / 4 = 0.13
    lp = torch.log(_t([[1.5, 1.5, 0.5, 0.5]]))
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss(lp, torch.zeros(1, 4), _t([[1, -1, 1, -1]]), mask, 0.2, 0.28)
    assert_close(loss, torch.tensor(0.13))
    assert_close(m["loss/clipfrac_high"], torch.tensor(0.25))
    assert_close(m["loss/clipfrac_low"], torch.tensor(0.25))
    # approx_kl (k3 of ratio): mean(r - 1 - log r)
    expected_kl = sum(r - 1 - math.log(r) for r in (1.5, 1.5, 0.5, 0.5)) / 4
    assert_close(m["loss/approx_kl"], torch.tensor(expected_kl))


def test_dual_clip_bounds_negative_advantages():
    # r = 10, A = -1: plain PPO loss = max(10, 1.28) = 10; dual clip c = 3 caps it at 3.
    lp, mask = torch.log(_t([[10.0, 10.0]])), torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(lp, torch.zeros(1, 2), _t([[-1, 1]]), mask, dual_clip=3.0)
    # t1: A = +1, r = 10 -> max(-10, -1.28) = -1.28; mean = (3 - 1.28) / 2
    assert_close(loss, torch.tensor((3 - 1.28) / 2))
    assert_close(m["loss/clipfrac_dual"], torch.tensor(0.5))


def test_policy_gradient_matches_reinforce_at_ratio_one():
    # With logprobs == old_logprobs the PPO gradient is -A * grad(logprob) / N.
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = _t([[2.0, -1.0, 0.5]])
    loss, _ = policy_loss(lp, lp.detach(), adv, torch.ones(1, 3, dtype=torch.bool))
    loss.backward()
    assert_close(lp.grad, -adv / 3)


def test_aggregation_modes_hand_derived():
    loss = _t([[1, 2, 3], [4, 0, 0], [9, 9, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert_close(aggregate(loss, mask, "token-mean"), torch.tensor(10 / 4))
    assert_close(aggregate(loss, mask, "seq-mean-token-sum"), torch.tensor((6 + 4) / 2))  # empty row left out
    assert_close(aggregate(loss, mask, "seq-mean-token-mean"), torch.tensor((2 + 4) / 2))
    with pytest.raises(ValueError, match=r"`loss_agg` must be one of token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm, got 'mean'"):
        aggregate(loss, mask, "mean")  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(
    log_ratio=st.lists(st.floats(-3, 3), min_size=1, max_size=16),
    adv=st.floats(-5, 5),
    cl=st.floats(0.01, 0.9),
    ch=st.floats(0.01, 2),
)
def test_clipping_bounds_hold(log_ratio, adv, cl, ch):
    """The per-token objective -loss never exceeds A * clip(r): no incentive to move r beyond the bounds."""
    lr = torch.tensor([log_ratio], dtype=torch.float64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    a = torch.full_like(lr, adv)
    loss, _ = policy_loss(lr, torch.zeros_like(lr), a, mask, cl, ch, agg="seq-mean-token-sum")
    r = lr.exp()
    bound = torch.minimum(a * r, a * r.clamp(1 - cl, 1 + ch)).sum()
    assert float(-loss) <= float(bound) + 1e-9
    assert abs(float(-loss) - float(bound)) < 1e-9  # and equals the pessimistic bound exactly


def test_masked_tokens_do_not_matter():
    lp = _t([[-1.0, float("nan"), -0.3]])
    old = _t([[-1.2, float("inf"), -0.3]])
    mask = torch.tensor([[True, False, True]])
    loss, m = policy_loss(lp, old, _t([[1.0, 5.0, -1.0]]), mask)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())


def test_logprobs_and_entropy_from_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert_close(logprobs_from_logits(logits, labels), ref)
    p = torch.softmax(logits, -1)
    assert_close(entropy_from_logits(logits, chunk_size=4), -(p * p.log()).sum(-1))
    # Uniform logits: entropy log(V)
    assert_close(entropy_from_logits(torch.zeros(2, 8)), torch.full((2,), math.log(8)))
    # bf16 input gives float32 output
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_kl_estimators_hand_derived():
    lp, ref = _t([math.log(0.5)]), _t([math.log(0.25)])  # log r = log 2
    assert_close(kl_penalty(lp, ref, "k1"), _t([math.log(2)]))
    assert_close(kl_penalty(lp, ref, "k2"), _t([0.5 * math.log(2) ** 2]))
    assert_close(kl_penalty(lp, ref, "k3"), _t([0.5 - 1 + math.log(2)]))
    with pytest.raises(ValueError, match=r"`kl_estimator` must be one of k1, k2, k3, got 'k4'"):
        kl_penalty(lp, ref, "k4")  # type: ignore[arg-type]


def test_k3_is_unbiased_for_true_kl():
    # Sample from p, estimate KL(p || q) with k1 and k3: both unbiased.
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    true_kl = float((p * (p / q).log()).sum())
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, lq = p.log()[idx], q.log()[idx]
    assert abs(float(kl_penalty(lp, lq, "k3").mean()) - true_kl) < 0.01
    assert abs(float(kl_penalty(lp, lq, "k1").mean()) - true_kl) < 0.01
    assert float(kl_penalty(lp, lq, "k3").min()) >= 0


def test_value_loss_hand_derived():
    # V_old = 0, V = [1.0, 0.2], R = [0, 1], clip 0.5:
    # t0: unclipped (1-0)^2 = 1, clipped V' = 0.5 -> 0.25; max = 1   -> 0.5
    # t1: unclipped (0.2-1)^2 = 0.64, clipped V' = 0.2 -> 0.64; max = 0.64 -> 0.32
    loss, m = value_loss(_t([[1.0, 0.2]]), torch.zeros(1, 2), _t([[0.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool))
    assert_close(loss, torch.tensor((0.5 + 0.32) / 2))
    # V_old = 0, V = 1, R = 2: unclipped 1, clipped (0.5 - 2)^2 = 2.25 bigger -> clipped
    _, m = value_loss(_t([[1.0]]), torch.zeros(1, 1), _t([[2.0]]), torch.ones(1, 1, dtype=torch.bool))
    assert_close(m["loss/vf_clipfrac"], torch.tensor(1.0))


def test_loss_settings_are_checked_once_in_the_config():
    """The pure functions trust their arguments; the config refuses bad ones, naming the flag."""
    with pytest.raises(ValueError, match=r"`--model.ppo.clip_low` must be in \[0, 1\), got 1.5"):
        PPOConfig(clip_low=1.5)
    with pytest.raises(ValueError, match=r"`--model.ppo.dual_clip` must be > 1, got 0.5"):
        PPOConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match=r"`--model.ppo.value_clip` must be > 0, got 0"):
        PPOConfig(value_clip=0)


def test_dr_grpo_aggregation_hand_derived():
    from ragen_pl.losses import aggregate

    loss = _t([[1, 2, 3], [4, 0, 0], [9, 9, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # Dr. GRPO: each sequence's token sum over the constant budget 10, mean over the 2 sequences with tokens.
    assert_close(aggregate(loss, mask, "seq-mean-token-sum-norm", norm=10.0), torch.tensor((6 / 10 + 4 / 10) / 2))


def test_dr_grpo_advantage_is_the_group_centred_reward():
    from ragen_pl.advantages import DrGRPO
    from tests.helpers import make_batch

    # Group 0 scores 1, 0, 0 (mean 1/3); group 1 scores 2, 4 (mean 3). No std scaling.
    batch = make_batch([[0, 1, 1]] * 5, rewards=[[0, 0, 1], [0, 0, 0], [0, 0, 0], [0, 2, 0], [0, 0, 4]],
                       group_ids=[0, 0, 0, 1, 1])
    adv, _ = DrGRPO()(batch)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0])[:, None] * batch.loss_mask
    assert_close(adv, expected)


def test_gspo_hand_derived():
    """Two sequences; old log-probs 0. Sequence 0's tokens have log-ratios (0.2, 0.4): s_0 = exp(0.3); sequence 1's
    (-0.5): s_1 = exp(-0.5). With advantages +1 and -1 and the clip (1 - 0.1, 1 + 0.2):
      s_0 = 1.3499 > 1.2 and A > 0: clipped at 1.2 -> loss per token -1.2 (no gradient);
      s_1 = 0.6065 < 0.9 and A < 0: -A s = 0.6065 vs -A clip = 0.9: max is 0.9, clipped (no gradient).
    seq-mean-token-mean: (-1.2 + 0.9) / 2."""
    from ragen_pl.losses import GSPO, gspo

    lp = torch.tensor([[0.0, 0.2, 0.4], [0.0, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, 0.0]])
    loss, m = gspo(lp, torch.zeros(2, 3), adv, mask, clip_low=0.1, clip_high=0.2)
    assert_close(loss, torch.tensor((-1.2 + 0.9) / 2))
    assert float(m["loss/clipfrac_high"]) == 0.5 and float(m["loss/clipfrac_low"]) == 0.5
    loss.backward()
    assert_close(lp.grad, torch.zeros(2, 3))  # both clipped
    # Unclipped (wide range): loss = -mean_i A_i s_i, and d/d lp_t = -A_i s_i / |y_i| for each token of sequence i.
    lp.grad = None
    loss, _ = gspo(lp, torch.zeros(2, 3), adv, mask, clip_low=0.9, clip_high=9.0)
    s0, s1 = math.exp(0.3), math.exp(-0.5)
    assert_close(loss, torch.tensor((-s0 + s1) / 2))
    loss.backward()
    assert_close(lp.grad, torch.tensor([[0.0, -s0 / 2 / 2, -s0 / 2 / 2], [0.0, s1 / 2, 0.0]]))
    assert GSPO().aggregation(PPOConfig()) == "seq-mean-token-mean"


def test_dr_grpo_settings_go_together():
    with pytest.raises(ValueError, match=r"`--model.ppo.loss_agg_norm` is set exactly when"):
        PPOConfig(loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"`--model.ppo.loss_agg_norm` is set exactly when"):
        PPOConfig(loss_agg_norm=100)
    assert PPOConfig(loss_agg="seq-mean-token-sum-norm", loss_agg_norm=100).loss_agg_norm == 100
