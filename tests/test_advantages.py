import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from ragen_pl.advantages import (
    GAE,
    GRPO,
    RLOO,
    BiLevelGAE,
    GiGPO,
    ReinforcePP,
    bilevel_gae,
    gae,
    grpo,
    masked_whiten,
    reinforce_pp,
    rloo,
)
from tests.helpers import make_batch, random_batch, split_into_turn_rows


# ------------------------------------------------------------------------ plain reference loops
def gae_reference(rewards, values, mask, gamma, lam):
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        last = 0.0
        for i in reversed(range(len(idx))):
            t = idx[i]
            nv = float(values[b, idx[i + 1]]) if i + 1 < len(idx) else 0.0
            delta = float(rewards[b, t]) + gamma * nv - float(values[b, t])
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv


def bilevel_reference(rewards, values, mask, ends, gt, lt, gk, lk):
    """RAGEN's compute_bi_level_gae_advantage_return, written per trajectory with Python floats."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        eos = [t for t in range(T) if ends[b, t]]
        updated = [float(x) for x in rewards[b]]
        last = 0.0
        turn_adv = {}
        for i in reversed(range(len(eos))):
            nv = float(values[b, eos[i + 1]]) if i + 1 < len(eos) else 0.0
            delta = updated[eos[i]] + gt * nv - float(values[b, eos[i]])
            last = delta + gt * lt * last
            turn_adv[eos[i]] = last
        for p, a in turn_adv.items():
            updated[p] = a + float(values[b, p])
        valid = [t for t in range(T) if mask[b, t]]
        last = 0.0
        for i in reversed(range(len(valid))):
            t = valid[i]
            if t in turn_adv:
                nv, last = 0.0, 0.0
            else:
                nv = float(values[b, valid[i + 1]])
            delta = updated[t] + gk * nv - float(values[b, t])
            last = delta + gk * lk * last
            adv[b, t] = last
    return adv


# ------------------------------------------------------------------------------- hand-derived cases
def test_gae_hand_derived_skips_env_tokens():
    # One trajectory: sampled, env, sampled, sampled.  mask = [1, 0, 1, 1]
    # values        = [0.5, 9, 0.2, 0.4]   (9 at the env token must be ignored)
    # rewards       = [0.1, 7, 0, 1.0]     (7 at the env token must be ignored)
    # gamma = 0.9, lam = 0.8. Backwards over the valid tokens t = 3, 2, 0:
    # t=3: delta = 1.0 + 0.9*0 - 0.4 = 0.6;                 A3 = 0.6
    # t=2: delta = 0 + 0.9*0.4 - 0.2 = 0.16;                A2 = 0.16 + 0.72*0.6 = 0.592
    # t=0: delta = 0.1 + 0.9*0.2 - 0.5 = -0.22;             A0 = -0.22 + 0.72*0.592 = 0.20624
    b = make_batch([[1, 0, 1, 1]], rewards=[[0.1, 7, 0, 1.0]], values=[[0.5, 9, 0.2, 0.4]])
    adv, ret = gae(b.rewards, b.values, b.loss_mask, gamma=0.9, lam=0.8)
    assert_close(adv, torch.tensor([[0.20624, 0.0, 0.592, 0.6]]))
    assert_close(ret, torch.tensor([[0.70624, 0.0, 0.792, 1.0]]))


def test_bilevel_gae_hand_derived():
    # Two turns: tokens [s s | env | s s], turn 0 = t0,t1 (end t1), turn 1 = t3,t4 (end t4).
    # rewards: r(t1) = 1, r(t4) = 2. values = [0.1, 0.2, 5, 0.3, 0.4]. gamma_turn=0.5, lam_turn=1, token gamma=lam=1.
    # Turn level: k=1: delta = 2 + 0 - 0.4 = 1.6, A = 1.6, G1 = 2.0
    #             k=0: delta = 1 + 0.5*0.4 - 0.2 = 1.0, A = 1.0 + 0.5*1.6 = 1.8, G0 = 2.0
    # Token level: t4: A = G1 - V = 1.6; t3: delta = 0 + 0.4 - 0.3 = 0.1, A = 0.1 + 1.6 = 1.7
    #              t1: A = G0 - V = 1.8; t0: delta = 0 + 0.2 - 0.1 = 0.1, A = 0.1 + 1.8 = 1.9
    b = make_batch(
        [[1, 1, 0, 1, 1]], rewards=[[0, 1, 0, 0, 2]], values=[[0.1, 0.2, 5, 0.3, 0.4]], turn_ids=[[0, 0, -1, 1, 1]]
    )
    assert b.turn_ends.tolist() == [[False, True, False, False, True]]
    adv, ret = bilevel_gae(b.rewards, b.values, b.loss_mask, b.turn_ends, gamma_turn=0.5)
    assert_close(adv, torch.tensor([[1.9, 1.8, 0.0, 1.7, 1.6]]))
    assert_close(ret, torch.tensor([[2.0, 2.0, 0.0, 2.0, 2.0]]))


def test_grpo_hand_derived():
    # Group 0 scores [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.866025
    # Group 1 scores [2, 4]: mean 3, std sqrt(2) -> -+0.707107
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    a, c = 0.5 / math.sqrt(1 / 3), 1 / math.sqrt(2)
    assert_close(grpo(scores, ids, eps=0.0), torch.tensor([a, -a, -a, a, -c, c]))
    assert_close(grpo(scores, ids, scale="none"), torch.tensor([0.5, -0.5, -0.5, 0.5, -1.0, 1.0]))
    batch_std = scores.std()
    assert_close(grpo(scores, ids, scale="batch", eps=0.0),
                 torch.tensor([0.5, -0.5, -0.5, 0.5, -1.0, 1.0]) / batch_std)


def test_group_of_one_is_an_error_for_the_math_and_zero_in_the_estimator():
    with pytest.raises(ValueError, match=r"`group_ids`: GRPO needs at least 2 trajectories per group, got groups "
                                         r"of size 1 \(ids \[7\]\); set `data.group_size` >= 2"):
        grpo(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([7, 8, 8]))
    with pytest.raises(ValueError, match=r"`group_ids`: RLOO needs at least 2"):
        rloo(torch.tensor([3.0]), torch.tensor([0]))
    # In a batch, a trajectory left alone (its group-mates failed) or a padding row gets advantage 0;
    # group 8 = [1, 2]: mean 1.5, std sqrt(0.5) -> -+0.5/sqrt(0.5).
    b = make_batch([[1, 1], [1, 0], [1, 1], [0, 0]], rewards=[[0, 3], [1, 0], [0, 2], [0, 0]], group_ids=[7, 8, 8, 8])
    adv, _ = GRPO()(b)
    r = 0.5 / math.sqrt(0.5) / (1 + 1e-6 / math.sqrt(0.5))
    assert_close(adv, torch.tensor([[0, 0], [-r, 0], [r, r], [0, 0]]), atol=1e-5, rtol=1e-5)


def test_rloo_hand_derived():
    # Group [1, 2, 6]: leave-one-out baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5 -> [-3, -1.5, 4.5]
    assert_close(rloo(torch.tensor([1.0, 2.0, 6.0, 5.0, 1.0]), torch.tensor([0, 0, 0, 1, 1])),
                 torch.tensor([-3.0, -1.5, 4.5, 4.0, -4.0]))


def test_reinforce_pp_hand_derived():
    # mask [1, 0, 1], rewards [0, 9, 2], gamma 0.5 -> returns over valid tokens [0 + 0.5*2, -, 2] = [1, 2]
    # whiten [1, 2]: mean 1.5, unbiased var 0.5 -> [-0.7071, 0.7071]
    b = make_batch([[1, 0, 1]], rewards=[[0, 9, 2]])
    out = reinforce_pp(b.rewards, b.loss_mask, gamma=0.5)
    s = 1 / math.sqrt(0.5 + 1e-8)
    assert_close(out, torch.tensor([[-0.5 * s, 0.0, 0.5 * s]]))


# ---------------------------------------------------------------------------- against the loops
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_matches_reference_loop(seed, gamma, lam):
    b = random_batch(6, 40, seed=seed)
    adv, _ = gae(b.rewards, b.values, b.loss_mask, gamma, lam)
    assert_close(adv.double(), gae_reference(b.rewards, b.values, b.loss_mask, gamma, lam), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gt, lt, gk, lk", [(0.95, 1.0, 1.0, 1.0), (0.9, 0.8, 0.99, 0.7)])
def test_bilevel_matches_ragen_reference(seed, gt, lt, gk, lk):
    b = random_batch(5, 48, seed=seed, turns=4)
    adv, _ = bilevel_gae(b.rewards, b.values, b.loss_mask, b.turn_ends, gt, lt, gk, lk)
    ref = bilevel_reference(b.rewards, b.values, b.loss_mask, b.turn_ends, gt, lt, gk, lk)
    assert_close(adv.double(), ref, atol=1e-5, rtol=1e-5)


def test_grpo_matches_loop():
    g = torch.Generator().manual_seed(0)
    scores, ids = torch.randn(64, generator=g), torch.randint(0, 9, (64,), generator=g)
    ids[ids == 0] = 1  # every group has at least 2 members (62 trajectories in 8 groups)
    out = grpo(scores, ids)
    for i in range(64):
        members = scores[ids == ids[i]]
        expected = (scores[i] - members.mean()) / (members.std() + 1e-6)
        assert_close(out[i], expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- properties
scores_st = st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=2, max_size=32)


@settings(max_examples=60, deadline=None)
@given(scores=scores_st, n_groups=st.integers(1, 6), scale=st.sampled_from(["group", "none", "batch"]))
def test_grpo_sums_to_zero_per_group(scores, n_groups, scale):
    s = torch.tensor(scores, dtype=torch.float64)
    ids = torch.arange(len(scores)) % min(n_groups, len(scores) // 2)  # every group has >= 2 members
    adv = grpo(s, ids, scale=scale)
    for gid in ids.unique():
        members = ids == gid
        if members.sum() > 1:
            assert abs(float(adv[members].sum())) < 1e-6 * max(1.0, float(s.abs().max())) * len(scores)


@settings(max_examples=60, deadline=None)
@given(scores=scores_st, n_groups=st.integers(1, 6))
def test_rloo_sums_to_zero_per_group(scores, n_groups):
    s = torch.tensor(scores, dtype=torch.float64)
    ids = torch.arange(len(scores)) % min(n_groups, len(scores) // 2)
    adv = rloo(s, ids)
    for gid in ids.unique():
        members = ids == gid
        if members.sum() > 1:
            assert abs(float(adv[members].sum())) < 1e-6 * len(scores) * max(1.0, float(s.abs().max()))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), T=st.integers(2, 30))
def test_gae_gamma_lambda_one_zero_values_is_reward_to_go(seed, T):
    b = random_batch(3, T, seed=seed)
    adv, ret = gae(b.rewards, torch.zeros_like(b.values), b.loss_mask, 1.0, 1.0)
    to_go = torch.flip(torch.cumsum(torch.flip(b.rewards * b.loss_mask, [1]), 1), [1]) * b.loss_mask
    assert_close(adv, to_go, atol=1e-5, rtol=1e-5)
    assert_close(ret, to_go, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_masked_positions_change_nothing(seed):
    b = random_batch(4, 24, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(b.rewards.shape, generator=g) * 100
    outside = ~b.loss_mask
    est = [GAE(0.9, 0.95), BiLevelGAE(), GRPO(), RLOO(), ReinforcePP(0.9)]
    before = [e(b)[0] for e in est]
    b.values = torch.where(outside, noise, b.values)
    b.rewards = torch.where(outside, b.rewards + noise, b.rewards)
    after = [e(b)[0] for e in est]
    for x, y in zip(before, after):
        assert_close(x, y)
        assert bool((y[outside] == 0).all())


def test_whitening_over_valid_tokens():
    b = random_batch(4, 30, seed=3)
    adv, _ = GAE()(b)
    valid = adv[b.loss_mask]
    assert abs(float(valid.mean())) < 1e-5 and abs(float(valid.std()) - 1) < 1e-3
    raw, _ = GAE(whiten=False)(b)
    assert_close(masked_whiten(raw, b.loss_mask), adv)


def test_grpo_class_broadcasts_to_sampled_tokens():
    b = make_batch([[0, 1, 1, 0], [0, 1, 0, 0]], rewards=[[0, 0, 1, 0], [0, 0, 0, 0]], group_ids=[0, 0])
    adv, ret = GRPO(scale="none")(b)
    assert ret is None
    assert_close(adv, torch.tensor([[0, 0.5, 0.5, 0], [0, -0.5, 0, 0]]))


# -------------------------------------------------------------------------------------------- errors
def test_bad_arguments_name_the_flag():
    with pytest.raises(ValueError, match=r"`gamma` must be in \[0, 1\], got 1.5"):
        GAE(gamma=1.5)
    with pytest.raises(ValueError, match=r"`gamma_turn` must be in \[0, 1\], got -0.1"):
        BiLevelGAE(gamma_turn=-0.1)
    with pytest.raises(ValueError, match=r"`scale` must be one of 'group', 'batch', 'none', got True"):
        GRPO(scale=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must share one \(B, T\) shape"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"GAE needs critic values"):
        GAE()(make_batch([[1, 1]]))
    with pytest.raises(ValueError, match=r"`gamma` and `lam` must be >= 0"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), gamma=-1)


@pytest.mark.parametrize("seed", range(3))
def test_turns_as_rows_give_the_same_advantages(seed):
    """Context-window batches (one row per turn) must get exactly the advantages of one row per trajectory."""
    b = random_batch(6, 40, groups=3, turns=3, seed=seed)
    rows = split_into_turn_rows(b)
    assert len(rows) > len(b)
    inverse, _ = rows.trajectory_index()
    for est in (GAE(0.9, 0.95), BiLevelGAE(0.9, 0.8), GRPO(), RLOO(), ReinforcePP(0.9), GiGPO(gamma=0.9),
                GiGPO(0.5, "mean_std_norm", 0.8, compute_mean_std_cross_steps=False)):
        full, _ = est(b)
        split, _ = est(rows)
        merged = torch.zeros_like(full).index_add_(0, inverse, split)  # every sampled token sits in one row
        assert_close(merged, full, atol=1e-5, rtol=1e-5, msg=type(est).__name__)
    torch.testing.assert_close(rows.stats().scores, b.stats().scores)


# ------------------------------------------------------------------- bi-level GAE: where turns end (issue 11)
def _three_turns(values=None):
    # Turns of two sampled tokens each, separated by env tokens; turn rewards [1, 0, 2] on each turn's last token.
    return make_batch([[1, 1, 0, 1, 1, 0, 1, 1]], rewards=[[0, 1, 0, 0, 0, 0, 0, 2]],
                      turn_ids=[[0, 0, -1, 1, 1, -1, 2, 2]], values=values or [[0.0] * 8])


def test_bilevel_segments_hand_derived():
    b = _three_turns()
    # rewarded (RAGEN): turn 2 has reward 0, so it is no turn end: the segments are {turn 1} and {turns 2, 3}.
    #   turn level: end of turn 3: A = 2; end of turn 1: A = 1 + 0.5 * 0 - 0 + 0.5 * 1 * 2 = 2.
    #   token level (gamma = lam = 1, values 0): every token of a segment gets its end's return: 2 everywhere.
    adv, _ = BiLevelGAE(gamma_turn=0.5, whiten=False)(b)
    assert_close(adv, torch.tensor([[2.0, 2.0, 0.0, 2.0, 2.0, 0.0, 2.0, 2.0]]))
    # turn_ids: three turns. A3 = 2; A2 = 0 + 0.5 * 2 = 1; A1 = 1 + 0.5 * 1 = 1.5.
    adv, _ = BiLevelGAE(gamma_turn=0.5, segments="turn_ids", whiten=False)(b)
    assert_close(adv, torch.tensor([[1.5, 1.5, 0.0, 1.0, 1.0, 0.0, 2.0, 2.0]]))


def test_bilevel_rewarded_with_values_hand_derived():
    # values on the sampled tokens: [0.1, 0.2, _, 0.3, 0.4, _, 0.5, 0.6]; gamma_turn 0.5, lam 1, gamma_token 1.
    # Segment ends (rewarded tokens): t1 (r=1), t7 (r=2).
    #   turn level: t7: delta = 2 - 0.6 = 1.4, A = 1.4, G7 = 2.0
    #               t1: delta = 1 + 0.5 * 0.6 - 0.2 = 1.1, A = 1.1 + 0.5 * 1.4 = 1.8, G1 = 2.0
    #   token level, segment 2 backwards: t7: 2.0 - 0.6 = 1.4; t6: 0 + 0.6 - 0.5 + 1.4 = 1.5;
    #     t4: 0 + 0.5 - 0.4 + 1.5 = 1.6; t3: 0 + 0.4 - 0.3 + 1.6 = 1.7
    #   segment 1: t1: 2.0 - 0.2 = 1.8; t0: 0 + 0.2 - 0.1 + 1.8 = 1.9
    b = _three_turns([[0.1, 0.2, 9.0, 0.3, 0.4, 9.0, 0.5, 0.6]])
    adv, ret = BiLevelGAE(gamma_turn=0.5, whiten=False)(b)
    assert_close(adv, torch.tensor([[1.9, 1.8, 0.0, 1.7, 1.6, 0.0, 1.5, 1.4]]))
    assert_close(ret, torch.tensor([[2.0, 2.0, 0.0, 2.0, 2.0, 0.0, 2.0, 2.0]]))


def test_bilevel_rewarded_last_turn_without_reward():
    """RAGEN's loop raises IndexError here; the last sampled token ends the episode (value after it 0)."""
    # tokens [s s | s s], rewards [0, 1, 0, 0], values 0: segment end t1 only.
    # t4, t3 (after the last end): delta 0, A 0. t1: A = G = 1; t0: A = 1.
    b = make_batch([[1, 1, 0, 1, 1]], rewards=[[0, 1, 0, 0, 0]], turn_ids=[[0, 0, -1, 1, 1]], values=[[0.0] * 5])
    adv, _ = BiLevelGAE(gamma_turn=0.5, whiten=False)(b)
    assert_close(adv, torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("seed", range(4))
def test_bilevel_rewarded_falls_back_to_token_gae(seed):
    """One reward, on the last sampled token: RAGEN's bi-level GAE is token-level GAE."""
    b = random_batch(4, 30, seed=seed, turns=3)
    last = b.loss_mask.cumsum(-1) == b.loss_mask.sum(-1, keepdim=True)
    last &= b.loss_mask
    b.rewards = torch.where(last, torch.randn(4, 30, generator=torch.Generator().manual_seed(seed)), 0.0)
    adv, _ = BiLevelGAE(gamma_turn=0.3, gamma_token=0.9, lam=0.8, whiten=False)(b)
    ref, _ = gae(b.rewards, b.values, b.loss_mask, gamma=0.9, lam=0.8)
    assert_close(adv, ref)


@pytest.mark.parametrize("seed", range(4))
def test_bilevel_rewarded_matches_ragen_loop(seed):
    """Against the RAGEN reference loop with its own rule: ends are the rewarded tokens, one lambda."""
    b = random_batch(5, 40, seed=seed, turns=4)
    # Some turns get reward exactly 0 (they merge into the next segment); the last sampled token keeps its reward.
    g = torch.Generator().manual_seed(100 + seed)
    zero = (torch.rand(5, 40, generator=g) < 0.4) & b.turn_ends
    last = (b.loss_mask.cumsum(-1) == b.loss_mask.sum(-1, keepdim=True)) & b.loss_mask
    b.rewards = torch.where(zero & ~last, 0.0, b.rewards)
    ends = (b.rewards != 0) & b.loss_mask
    adv, _ = BiLevelGAE(gamma_turn=0.9, gamma_token=0.95, lam=0.8, whiten=False)(b)
    ref = bilevel_reference(b.rewards, b.values, b.loss_mask, ends, 0.9, 0.8, 0.95, 0.8)
    assert_close(adv.double(), ref, atol=1e-5, rtol=1e-5)


def test_bilevel_arguments():
    with pytest.raises(ValueError, match=r"`lam_turn` needs `segments: turn_ids`"):
        BiLevelGAE(lam_turn=0.9)
    with pytest.raises(ValueError, match=r"`segments` must be 'rewarded' or 'turn_ids', got 'turns'"):
        BiLevelGAE(segments="turns")  # type: ignore[arg-type]
