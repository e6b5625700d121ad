"""The KV of what one ``generate`` call fed, kept until the next call of the same rollout (a conversation's next
turn extends its last turn), so the ``hf`` engine prefills only what a prompt adds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

__all__ = ["SHARED_PREFIX_MIN", "Kept", "PrefixCache", "kept_past", "left_padded", "shared_prefix"]

SHARED_PREFIX_MIN = 32
"""Prompt tokens all prompts of a call must share before they are prefilled once (see ``HFEngine.share_prefix``)."""


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

    @classmethod
    def of(cls, hits: list[Kept | None]) -> PrefixCache:
        """A cache holding ``hits`` (those taken for one chunk of a call)."""
        cache = cls()
        for hit in hits:
            if hit is not None:
                cache.add(hit.tokens, hit.layers)
        return cache

    def absorb(self, other: PrefixCache) -> None:
        """Keep ``other``'s sequences too (a call sampled in chunks, each with a cache of its own)."""
        for key, kept in other._kept.items():
            self._kept.setdefault(key, []).extend(kept)

    def __len__(self) -> int:
        return sum(len(v) for v in self._kept.values())


def shared_prefix(model, prompts: list[list[int]], hits: list[Kept | None], device: torch.device
                  ) -> tuple[list[Kept | None], int]:
    """``hits``, with the prompts' common prefix (at least ``SHARED_PREFIX_MIN`` tokens, prefilled here once) for
    the rows that kept less of it; and the number of tokens that prefill fed."""
    if len(prompts) < 2:
        return hits, 0
    n = min(common_length(prompts), min(len(p) for p in prompts) - 1)  # each row feeds at least one token
    if n < SHARED_PREFIX_MIN or all(h is not None and len(h.tokens) >= n for h in hits):
        return hits, 0
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.tensor([prompts[0][:n]], device=device), past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    shared = Kept(prompts[0][:n], [(layer.keys[0], layer.values[0]) for layer in cache.layers])
    return [shared if h is None or len(h.tokens) < n else h for h in hits], n


def kept_past(hits: list[Kept | None]) -> list[tuple[Tensor, Tensor]]:
    """Each layer's (keys, values) of the rows' kept prefixes, (n, H, C, D), right-aligned to the longest (C)."""
    example = next(h for h in hits if h is not None).layers
    past = []
    for layer, (k0, v0) in enumerate(example):
        rows_k = [h.layers[layer][0] if h else k0[:, :0] for h in hits]
        rows_v = [h.layers[layer][1] if h else v0[:, :0] for h in hits]
        past.append((_stack_left(rows_k), _stack_left(rows_v)))
    return past


def common_length(prompts: list[list[int]]) -> int:
    """Length of the longest prefix every prompt starts with."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], p[:n])) if a != b), n)
    return n


def _stack_left(rows: list[Tensor]) -> Tensor:
    """(n, H, C, D) from n tensors (H, c_i, D), each right-aligned (left-padded with zeros) to C = max c_i."""
    return pad_sequence([r.transpose(0, 1) for r in rows], batch_first=True, padding_side="left").transpose(1, 2)


def left_padded(tok, prompts: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """(n, width) ids and attention mask, left-padded: every row's newest token sits in the last column."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention[i, width - len(p):] = 1
    return input_ids.to(device), attention.to(device)
