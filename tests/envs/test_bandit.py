import pytest

from ragen_pl.envs.bandit import Bandit


def test_arm_order_shuffled_per_seed_and_deterministic():
    orders = {Bandit().reset(s) for s in range(100)}
    assert orders == {
        "Two arms: Phoenix and Dragon. Which arm do you pull?",
        "Two arms: Dragon and Phoenix. Which arm do you pull?",
    }
    assert Bandit().reset(42) == Bandit().reset(42)


def test_payout_means():
    env = Bandit()
    n = 8000
    high = [env.reset(s) and env.step("dragon")[1] for s in range(n)]
    assert set(high) == {0.0, 1.0}
    sigma = (0.25 * 0.75 / n) ** 0.5
    assert abs(sum(high) / n - 0.25) < 5 * sigma
    low = [env.reset(s) and env.step(" PHOENIX ") for s in range(100)]
    assert all(r == 0.1 and done and not info["success"] for _, r, done, info in low)
    env.reset(0)
    assert env.step("Dragon")[3]["success"]


def test_single_turn_and_invalid():
    env = Bandit(low_arm="Trader", high_arm="Librarian")
    env.reset(0)
    assert env.step("Dragon")[3]["action_is_valid"] is False
    assert env.step("librarian")[2] is True
    assert env.step("librarian")[3]["action_is_valid"] is False  # the episode is over
    assert "Trader" in env.instructions and "Librarian" in env.instructions


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"low_arm": "A", "high_arm": "a"}, r"`low_arm` and `high_arm` must differ"),
        ({"low_arm": ""}, r"`low_arm` must be a non-empty name"),
        ({"high_prob": 2}, r"`high_prob` must be in \[0.0, 1.0\], got 2"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Bandit(**kwargs)


def test_ragen_wording_hints_at_the_names():
    env = Bandit()
    env.reset(1)
    a, b = env._order
    text = env.instructions
    assert f"1. There are 2 arms, named {a} and {b}" in text
    assert "related to their names" in text and "symbolic meaning" in text
    assert f"<answer> {a} </answer> or <answer> {b} </answer>" in text
    neutral = Bandit(symbolic_hint=False)
    neutral.reset(1)
    assert "symbolic" not in neutral.instructions and "names" not in neutral.instructions
