import time
from fractions import Fraction

import pytest

from ragen_pl.envs.countdown import Countdown, ExpressionError, parse_expression


def test_parse_expression():
    assert parse_expression("(25 - 5) * 3") == (Fraction(60), [25, 5, 3])
    assert parse_expression("7 / 2 + 1")[0] == Fraction(9, 2)
    with pytest.raises(ExpressionError, match="division by zero"):
        parse_expression("1 / (2 - 2)")


def test_solution_is_correct_and_deterministic():
    for seed in range(200):
        env = Countdown()
        obs = env.reset(seed)
        assert obs == Countdown().reset(seed)
        _, reward, done, info = env.step(env.solution)
        assert reward == 1.0 and done and info["success"], (obs, env.solution)


def _fixed(numbers, target):
    env = Countdown()
    env.reset(0)
    env.numbers, env.target = numbers, target
    return env


def test_ragen_scoring_every_number_exactly_once():
    """RAGEN / TinyZero: 0 unless the answer's numbers are exactly the given ones; 1 if correct, else 0.1."""
    def score(numbers, target, answer):
        _, reward, done, info = _fixed(numbers, target).step(answer)
        assert done and info["action_is_valid"]  # every answer ends the episode; none is a format failure
        return reward

    assert score([3, 5, 7, 11], 24, "3 * (5 + 11 - 7) - 3") == 0.0  # 3 twice, 7 once... not the given multiset
    assert score([1, 2, 3, 4], 10, "2 * 3 + 4") == 0.0  # leaves 1 unused (the old rule accepted it)
    assert score([1, 2, 3, 4], 10, "1 + 2 + 3 + 4") == 1.0
    assert score([1, 2, 3, 4], 11, "1 + 2 + 3 + 4") == pytest.approx(0.1)  # well-formed, wrong value
    assert score([3, 3, 7, 11], 0, "3 - 3 + 7 - 7") == 0.0  # 7 twice, 11 missing
    assert score([3, 5, 2], 4, "- 3 + 5 + 2") == 1.0  # RAGEN's own example starts with a unary minus
    assert score([3, 5, 2], 4, "3 5 2") == pytest.approx(0.1)  # the numbers, but no expression: format score
    assert score([3, 5, 2], 4, "I think 3, 5 and 2") == pytest.approx(0.1)
    assert score([3, 5, 2], 4, "4") == 0.0


def test_answer_ends_the_episode():
    env = _fixed([1, 2, 3, 4], 10)
    _, _, done, _ = env.step("nonsense")
    assert done
    assert env.step("1 + 2 + 3 + 4")[3]["action_is_valid"] is False  # the episode is over


HOSTILE = [
    "__import__('os').system('true')",
    "9**9**9",
    "(" * 10_000 + "1" + ")" * 10_000,
    "(((((((((((((((((((((((((((((((((((((((((((1)))))))))))))))))))))))))))))))))))))))))))",
    "1" * 1_000_000,
    "１２ + ３",  # fullwidth digits
    "٣ + 4",  # Arabic-Indic digit
    "lambda: 1",
    "[1, 2]",
    "1; 2",
    "1 if 1 else 2",
    "-1",
    "1e9",
    "0x10",
    "",
    "\x00",
    "1 // 2",
    "2 ** 3",
    "a.b",
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_input_scores_zero_fast_and_never_raises(text):
    env = Countdown()
    env.reset(0)
    start = time.perf_counter()
    _, reward, done, info = env.step(text)
    assert time.perf_counter() - start < 0.5
    assert (reward, done, info["success"]) == (0.0, True, False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_numbers": 1}, r"`num_numbers` must be an integer in \[2, 8\], got 1"),
        ({"format_reward": 2.0}, r"`format_reward` must be in \[0.0, 1.0\], got 2.0"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Countdown(**kwargs)
