"""benchmarks/vs_trl.py gives TRL the prompts and rewards ragen-pl's collector uses (its fairness claim)."""

import pytest

from benchmarks.smollm2_bandit import rollout_config
from benchmarks.vs_trl import bandit_prompt, bandit_reward
from ragen_pl.envs.bandit import Bandit
from ragen_pl.rollout.collector import Collector, EpisodeSpec
from tests.rollout.test_collector import Recording, Scripted


@pytest.mark.parametrize("answer", ["Dragon</answer>", " Phoenix </answer>", "Dragon", "Unicorn</answer>",
                                    "Dragon</answer> and more prose"])
def test_same_prompt_and_reward_as_the_collector(tiny, answer):
    _, tok = tiny
    for seed in range(12):  # both arm orders, paying and not paying draws
        engine = Recording(Scripted(tok, lambda turn, text: answer))
        result = Collector(engine, tok, rollout_config()).collect([EpisodeSpec(Bandit(), seed=seed, group_id=0)])
        assert engine.calls[0][0][0] == bandit_prompt(tok, seed)
        assert bandit_reward(answer, seed) == pytest.approx(sum(result.episodes[0].rewards.values()))
