import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_pl.filters import (
    AdaptiveVariance,
    DropZeroVariance,
    NoFilter,
    VarianceTopP,
    group_metric,
    select_groups,
)
from tests.helpers import make_batch


def batch_from_scores(scores: list[list[float]], lengths: list[list[int]] | None = None):
    """One group per inner list; each trajectory's score sits on its only sampled token."""
    G, n = len(scores), len(scores[0])
    T = 1 + max(max(r) for r in lengths) if lengths else 2
    mask, rewards = [], []
    for g in range(G):
        for i in range(n):
            L = lengths[g][i] if lengths else 1
            mask.append([0] + [1] * L + [0] * (T - 1 - L))
            rewards.append([0] * L + [scores[g][i]] + [0] * (T - 1 - L))
    return make_batch(mask, rewards=rewards, group_ids=[g for g in range(G) for _ in range(n)])


def test_variance_top_p_keeps_highest_std_groups():
    # stds: g0 [1,1] = 0, g1 [0,1] = 0.707, g2 [0,4] = 2.83, g3 [1,2] = 0.707
    b = batch_from_scores([[1, 1], [0, 1], [0, 4], [1, 2]])
    out = VarianceTopP(top_p=0.5)(b)
    # ceil(0.5 * 4) = 2 groups: g2, then the tie g1/g3 breaks to the lower id g1
    assert out.keep.tolist() == [False, False, True, True, True, True, False, False]
    assert float(out.metrics["filter/kept_frac"]) == 0.5
    stds = [0, math.sqrt(0.5), math.sqrt(8), math.sqrt(0.5)]
    assert float(out.metrics["filter/reward_std_before"]) == pytest.approx(sum(stds) / 4)
    assert float(out.metrics["filter/reward_std_after"]) == pytest.approx((stds[1] + stds[2]) / 2)


def test_reverse_and_other_modes():
    b = batch_from_scores([[1, 1], [0, 1], [0, 4], [1, 2]])
    assert VarianceTopP(top_p=0.25, reverse=True).select(b).tolist() == [True, False, False, False]
    assert VarianceTopP(mode="top_k", top_k=3).select(b).tolist() == [False, True, True, True]
    assert VarianceTopP(mode="min_value", min_value=1.0).select(b).tolist() == [False, False, True, False]
    assert VarianceTopP(rank_by="reward_mean", top_p=0.25).select(b).tolist() == [False, False, True, False]
    assert DropZeroVariance().select(b).tolist() == [False, True, True, True]
    assert NoFilter().select(b).tolist() == [True] * 4


def test_rank_by_length_and_entropy():
    b = batch_from_scores([[0, 0], [0, 0]], lengths=[[1, 3], [5, 5]])
    assert group_metric(b, "length").tolist() == [2.0, 5.0]
    assert VarianceTopP(rank_by="length", top_p=0.5).select(b).tolist() == [False, True]
    b.old_logprobs = torch.where(b.loss_mask, torch.tensor(-2.0), torch.tensor(-100.0))
    b.old_logprobs[:2] = torch.where(b.loss_mask[:2], -0.5, -100.0)
    assert group_metric(b, "sampled_nll").tolist() == [0.5, 2.0]
    b.old_logprobs = None
    with pytest.raises(ValueError, match="rank_by='sampled_nll' needs `old_logprobs`"):
        VarianceTopP(rank_by="sampled_nll").select(b)


@settings(max_examples=80, deadline=None)
@given(
    G=st.integers(1, 20),
    p=st.floats(0.01, 1.0),
    seed=st.integers(0, 1000),
)
def test_top_p_keeps_exactly_ceil_pg_groups(G, p, seed):
    stat = torch.rand(G, generator=torch.Generator().manual_seed(seed)).round(decimals=1)  # ties on purpose
    keep = select_groups(stat, "top_p", p)
    k = max(1, math.ceil(p * G - 1e-9))
    assert int(keep.sum()) == k
    # Every kept group ranks at least as high as every dropped one.
    if 0 < k < G:
        assert float(stat[keep].min()) >= float(stat[~keep].max())
    assert keep.tolist() == select_groups(stat.clone(), "top_p", p).tolist()  # deterministic


def test_paper_setting_8_groups_keeps_2():
    stat = torch.arange(8, dtype=torch.float64)
    assert select_groups(stat, "top_p", 0.25).nonzero().flatten().tolist() == [6, 7]


def test_adaptive_variance_rule():
    f = AdaptiveVariance(min_p=0.25, max_p=1.0, rel_threshold=0.5)
    # stds [4, 3, 0.1, 0]: informative (>= 2) = 2 of 4 -> keep 50%
    assert f.kept_share(torch.tensor([4.0, 3.0, 0.1, 0.0])) == 0.5
    # one dominant group: 1/8 informative, clamped up to min_p
    assert f.kept_share(torch.tensor([5.0] + [0.1] * 7)) == 0.25
    # evenly spread: everything informative
    assert f.kept_share(torch.tensor([1.0, 0.9, 0.8, 0.7])) == 1.0
    # no signal at all
    assert f.kept_share(torch.zeros(4)) == 0.25
    b = batch_from_scores([[0, 4], [0, 3], [1, 1.1], [2, 2]])
    assert f.select(b).tolist() == [True, True, False, False]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: VarianceTopP(top_p=0), r"`top_p` must be in \(0, 1\], got 0"),
        (lambda: VarianceTopP(top_p=1.5), r"`top_p` must be in \(0, 1\], got 1.5"),
        (lambda: VarianceTopP(mode="top_k"), r"`top_k` must be an integer >= 1 with mode='top_k', got None"),
        (lambda: VarianceTopP(mode="min_value"), r"`min_value` must be set with mode='min_value'"),
        (lambda: VarianceTopP(rank_by="std"), r"`rank_by` must be one of reward_std, .*got 'std'"),
        (lambda: VarianceTopP(mode="all"), r"`mode` must be one of top_p, top_k, min_value, got 'all'"),
        (lambda: AdaptiveVariance(min_p=0.6, max_p=0.5), r"need 0 < `min_p` <= `max_p` <= 1"),
        (lambda: DropZeroVariance(eps=-1), r"`eps` must be >= 0"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ------------------------------------------------------------------------ RAGEN-2's SNR-adaptive family
from ragen_pl.filters import SNR, group_scores, snr_select  # noqa: E402
from ragen_pl.types import TrajectoryStats  # noqa: E402

SCORES = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])  # one score per group (say, in-group reward std)


def kept(mask):
    return mask.nonzero().flatten().tolist()


@pytest.mark.parametrize("kwargs, expected", [
    # top_p linear: candidates .5 .2 .3 (zeros dropped), sum 1.0; threshold .9 - .01 = .89: .5, .8, 1.0 -> all three.
    (dict(strategy="top_p", value=0.9, include_zero=False), [0, 2, 3]),
    # threshold .5 - .01 = .49: the first, .5, reaches it.
    (dict(strategy="top_p", value=0.5, include_zero=False), [0]),
    # zeros as candidates change nothing here: the sum stays 1.0 and the walk stops at a score <= 0.
    (dict(strategy="top_p", value=0.9, include_zero=True), [0, 2, 3]),
    (dict(strategy="top_p", value=1.0, include_zero=False), [0, 2, 3]),  # value >= 1: every candidate
    (dict(strategy="top_p", value=1.0, include_zero=True), [0, 1, 2, 3, 4]),
    # softmax of (.5, .2, .3) = (.391, .289, .320); by mass .391 (g0), .320 (g3): cumulative .391, .711 >= .5.
    (dict(strategy="top_p", value=0.5, top_p_mode="softmax", include_zero=False), [0, 3]),
    # smallest first: softmax of (-.5, -.2, -.3) = (.279, .377, .344): g2 .377, g3 .344 -> .721 >= .5.
    (dict(strategy="top_p", value=0.5, top_p_mode="softmax", keep="smallest", include_zero=False), [2, 3]),
    (dict(strategy="top_k", value=0.4), [0, 3]),  # int(.4 * 5) = 2
    (dict(strategy="top_k", value=0.1), [0]),  # int(.5) = 0 -> at least 1
    (dict(strategy="top_k", value=0.4, keep="smallest"), [1, 4]),  # ties at 0: lower ids first
    (dict(strategy="top_k_abs", value=1), [0]),
    (dict(strategy="top_k_abs", value=9, include_zero=False), [0, 2, 3]),  # at most the candidates
    (dict(strategy="min_p", value=0.5), [0, 3]),  # >= .5 * .5
    (dict(strategy="min_p", value=0.5, keep="smallest", include_zero=False), [2, 3]),  # <= .2 / .5
])
def test_snr_select_hand_derived(kwargs, expected):
    assert kept(snr_select(SCORES, **kwargs)) == expected


def test_linear_top_p_keeps_nothing_when_the_threshold_is_out_of_reach():
    # every score 0: threshold .9 * 0 - .01 < 0 is met at once with nothing taken: RAGEN-2 skips the step.
    assert kept(snr_select(torch.zeros(4), "top_p", 0.9)) == []
    assert kept(snr_select(torch.zeros(4), "top_k", 0.5, include_zero=False)) == []  # no candidate at all


def test_group_scores_hand_derived():
    # Groups 0 and 1 of three trajectories: rewards (1, 0, 0) and (2, 2, 5); lengths, entropies given.
    stats = TrajectoryStats(scores=torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0]), group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
                            lengths=torch.tensor([3, 5, 7, 2, 2, 2]), entropy=torch.tensor([1.0, 1.0, 4.0, 0.5, 0.5, 0.5]))
    torch.testing.assert_close(group_scores(stats, "reward_variance"),
                               torch.tensor([(1 / 3) ** 0.5, 3 ** 0.5], dtype=torch.float64))  # unbiased std
    torch.testing.assert_close(group_scores(stats, "reward"), torch.tensor([1 / 3, 3.0], dtype=torch.float64))
    torch.testing.assert_close(group_scores(stats, "reward_sum"), torch.tensor([1.0, 9.0], dtype=torch.float64))
    torch.testing.assert_close(group_scores(stats, "sampled_nll"), torch.tensor([2.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(group_scores(stats, "sampled_nll_variance"), torch.tensor([3 ** 0.5, 0.0],
                                                                                      dtype=torch.float64))
    torch.testing.assert_close(group_scores(stats, "length"), torch.tensor([5.0, 2.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"`metric: sampled_nll` needs the rollout's log-probs"):
        group_scores(TrajectoryStats(stats.scores, stats.group_ids, stats.lengths), "sampled_nll")


def test_snr_loss_scaling_and_settings():
    assert SNR(loss_scaling="linear").loss_scale(0.25) == 0.25
    assert SNR(loss_scaling="sqrt").loss_scale(0.25) == 0.5
    assert SNR().loss_scale(0.25) == 1.0
    with pytest.raises(ValueError, match=r"`--data.filter.value` must be in \(0, 1\] for top_k, got 2"):
        SNR(strategy="top_k", value=2)
    with pytest.raises(ValueError, match=r"`--data.filter.value` must be a whole number >= 1 for top_k_abs, got 0.5"):
        SNR(strategy="top_k_abs", value=0.5)
    with pytest.raises(ValueError, match=r"`--data.filter.strategy` must be one of top_p, top_k, top_k_abs, min_p"):
        SNR(strategy="nucleus")


def test_loss_scaling_scales_the_advantages():
    from ragen_pl.advantages import GRPO
    from ragen_pl.policy import Models
    from ragen_pl.update import StarPOUpdate
    from tests.helpers import make_batch

    def advantages(scale):
        batch = make_batch([[0, 1, 1], [0, 1, 1]], rewards=[[0, 0, 1], [0, 0, 0]], group_ids=[0, 0],
                           old_logprobs=[[0, -1, -1], [0, -1, -1]])
        batch.loss_scale = scale
        StarPOUpdate(GRPO(scale="none")).prepare(batch, Models(torch.nn.Identity()))  # nothing to score here
        return batch.advantages

    torch.testing.assert_close(advantages(0.25), 0.25 * advantages(1.0))


def test_the_nll_metrics_are_named_for_what_they_are():
    """RAGEN-2's `entropy` metrics read the exact token entropy; these read the sampled tokens' negative
    log-likelihood, so they carry its name, and RAGEN-2's names are refused rather than silently meaning another
    figure."""
    from ragen_pl.filters import SNR

    for name in ("entropy", "entropy_variance"):
        with pytest.raises(ValueError, match=r"`--data.filter.metric` must be one of .*sampled_nll.*got '" + name):
            SNR(metric=name)
    with pytest.raises(ValueError, match=r"`rank_by` must be one of reward_std, reward_mean, length, sampled_nll"):
        VarianceTopP(rank_by="entropy")
