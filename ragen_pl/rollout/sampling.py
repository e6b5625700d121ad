"""Sampling one token per row from logits, with the log-prob of the distribution actually sampled from
(temperature, top-k and top-p applied), as every engine reports it, and the set of tokens that distribution kept
(so the update can score each token over the same set: ``PPOConfig.replay_sampling_mask``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ragen_pl.rollout.engine import Generation, SamplingParams

__all__ = ["MAX_KEPT", "Outputs", "sample_next", "truncates"]

#: A kept set larger than this (top-p alone over a flat distribution) is not recorded: that token is scored over the
#: whole vocabulary, and counted (``rollout/unreplayed_tokens``).
MAX_KEPT = 1024


def truncates(params: SamplingParams, vocab: int) -> bool:
    """Whether sampling with ``params`` draws from fewer tokens than the vocabulary (top-k or top-p, not greedy)."""
    return params.temperature > 0 and (0 < params.top_k < vocab or params.top_p < 1.0)


def sample_next(logits: Tensor, params: SamplingParams, generator: torch.Generator | None, with_kept: bool = False
                ) -> tuple[Tensor, ...]:
    """Sample one token per row of (N, V) logits; return ids (N,) and their log-probs (N,) after processing, and with
    ``with_kept`` the (N, K) vocabulary ids each row drew from (-1 padded; None when nothing was truncated; a row
    of -1 when its set is larger than :data:`MAX_KEPT`).

    With top-k the rest happens among the k best tokens, an (N, k) problem already sorted for top-p, instead of
    the whole vocabulary (exactly k tokens: a tie at the k-th logit is broken by index). Top-p alone sorts the
    vocabulary.
    """
    logits = logits.float()
    if params.temperature == 0:
        ids = logits.argmax(-1)
        out = (ids, torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1))
        return (*out, None) if with_kept else out
    logits = logits / params.temperature
    candidates = None  # (N, k) vocabulary ids of the top-k logits, when top-k is on
    if 0 < params.top_k < logits.shape[-1]:
        logits, candidates = torch.topk(logits, params.top_k, dim=-1)  # sorted, largest first
    order = None
    if params.top_p < 1.0:
        logits, order = _top_p(logits, params.top_p, presorted=candidates is not None)
    logp = torch.log_softmax(logits, -1)
    pick = torch.multinomial(logp.exp(), 1, generator=generator)  # (N, 1)
    ids = pick if candidates is None else candidates.gather(-1, pick)
    out = (ids.squeeze(-1), logp.gather(-1, pick).squeeze(-1))
    if not with_kept:
        return out
    return (*out, _kept(logits, candidates, order))


def _kept(logits: Tensor, candidates: Tensor | None, order: Tensor | None) -> Tensor | None:
    """(N, K) ids with a finite processed logit (-1 padded), or None when nothing was truncated."""
    if candidates is not None:  # top-k (and maybe top-p among the k)
        return candidates.masked_fill(torch.isinf(logits), -1)
    if order is None:
        return None
    keep_sorted = torch.isfinite(logits.gather(-1, order))  # (N, V), in descending order of logits
    counts = keep_sorted.sum(-1)
    width = min(int(counts.max()), MAX_KEPT)
    kept = order[:, :width].masked_fill(~keep_sorted[:, :width], -1)
    return kept.masked_fill((counts > MAX_KEPT)[:, None], -1)


def _top_p(logits: Tensor, top_p: float, presorted: bool) -> tuple[Tensor, Tensor | None]:
    """``logits`` with every token outside the nucleus (the fewest top tokens holding ``top_p`` of the mass) at -inf,
    and the descending order it sorted them in (None if they came sorted)."""
    sorted_logits, order = (logits, None) if presorted else torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, -1)
    drop_sorted = probs.cumsum(-1) - probs >= top_p  # mass before a token; keeps at least the top one
    drop = drop_sorted if order is None else torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf")), order


class Outputs:
    """What each prompt sampled so far, and why it finished; one per ``generate`` call."""

    def __init__(self, n: int, tok, params: SamplingParams) -> None:
        self.tok = tok
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.kept: list[list[list[int]]] = [[] for _ in range(n)]
        self.reasons: list[str] = ["length"] * n
        self.eos = {tok.eos_token_id} if tok.eos_token_id is not None and not params.ignore_eos else set()
        self.stops = [s for s in params.stop if s]

    def record(self, i: int, token: int, logprob: float, kept: list[int] | None = None) -> bool:
        """Append prompt ``i``'s sampled token (and the ids it was drawn from, when truncated); return whether it
        ended the turn (eos or a stop string)."""
        self.tokens[i].append(token)
        self.logprobs[i].append(logprob)
        if kept is not None:
            self.kept[i].append([k for k in kept if k >= 0])
        if token in self.eos:
            self.reasons[i] = "eos"
        elif self.stops and _ends_with_stop(self.tok, self.tokens[i], self.stops):
            self.reasons[i] = "stop"
        else:
            return False
        return True

    def generations(self) -> list[Generation]:
        return [Generation(t, lp, r, kept if len(kept) == len(t) and t else None)  # type: ignore[arg-type]
                for t, lp, r, kept in zip(self.tokens, self.logprobs, self.reasons, self.kept)]


def _ends_with_stop(tok, ids: list[int], stops: list[str]) -> bool:
    """Whether the decoded text of ``ids`` now contains a stop string that ends in its newest token."""
    longest = max(len(s) for s in stops)
    tail = ids[-longest:]  # every token has at least one character, so this covers the longest stop string
    text = tok.decode(tail, skip_special_tokens=False)
    before = tok.decode(tail[:-1], skip_special_tokens=False) if len(tail) > 1 else ""
    return any(s in text and s not in before for s in stops)
