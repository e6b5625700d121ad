"""Sampling one token per row from logits, with the log-prob of the distribution actually sampled from
(temperature, top-k and top-p applied), as every engine reports it."""

from __future__ import annotations

import torch
from torch import Tensor

from ragen_pl.rollout.engine import Generation, SamplingParams

__all__ = ["Outputs", "sample_next"]


def sample_next(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Sample one token per row of (N, V) logits; return ids (N,) and their log-probs (N,) after processing.

    With top-k the rest happens among the k best tokens, an (N, k) problem already sorted for top-p, instead of
    the whole vocabulary (exactly k tokens: a tie at the k-th logit is broken by index). Top-p alone sorts the
    vocabulary.
    """
    logits = logits.float()
    if params.temperature == 0:
        ids = logits.argmax(-1)
        return ids, torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
    logits = logits / params.temperature
    candidates = None  # (N, k) vocabulary ids of the top-k logits, when top-k is on
    if 0 < params.top_k < logits.shape[-1]:
        logits, candidates = torch.topk(logits, params.top_k, dim=-1)  # sorted, largest first
    if params.top_p < 1.0:
        logits = _top_p(logits, params.top_p, presorted=candidates is not None)
    logp = torch.log_softmax(logits, -1)
    pick = torch.multinomial(logp.exp(), 1, generator=generator)  # (N, 1)
    ids = pick if candidates is None else candidates.gather(-1, pick)
    return ids.squeeze(-1), logp.gather(-1, pick).squeeze(-1)


def _top_p(logits: Tensor, top_p: float, presorted: bool) -> Tensor:
    """``logits`` with every token outside the nucleus (the fewest top tokens holding ``top_p`` of the mass) at -inf."""
    sorted_logits, order = (logits, None) if presorted else torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, -1)
    drop_sorted = probs.cumsum(-1) - probs >= top_p  # mass before a token; keeps at least the top one
    drop = drop_sorted if order is None else torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class Outputs:
    """What each prompt sampled so far, and why it finished; one per ``generate`` call."""

    def __init__(self, n: int, tok, params: SamplingParams) -> None:
        self.tok = tok
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.reasons: list[str] = ["length"] * n
        self.eos = {tok.eos_token_id} if tok.eos_token_id is not None and not params.ignore_eos else set()
        self.stops = [s for s in params.stop if s]

    def record(self, i: int, token: int, logprob: float) -> bool:
        """Append prompt ``i``'s sampled token; return whether it ended the turn (eos or a stop string)."""
        self.tokens[i].append(token)
        self.logprobs[i].append(logprob)
        if token in self.eos:
            self.reasons[i] = "eos"
        elif self.stops and _ends_with_stop(self.tok, self.tokens[i], self.stops):
            self.reasons[i] = "stop"
        else:
            return False
        return True

    def generations(self) -> list[Generation]:
        return [Generation(t, lp, r) for t, lp, r in zip(self.tokens, self.logprobs, self.reasons)]  # type: ignore[arg-type]


def _ends_with_stop(tok, ids: list[int], stops: list[str]) -> bool:
    """Whether the decoded text of ``ids`` now contains a stop string that ends in its newest token."""
    longest = max(len(s) for s in stops)
    tail = ids[-longest:]  # every token has at least one character, so this covers the longest stop string
    text = tok.decode(tail, skip_special_tokens=False)
    before = tok.decode(tail[:-1], skip_special_tokens=False) if len(tail) > 1 else ""
    return any(s in text and s not in before for s in stops)
