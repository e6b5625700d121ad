"""The KV of what one ``generate`` call fed, kept until the next call of the same rollout (a conversation's next
turn extends its last turn), so the ``hf`` engine prefills only what a prompt adds."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["Kept", "PrefixCache"]


@dataclass
class Kept:
    tokens: list[int]
    layers: list[tuple[Tensor, Tensor]]
    """Each layer's (keys, values) of ``tokens``, each (H, len(tokens), D)."""


class PrefixCache:
    """The KV of the sequences one ``generate`` call fed, until the next call takes the longest one each prompt
    starts with (then all are dropped: a conversation's next turn extends its last turn, never an older one)."""

    _TAIL = 8
    """Kept sequences are indexed by length and last tokens; a candidate is then compared whole."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, tuple[int, ...]], list[Kept]] = {}

    def _key(self, tokens: list[int], n: int) -> tuple[int, tuple[int, ...]]:
        return n, tuple(tokens[max(0, n - self._TAIL):n])

    def add(self, tokens: list[int], layers: list[tuple[Tensor, Tensor]]) -> None:
        self._kept.setdefault(self._key(tokens, len(tokens)), []).append(Kept(tokens, layers))

    def take(self, prompts: list[list[int]]) -> list[Kept | None]:
        """For each prompt, the longest kept sequence it extends (None if none); then forget them all."""
        lengths = sorted({n for n, _ in self._kept}, reverse=True)
        found = [self._longest(p, lengths) for p in prompts]
        self.clear()
        return found

    def _longest(self, prompt: list[int], lengths: list[int]) -> Kept | None:
        for n in lengths:
            if n < len(prompt):  # at least one token of the prompt is fed: its logits start the answer
                for kept in self._kept.get(self._key(prompt, n), ()):
                    if kept.tokens == prompt[:n]:
                        return kept
        return None

    def clear(self) -> None:
        self._kept = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._kept.values())
