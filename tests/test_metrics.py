"""Reasoning metrics (issue 15): does the thinking name the actions it answers, and how long is it."""

import pytest

from ragen_pl.config import RolloutConfig
from ragen_pl.envs.countdown import Countdown
from ragen_pl.envs.sokoban import Sokoban
from ragen_pl.metrics import episode_metrics, think_answer_agreement
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


def test_no_agreement_for_free_text_actions(tiny):
    _, tok = tiny
    engine = Scripted(tok, lambda turn, _: "sum them</think><answer>1 + 2</answer>")
    result = Collector(engine, tok, RolloutConfig(max_turns=1)).collect([EpisodeSpec(Countdown(), seed=0, group_id=0)])
    m = episode_metrics(result.episodes)
    assert "think_answer_agreement" not in m and m["think_words"] == 2


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
