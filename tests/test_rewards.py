import pytest
import torch
from torch.testing import assert_close

from ragen_pl.rewards import RewardNorm, normalize_scores


def test_identity():
    s = torch.tensor([1.0, 2.0])
    assert normalize_scores(s, torch.tensor([0, 0]), ["a", "a"]) is s


def test_groupings_hand_derived():
    s = torch.tensor([0.0, 2.0, 10.0, 10.0, 4.0])
    ids = torch.tensor([0, 0, 1, 1, 2])
    tags = ["a", "a", "b", "b", "a"]
    # state: g0 [0, 2] -> mean 1, std sqrt(2): -+0.7071; g1 equal -> 0; g2 alone -> 0
    r = 1 / 2**0.5
    assert_close(normalize_scores(s, ids, tags, "state", "mean_std", eps=0.0).nan_to_num(0.0),
                 torch.tensor([-r, r, 0.0, 0.0, 0.0]))
    # tag: a = [0, 2, 4] mean 2 std 2 -> [-1, 0, 1]; b = [10, 10] -> 0 (std 0, eps keeps it finite)
    assert_close(normalize_scores(s, ids, tags, "tag", "mean_std"), torch.tensor([-1.0, 0.0, 0.0, 0.0, 1.0]),
                 atol=1e-5, rtol=1e-5)
    # batch: mean 5.2, unbiased std
    std = s.std()
    assert_close(normalize_scores(s, ids, tags, "batch", "mean_std"), (s - 5.2) / (std + 1e-6))


def test_clip_range():
    # 19 zeros and one 100: mean 5, unbiased std sqrt((19*25 + 95^2) / 19) = sqrt(500); outlier z = 95/22.36 = 4.25
    s = torch.tensor([0.0] * 19 + [100.0])
    ids = torch.zeros(20, dtype=torch.long)
    unclipped = normalize_scores(s, ids, ["a"] * 20, "batch", "mean_std")
    assert float(unclipped.max()) == pytest.approx(95 / 500**0.5, rel=1e-5)
    out = normalize_scores(s, ids, ["a"] * 20, "batch", "mean_std_clip")
    assert float(out.max()) == 3.0 and float(out.min()) == pytest.approx(-5 / 500**0.5, rel=1e-5)
    assert float(normalize_scores(-s, ids, ["a"] * 20, "batch", "mean_std_clip").min()) == -1.0


def test_format_penalty_keeps_order_after_normalisation():
    # Same env reward, one answer malformed (-0.1 format penalty added before normalising): it stays below.
    env_reward = torch.tensor([1.0, 1.0, 0.0])
    penalty = torch.tensor([0.0, -0.1, 0.0])
    out = normalize_scores(env_reward + penalty, torch.zeros(3, dtype=torch.long), ["a"] * 3, "state", "mean_std")
    assert out[0] > out[1] > out[2]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"`--model.reward_norm.grouping` must be one of state, tag, batch, got 'group'"):
        RewardNorm(grouping="group")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`--model.reward_norm.method` must be one of identity, mean_std, mean_std_clip"):
        RewardNorm(method="zscore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must all have length B"):
        normalize_scores(torch.zeros(2), torch.zeros(3, dtype=torch.long), ["a", "b"])
