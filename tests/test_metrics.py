"""Reasoning metrics (issue 15): does the thinking name the actions it answers, and how long is it."""

import random

import pytest

from ragen_pl.config import RolloutConfig
from ragen_pl.envs.countdown import Countdown
from ragen_pl.envs.sokoban import Sokoban
from ragen_pl.metrics import effective_episodes, episode_metrics, think_answer_agreement
from ragen_pl.rollout.collector import Collector, EpisodeSpec
from tests.rollout.test_collector import Scripted


@pytest.mark.parametrize("think, answered, agrees", [
    ("I will push the box Up.", ["Up"], True),
    ("I will try Down.", ["Right"], False),  # the paper's hallucinated reasoning
    ("up then left", ["Up", "Left"], True),  # any case
    ("Move up, then go right", ["Up", "Left"], False),  # every answered action must be named
    ("Upward!", ["Up"], False),  # whole words only
    ("Pick Phoenix", ["Phoenix"], True),
])
def test_think_answer_agreement(think, answered, agrees):
    assert think_answer_agreement(think, answered) is agrees


def test_metrics_count_turns_that_parsed(tiny):
    _, tok = tiny
    answers = {0: "I go Up</think><answer>Up</answer>", 1: "I go Up now</think><answer>Left</answer>",
               2: "no tags at all"}
    engine = Scripted(tok, lambda turn, _: answers[turn])
    config = RolloutConfig(max_turns=3, max_actions_per_turn=2, max_actions_per_episode=10)
    result = Collector(engine, tok, config).collect([EpisodeSpec(Sokoban(), seed=1, group_id=0)])
    m = episode_metrics(result.episodes)
    assert m["think_answer_agreement"] == pytest.approx(0.5)  # turn 0 agrees, turn 1 not; turn 2 did not parse
    assert m["think_words"] == pytest.approx((3 + 4) / 2)
    assert m["effective_episodes"] == m["episodes"] == 1  # one group: nothing to cluster


def test_no_agreement_for_free_text_actions(tiny):
    _, tok = tiny
    engine = Scripted(tok, lambda turn, _: "sum them</think><answer>1 + 2</answer>")
    result = Collector(engine, tok, RolloutConfig(max_turns=1)).collect([EpisodeSpec(Countdown(), seed=0, group_id=0)])
    m = episode_metrics(result.episodes)
    assert "think_answer_agreement" not in m and m["think_words"] == 2


def test_effective_episodes_by_hand():
    # Two groups of 2, all wins in one, all losses in the other: share 0.5; cluster-robust variance
    # 2/1 x ((2/4)^2 (1 - 0.5)^2 + (2/4)^2 (0 - 0.5)^2) = 0.25, so p (1 - p) / 0.25 = 1 episode's worth.
    assert effective_episodes([[1, 1], [0, 0]]) == pytest.approx(1.0)
    # Groups of 1: 2/1 x (1/2)^2 x (0.25 + 0.25) = 0.25 -> 1 as well (n - 1 for independent episodes)
    assert effective_episodes([[1], [0]]) == pytest.approx(1.0)
    # Group means that are all the same: no between-group spread, the episode count; all wins: the count too.
    assert effective_episodes([[1, 0], [0, 1], [1, 0]]) == 6
    assert effective_episodes([[1, 1], [1, 1]]) == 4
    # Three groups: share 4/9; group means 1, 1/3, 0; variance 3/2 x (1/3)^2 x ((5/9)^2 + (1/9)^2 + (4/9)^2) = 7/81,
    # p (1 - p) = 20/81: worth 20/7 episodes of 9.
    assert effective_episodes([[1, 1, 1], [0, 0, 1], [0, 0, 0]]) == pytest.approx(20 / 7)
    # Group means 2/3, 1/3, 1/3: variance 1/81, worth 20 -- more than were played, so the 9 played.
    assert effective_episodes([[1, 1, 0], [1, 0, 0], [0, 1, 0]]) == 9


@pytest.mark.parametrize("icc", [0.0, 0.1, 0.3, 0.5])
def test_effective_episodes_against_the_design_effect(icc):
    """Over simulated steps of 8 groups x 8 it finds about n / (1 + (m - 1) icc) where boards are easy or hard for
    all their trajectories (success drawn per group); for independent episodes somewhat under the 64 played, as no
    step is credited with more than were played (conservative)."""
    rng = random.Random(0)
    values = []
    for _ in range(2000):
        rates = [rng.betavariate(0.3 * (1 - icc) / icc, 0.7 * (1 - icc) / icc) if icc else 0.3 for _ in range(8)]
        values.append(effective_episodes([[float(rng.random() < r) for _ in range(8)] for r in rates]))
    found = len(values) / sum(1 / v for v in values)  # the harmonic mean: variances average, not their inverses
    if icc:
        assert found == pytest.approx(64 / (1 + 7 * icc), rel=0.1)
    else:
        assert 0.75 * 64 <= found <= 64


def test_mean_over_ranks_weights_each_rank_and_tolerates_missing_keys(monkeypatch):
    """The mean over processes of metrics that not every process reports (a rank that played only some envs):
    hand-computed weighted means. Lightning's key-by-key sync paired the wrong values (or hung) then."""
    import torch
    import torch.distributed as dist

    from ragen_pl.dist import mean_over_ranks

    other = ({"rollout/success": 0.0, "rollout/Sokoban/success": 0.0, "loss/policy": 3.0},
             {"rollout/success": 1.0, "rollout/Sokoban/success": 4.0, "loss/policy": 1.0})

    def all_gather_object(out, obj):
        out[:] = [obj, other]

    mine = {"rollout/success": torch.tensor(0.5), "rollout/Bandit/success": torch.tensor(1.0),
            "rollout/Sokoban/success": torch.tensor(0.25), "loss/policy": 1.0}
    weights = {"rollout/Bandit/success": 6.0, "rollout/Sokoban/success": 2.0}
    assert mean_over_ranks(mine, weights, default_weight=1.0) == {k: float(v) for k, v in mine.items()}  # alone
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    out = mean_over_ranks(mine, weights, default_weight=1.0)
    assert out == pytest.approx({
        "rollout/success": (0.5 + 0.0) / 2,
        "rollout/Bandit/success": 1.0,  # only this rank played Bandit
        "rollout/Sokoban/success": (2 * 0.25 + 4 * 0.0) / 6,  # 2 of this rank's trajectories, 4 of the other's
        "loss/policy": (1.0 + 3.0) / 2,
    })
    assert list(out) == sorted(out)  # the same order on every rank
