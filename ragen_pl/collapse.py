"""Template-collapse diagnostics (RAGEN-2): does the reasoning still depend on the input?

For sampled pairs (x_i, z_i) of a rollout, X the context up to and including the opening tag of a turn and Z the
text the model wrote after it up to the closing tag (thinking between ``<think>`` and ``</think>``; in answer-only
runs the answer between ``<answer>`` and ``</answer>``; tags excluded), the cross log-probability matrix
``L[i, j] = log p(z_i | x_j)`` scores every sampled Z under every distinct context X of the sample. With the
contexts weighted uniformly (the batch's empirical distribution):

* ``H(Z|X) = -E[log p(z|x)]`` (within-input variability),
* ``H(Z) = -E[log p_mix(z)]``, ``p_mix(z) = (1/N) sum_j p(z|x_j)``,
* ``I(X;Z) = H(Z) - H(Z|X)`` (input dependence; at most ``log N``),
* retrieval accuracy: how often ``argmax_j L[i, j]`` is z_i's own context (chance ``1/N``), top-k too,

each per sequence (sums of token log-probs) and per token (means), as RAGEN-2's
``docs/reference_mutual_information_metrics.md`` defines them. Template collapse is high ``H(Z|X)`` with ``I(X;Z)``
near 0: varied text that no longer reads the state, which entropy and reward-std curves do not show.

Cost: each distinct context runs once and the sampled Z's run on its keys and values, so one call feeds about
``N * |x| + M * N * |z|`` tokens for M samples and N contexts (``time/collapse`` is logged beside the metrics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ragen_pl.config import check_choice, check_int
from ragen_pl.types import TrajectoryBatch

__all__ = ["CollapseConfig", "Pair", "collapse_metrics", "cross_logprobs", "information", "sample_pairs"]

TOP_K = (2, 4, 8)


@dataclass
class CollapseConfig:
    """RAGEN-2's collapse metrics on a sample of each iteration's rollout (``--model.collapse``)."""

    every_n_steps: int = 1
    """Compute them every N training steps."""
    samples: int = 32
    """(context, reasoning) pairs drawn per computation; the cost grows with samples x distinct contexts."""
    turns: str = "first"
    """``first``: each sampled trajectory's first turn; ``trajectory``: a turn drawn uniformly from each sampled
    trajectory (RAGEN-2's trajectory-uniform sampling)."""
    seed: int = 0
    """Seed of the sampling of pairs."""

    def __post_init__(self) -> None:
        check_int("--model.collapse.every_n_steps", self.every_n_steps)
        check_int("--model.collapse.samples", self.samples, 2)
        check_choice("--model.collapse.turns", self.turns, ("first", "trajectory"))


@dataclass
class Pair:
    context: list[int]
    """X: the ids up to and including the turn's opening tag."""
    reasoning: list[int]
    """Z: the sampled ids up to (not including) the closing tag."""


# --------------------------------------------------------------------------------------------- pure math
def information(cross_sum: Tensor, lengths: Tensor, cols: Tensor, weights: Tensor | None = None,
                std_eps: float = 1e-3) -> dict[str, float]:
    """The metrics of a cross log-prob matrix ``cross_sum`` (M, N): ``cross_sum[i, j] = log p(z_i | x_j)`` summed
    over z_i's ``lengths[i]`` tokens, ``cols[i]`` the column of z_i's own context.

    ``weights`` (M,) turn the Monte-Carlo average into a weighted one (default uniform): with every z enumerated and
    ``weights[i] = p(z_i | x_cols[i]) / N`` the estimates are the exact quantities (the brute-force test).
    """
    M, N = cross_sum.shape
    cross_sum = cross_sum.double()
    w = torch.full((M,), 1.0 / M, dtype=torch.float64) if weights is None else weights.double() / weights.sum()
    rows = torch.arange(M)
    out: dict[str, float] = {"mi_upper_bound": math.log(N), "num_pairs": float(M), "num_contexts": float(N)}
    cross_tok = cross_sum / lengths.double().clamp(min=1)[:, None]
    for suffix, cross in (("", cross_tok), ("_seq", cross_sum)):
        matched = cross[rows, cols]
        marginal = torch.logsumexp(cross, 1) - math.log(N)
        out[f"conditional_entropy{suffix}"] = float(-(w * matched).sum())
        out[f"reasoning_entropy{suffix}"] = float(-(w * marginal).sum())
        out[f"mi{suffix}"] = float((w * (matched - marginal)).sum())
        std = float(marginal.std(unbiased=False)) if M > 1 else 0.0
        out[f"mi_zscore{suffix}"] = float((w * (matched - marginal)).sum() / (std + std_eps))
    order = torch.argsort(cross_sum, dim=1, descending=True)
    for k in (1, *TOP_K):
        if k > N or (k > 1 and k == N):
            continue
        hit = (order[:, :k] == cols[:, None]).any(1).double()
        name = "retrieval_accuracy" if k == 1 else f"retrieval_accuracy@{k}"
        out[name] = float((w * hit).sum())
        out[name.replace("accuracy", "chance_level")] = k / N
    return out


# ----------------------------------------------------------------------------------------- the matrix
@torch.no_grad()
def cross_logprobs(model: nn.Module, contexts: list[list[int]], reasonings: list[list[int]], pad_id: int,
                   temperature: float = 1.0) -> Tensor:
    """(M, N) ``log p(reasonings[i] | contexts[j])`` summed over each reasoning's tokens, at ``temperature``.

    Each context runs once; the M reasonings (right-padded) run on its keys and values."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    M = len(reasonings)
    width = max(len(z) for z in reasonings)
    z = torch.full((M, width), pad_id, dtype=torch.long)
    valid = torch.zeros(M, width, dtype=torch.bool)
    for i, r in enumerate(reasonings):
        z[i, :len(r)], valid[i, :len(r)] = torch.tensor(r), True
    z, valid = z.to(device), valid.to(device)
    out = torch.zeros(M, len(contexts), dtype=torch.float64)
    for j, x in enumerate(contexts):
        cache = DynamicCache()
        x_ids = torch.tensor([x], device=device)
        first = model(input_ids=x_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # (1, V)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.expand(M, -1, -1, -1), layer.values.expand(M, -1, -1, -1)
        attn = torch.cat([torch.ones(M, len(x), dtype=torch.long, device=device), valid.long()], 1)
        positions = torch.arange(len(x), len(x) + width, device=device).expand(M, -1)
        rest = model(input_ids=z, attention_mask=attn, position_ids=positions, past_key_values=cache,
                     use_cache=True).logits[:, :-1]  # (M, width - 1, V): the logits of z's tokens 1..
        logits = torch.cat([first.expand(M, 1, -1), rest], 1).float() / temperature  # (M, width, V)
        lp = torch.log_softmax(logits, -1).gather(-1, z[..., None]).squeeze(-1)
        out[:, j] = torch.where(valid, lp, 0.0).sum(-1).double().cpu()
    return out


# --------------------------------------------------------------------------------------------- sampling
def _reasoning_end(tokenizer, sampled: list[int], close: str) -> int:
    """How many of ``sampled`` come before the closing tag (all of them if it never appears)."""
    for n in range(1, len(sampled) + 1):
        if close in tokenizer.decode(sampled[:n], skip_special_tokens=False):
            return n - 1  # the n-th token completed the tag: Z stops before it
    return len(sampled)


def sample_pairs(batch: TrajectoryBatch, tokenizer, config: CollapseConfig, generator: torch.Generator) -> list[Pair]:
    """Up to ``config.samples`` (context, reasoning) pairs from as many of ``batch``'s trajectories, drawn uniformly;
    a turn per trajectory (its first, or one drawn uniformly); pairs whose Z is empty are skipped."""
    inverse, first = batch.trajectory_index()
    pairs: list[Pair] = []
    for t in torch.randperm(len(first), generator=generator).tolist():
        rows = (inverse == t).nonzero().flatten().tolist()  # one row, or one per turn with a context window
        turns = [(b, turn) for b in rows
                 for turn in sorted({int(x) for x in batch.turn_ids[b][batch.loss_mask[b]].tolist()})]
        if not turns:
            continue
        pick = 0 if config.turns == "first" else int(torch.randint(len(turns), (1,), generator=generator))
        b, turn = turns[pick]
        positions = ((batch.turn_ids[b] == turn) & batch.loss_mask[b]).nonzero().flatten().tolist()
        context = batch.input_ids[b, :positions[0]].tolist()
        sampled = batch.input_ids[b, positions].tolist()
        opening = tokenizer.decode(context[-8:], skip_special_tokens=False)
        close = "</think>" if opening.rstrip().endswith("<think>") else "</answer>"
        z = sampled[:_reasoning_end(tokenizer, sampled, close)]
        if z:
            pairs.append(Pair(context, z))
        if len(pairs) == config.samples:
            break
    return pairs


def collapse_metrics(model: nn.Module, tokenizer, batch: TrajectoryBatch, config: CollapseConfig,
                     generator: torch.Generator, prefix: str = "collapse") -> dict[str, float]:
    """The metrics of a sample of ``batch`` under ``model`` (keys ``<prefix>/<name>``), and per env tag
    (``<prefix>/<tag>/<name>``, ``config.samples`` pairs each) when the batch has several: across envs the contexts
    differ in kind, and I(X;Z) would mostly say which env a reasoning belongs to. Empty where fewer than two pairs or
    one distinct context are found."""
    import time

    start = time.perf_counter()
    out = _metrics_of(model, tokenizer, batch, config, generator, prefix)
    tags = sorted(set(batch.env_tags))
    if len(tags) > 1:
        for tag in tags:
            rows = torch.tensor([t == tag for t in batch.env_tags])
            out.update(_metrics_of(model, tokenizer, batch.select(rows), config, generator, f"{prefix}/{tag}"))
    out["time/collapse"] = time.perf_counter() - start
    return out


def _metrics_of(model: nn.Module, tokenizer, batch: TrajectoryBatch, config: CollapseConfig,
                generator: torch.Generator, prefix: str) -> dict[str, float]:
    pairs = sample_pairs(batch, tokenizer, config, generator)
    contexts: dict[tuple[int, ...], int] = {}
    cols = torch.tensor([contexts.setdefault(tuple(p.context), len(contexts)) for p in pairs], dtype=torch.long)
    if len(pairs) < 2 or len(contexts) < 2:
        return {}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    try:
        cross = cross_logprobs(model, [list(c) for c in contexts], [p.reasoning for p in pairs], pad,
                               batch.temperature)
    finally:
        model.train(was_training)
    lengths = torch.tensor([len(p.reasoning) for p in pairs])
    out = {f"{prefix}/{k}": v for k, v in information(cross, lengths, cols).items()}
    out[f"{prefix}/reasoning_tokens"] = float(lengths.double().mean())
    return out
