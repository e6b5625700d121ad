import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_pl.rollout.prompt import parse_answer


@pytest.mark.parametrize(
    "text, think, actions, ok",
    [
        ("I go up.</think><answer>Up</answer>", True, ["Up"], True),
        (" plan </think>\n<answer> Up || Left ||Down </answer>", True, ["Up", "Left", "Down"], True),
        ("x</think><answer>Up || || Left</answer>", True, ["Up", "Left"], True),
        ("Up</answer>", False, ["Up"], True),
        ("x</think><answer></answer>", True, [], False),  # empty answer
        ("x</think><answer>   </answer>", True, [], False),
        ("no closing think <answer>Up</answer>", True, [], False),
        ("x</think><answer>Up", True, [], False),  # unclosed answer
        ("a<think>b</think><answer>Up</answer>", True, [], False),  # nested think
        ("x</think><answer>Up <answer>Left</answer>", True, [], False),  # nested answer
        ("x</think><answer>Up</think></answer>", True, [], False),
        ("", True, [], False),
        ("", False, [], False),
    ],
)
def test_parse_cases(text, think, actions, ok):
    parsed = parse_answer(text, think=think)
    assert (parsed.actions, parsed.format_ok) == (actions, ok)


def test_caps_actions_per_turn():
    text = "x</think><answer>" + " || ".join(["Up"] * 5000) + "</answer>"
    start = time.perf_counter()
    parsed = parse_answer(text, max_actions=5)
    assert parsed.actions == ["Up"] * 5 and parsed.format_ok
    assert time.perf_counter() - start < 1  # under 1 ms here; the bound only catches work per capped action


def test_megabytes_and_unicode_never_raise():
    for text in ("A" * 3_000_000, "</think><answer>" + "é" * 1_000_000 + "</answer>", "\x00\ud7ff🎉</think><answer>🎉</answer>"):
        start = time.perf_counter()
        parse_answer(text)
        assert time.perf_counter() - start < 2  # under 5 ms here: far from a pathological (super-linear) parse


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(list("<>/|thinkaswerUpLf \n") + ["<think>", "</think>", "<answer>", "</answer>", "||"]),
             max_size=60).map("".join),
    st.booleans(),
)
def test_any_text_parses_or_fails_cleanly(text, think):
    parsed = parse_answer(text, think=think, max_actions=3)
    assert len(parsed.actions) <= 3
    assert parsed.format_ok == bool(parsed.actions)
    assert all(a and a == a.strip() and "<answer>" not in a for a in parsed.actions)


@pytest.mark.parametrize("think", [True, False])
def test_parse_answer_is_linear_in_its_input(think):
    """1 MB of whitespace (and of text with no closing tag) parses in about 1 ms here (issue 14: it was quadratic,
    minutes). The bound is loose so that a busy shared machine does not fail it; a quadratic parse still does."""
    for text in (" " * 1_000_000, " " * 500_000 + "x" * 500_000, "<answer>" + " " * 1_000_000):
        start = time.perf_counter()
        assert not parse_answer(text, think=think).format_ok
        assert time.perf_counter() - start < 1
