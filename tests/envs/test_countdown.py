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


def test_wrong_but_well_formed_gets_format_reward():
    _, reward, done, info = _fixed([3, 5, 7, 11], 24).step("3 + 5")
    assert reward == pytest.approx(0.1) and done and not info["success"] and info["action_is_valid"]


def test_each_number_at_most_once():
    assert _fixed([3, 5, 7, 11], 24).step("3 * (5 + 11 - 7 - 1)")[3]["action_is_valid"] is False  # 1 not given
    assert _fixed([3, 5, 7, 11], 24).step("3 + 3")[3]["action_is_valid"] is False  # 3 used twice
    assert _fixed([3, 3, 7, 11], 6).step("3 + 3")[1] == 1.0  # given twice, used twice
    assert _fixed([3, 5, 7, 11], 8).step("5 + 3")[1] == 1.0  # not every number needs to be used
    assert _fixed([3, 5, 7, 11], 24).step("(11 - 7 + 5 - 3) * 4")[3]["action_is_valid"] is False


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
def test_hostile_input_is_invalid_fast_and_never_raises(text):
    env = Countdown()
    obs = env.reset(0)
    start = time.perf_counter()
    out, reward, done, info = env.step(text)
    assert time.perf_counter() - start < 0.5
    assert (out, reward, done, info["action_is_valid"]) == (obs, 0.0, False, False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_numbers": 1}, r"`num_numbers` must be in \[2, 8\], got 1"),
        ({"format_reward": 2.0}, r"`format_reward` must be in \[0.0, 1.0\], got 2.0"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Countdown(**kwargs)
