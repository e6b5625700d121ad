"""Prompt text and answer parsing for StarPO's multi-turn format (RAGEN's).

Each turn the model answers ``<think>...</think><answer>...</answer>`` (or ``<answer>...</answer>`` in no-think
mode); several actions may be given in one answer separated by ``||``. The prompt starts the answer with the opening
tag, so the sampled text continues after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Completions longer than this are not parsed (a format failure), which bounds the regex work on hostile text.
MAX_COMPLETION_CHARS = 2_000_000


@dataclass
class ParsedAnswer:
    actions: list[str] = field(default_factory=list)
    """Actions in order, stripped, at most ``max_actions``."""
    think: str = ""
    format_ok: bool = False
    """The text matched the expected tags (an empty answer still fails)."""


def parse_answer(completion: str, think: bool = True, max_actions: int = 5) -> ParsedAnswer:
    """Parse the text the model wrote after the prompt's opening tag (``<think>`` or ``<answer>``).

    Nested or unclosed tags, extra tags inside the answer, and empty answers fail the format check. Only the first
    ``max_actions`` actions are kept (the paper caps actions per turn).
    """
    if len(completion) > MAX_COMPLETION_CHARS:
        return ParsedAnswer()
    # str.find, not a regex: `^\s*(.*?)</think>` backtracks quadratically on long whitespace (issue 14).
    if think:
        close = completion.find("</think>")
        if close < 0:
            return ParsedAnswer()
        thought, rest = completion[:close].strip(), completion[close + len("</think>"):].lstrip()
        if not rest.startswith("<answer>") or "<think>" in thought or "<answer>" in thought:
            return ParsedAnswer()
        rest = rest[len("<answer>"):]
    else:
        thought, rest = "", completion
    end = rest.find("</answer>")
    if end < 0:
        return ParsedAnswer()
    answer = rest[:end]
    if any(tag in answer for tag in ("<answer>", "<think>", "</think>")):
        return ParsedAnswer(think=thought)
    actions = [a.strip() for a in answer.split("||", max_actions)[:max_actions]]
    actions = [a for a in actions if a]
    if not actions:
        return ParsedAnswer(think=thought)
    return ParsedAnswer(actions=actions, think=thought, format_ok=True)


def format_instruction(think: bool, max_actions_per_turn: int, max_tokens: int) -> str:
    if think:
        shape = "<think> [your thoughts] </think> <answer> [your answer] </answer>"
    else:
        shape = "<answer> [your answer] </answer>"
    return (
        f"Always output: {shape} with no extra text. You may give up to {max_actions_per_turn} actions separated "
        f"by ' || '. Max response length: {max_tokens} tokens."
    )


def first_user_message(instructions: str, observation: str, actions_left: int, fmt: str, header: bool = True) -> str:
    """Turn 1's user message: the rules, then the state. ``header`` false leaves out ``Turn 1`` and the actions left,
    so that the message is the rules and the state alone (``--data.rollout.turn_header``)."""
    if not header:
        return f"{instructions}\n\nState:\n{observation}\n{fmt}"
    return f"{instructions}\n\nTurn 1:\nState:\n{observation}\nYou have {actions_left} actions left. {fmt}"


def next_user_message(turn: int, reward: float, observation: str, actions_left: int, fmt: str,
                      header: bool = True) -> str:
    """A later turn's user message: the last reward, then the state. ``header`` false keeps the state alone, so that a
    window of one turn (which puts the rules first) renders a state exactly as turn 1 does."""
    if not header:
        return f"State:\n{observation}\n{fmt}"
    return (
        f"Reward: {reward:g}\n\nTurn {turn}:\nState:\n{observation}\nYou have {actions_left} actions left. {fmt}"
    )
