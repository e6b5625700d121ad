"""Token ids of one conversation, built turn by turn from the exact ids that were fed and sampled.

A trajectory's token sequence is built from the very ids that were fed and sampled. The first prompt and every env
message are tokenised once and appended; the engine's sampled ids are appended as they are, never decoded and
re-tokenised (re-tokenising can merge or split tokens differently, so the update would score tokens the policy never
sampled). Each sampled id keeps the engine's log-prob of it.

:class:`ChatTokens` keeps the whole conversation as one sequence (one training row); :class:`WindowChat` keeps only
the last turns in each prompt, so each turn is its own row. Both offer the collector the same methods.
"""

from __future__ import annotations

from collections.abc import Sequence

_SENTINEL = "\x00RAGEN_PL_SENTINEL\x00"

Row = tuple[list[int], list[bool], list[int], list[float], list[list[int] | None]]
"""A training row: ids, sampled mask, turn ids (-1 off sampled ids), the engine's log-probs (0 off sampled ids), and
the ids each sampled token was drawn from when sampling truncated the distribution (None elsewhere)."""

__all__ = ["ChatTokens", "Row", "WindowChat"]


class ChatTokens:
    """Token ids of one conversation in one sequence.

    ``ids`` is what the engine is fed next; ``sampled`` marks ids the policy produced; ``turn_ids`` gives the turn of
    each sampled id (-1 elsewhere); ``logprobs`` the engine's log-prob of each sampled id (0 elsewhere).
    """

    def __init__(self, tokenizer, system: str, first_user: str, think: bool) -> None:
        self.tokenizer = tokenizer
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": first_user}]
        self.open_tag = "<think>" if think else "<answer>"
        text = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
        self.ids: list[int] = self._encode(text + self.open_tag)
        self.sampled: list[bool] = [False] * len(self.ids)
        self.turn_ids: list[int] = [-1] * len(self.ids)
        self.logprobs: list[float] = [0.0] * len(self.ids)
        self.kept: list[list[int] | None] = [None] * len(self.ids)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def add_response(self, ids: Sequence[int], turn: int, logprobs: Sequence[float] | None = None,
                     kept: Sequence[list[int]] | None = None) -> None:
        self.ids.extend(ids)
        self.sampled.extend([True] * len(ids))
        self.turn_ids.extend([turn] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.kept.extend(kept if kept is not None else [None] * len(ids))
        self.messages.append({"role": "assistant", "content": _SENTINEL})

    def user_suffix_ids(self, text: str, ended_with_eos: bool) -> list[int]:
        """Ids that close the assistant turn, add a user message and open the next answer."""
        rendered = self.tokenizer.apply_chat_template(
            [*self.messages, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        suffix = rendered[rendered.rindex(_SENTINEL) + len(_SENTINEL):]
        eos_text = self.tokenizer.eos_token or ""
        if ended_with_eos and eos_text and suffix.startswith(eos_text):
            suffix = suffix[len(eos_text):]  # the model already sampled the end-of-turn token
        return self._encode(suffix + self.open_tag)

    def add_user(self, suffix_ids: Sequence[int], text: str) -> None:
        self.ids.extend(suffix_ids)
        self.sampled.extend([False] * len(suffix_ids))
        self.turn_ids.extend([-1] * len(suffix_ids))
        self.logprobs.extend([0.0] * len(suffix_ids))
        self.kept.extend([None] * len(suffix_ids))
        self.messages[-1] = {"role": "assistant", "content": "..."}  # content no longer matters, only the layout
        self.messages.append({"role": "user", "content": text})

    # The collector's view of a conversation (shared with WindowChat).
    def prompt_ids(self) -> list[int]:
        """What the engine is fed next."""
        return self.ids

    def extend_user(self, text: str, ended_with_eos: bool, max_prompt: int) -> bool:
        """Add the next user message, unless the next prompt would pass ``max_prompt`` tokens (then False)."""
        suffix = self.user_suffix_ids(text, ended_with_eos)
        if len(self.ids) + len(suffix) > max_prompt:
            return False
        self.add_user(suffix, text)
        return True

    def last_sampled(self) -> tuple[int, int]:
        """(row, position) of the newest sampled token: where a turn's reward goes."""
        return 0, len(self.ids) - 1

    def rows(self) -> list[Row]:
        """The training rows. One row: the whole conversation."""
        return [(self.ids, self.sampled, self.turn_ids, self.logprobs, self.kept)]


class WindowChat:
    """A conversation whose prompt keeps only the last ``window`` turns (the instructions always stay).

    Each turn's prompt is rendered afresh, so a trajectory is no longer one token sequence: every turn becomes its
    own training row, made of exactly the prompt ids fed for that turn and the ids sampled after them.
    """

    def __init__(self, tokenizer, system: str, first_user: str, think: bool, instructions: str, window: int) -> None:
        self.tokenizer, self.system, self.instructions, self.window = tokenizer, system, instructions, window
        self.open_tag = "<think>" if think else "<answer>"
        self.history: list[tuple[int, str, str]] = []  # (turn, user text, assistant text), completed turns
        self.user = (0, first_user)
        self._rows: list[Row] = []
        self._prompt: list[int] | None = None
        self._pending: tuple[int, str, str] | None = None  # the turn just answered, until the next user message

    def _render(self, history: list[tuple[int, str, str]], user: tuple[int, str]) -> list[int]:
        kept = history[len(history) - (self.window - 1):] if self.window > 1 else []
        messages = [{"role": "system", "content": self.system}]
        for i, (turn, text, answer) in enumerate([*kept, (*user, None)]):
            if i == 0 and turn > 0:  # the first kept message carries the rules, as turn 1's does
                text = f"{self.instructions}\n\n{text}"
            messages.append({"role": "user", "content": text})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered + self.open_tag, add_special_tokens=False)["input_ids"]

    def prompt_ids(self) -> list[int]:
        if self._prompt is None:
            self._prompt = self._render(self.history, self.user)
        return self._prompt

    def add_response(self, ids: Sequence[int], turn: int, logprobs: Sequence[float] | None = None,
                     kept: Sequence[list[int]] | None = None) -> None:
        prompt = self.prompt_ids()
        self._rows.append((prompt + list(ids), [False] * len(prompt) + [True] * len(ids),
                           [-1] * len(prompt) + [turn] * len(ids),
                           [0.0] * len(prompt) + list(logprobs if logprobs is not None else [0.0] * len(ids)),
                           [None] * len(prompt) + list(kept if kept is not None else [None] * len(ids))))
        answer = self.open_tag + self.tokenizer.decode(list(ids), skip_special_tokens=True)
        self._pending = (self.user[0], self.user[1], answer)

    def extend_user(self, text: str, ended_with_eos: bool, max_prompt: int) -> bool:
        assert self._pending is not None, "add_response comes before extend_user"
        history = [*self.history, self._pending]
        user = (self._pending[0] + 1, text)
        prompt = self._render(history, user)
        if len(prompt) > max_prompt:
            return False
        self.history, self.user, self._prompt = history, user, prompt
        return True

    def last_sampled(self) -> tuple[int, int]:
        return len(self._rows) - 1, len(self._rows[-1][0]) - 1

    def rows(self) -> list[Row]:
        return self._rows
