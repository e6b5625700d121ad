"""Scoring tokens a model sampled: per-token log-probs and entropy, with the LM head run only where needed.

Used by the update (old, new and reference log-probs), by SFT (cross-entropy on assistant tokens) and by the
collapse diagnostics. Prompts and env text need no logits: for a 0.5B Qwen the head is over a quarter of the model's
FLOPs, and (B, T, V) float32 logits are gigabytes, so only the positions of ``mask`` reach the head and the float32
log-softmax.

Log-probs are those of the distribution the tokens were sampled from: logits divided by the sampling temperature
(the batch carries it: :attr:`ragen_pl.types.TrajectoryBatch.temperature`).

Shared prefix: the rows of a micro-batch start with the same prompt tokens (the system prompt and the env's
instructions; a group's whole first prompt). :func:`forward_shared` runs that prefix once, for one row, and the rest
of every row on top of its keys and values, expanded to the batch: gradients flow back through the prefix as they
would through each row's copy, so losses and gradients are those of the plain forward (tests/test_scoring.py) for
about a third less compute on FrozenLake's rows.

Packed rows (``PPOConfig.pack``): a micro-batch's rows, without their padding, run as one sequence whose position ids
restart at every row; transformers then keeps the rows apart (a block-diagonal causal mask; variable-length kernels
under flash attention), so no position is spent on padding. :func:`check_packing` refuses, once per model, a model
that lets packed rows see each other.

Where the head runs: :func:`scored_positions` says which positions of a micro-batch reach the LM head and which of
those score a token; :func:`scores_from_logits` turns the head's logits into :class:`Scores`. An update that runs the
head another way (on inputs it kept, say) uses the two and stays consistent with :func:`score`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ragen_pl.errors import ConfigError

__all__ = ["Scores", "can_share", "check_packing", "entropy_from_logits", "forward_packed", "forward_shared",
           "logprobs_from_logits", "pack_rows", "prefix_to_share", "restrict_to_kept", "score", "scored_logits",
           "scored_positions", "scores_from_logits", "shared_prefix_length", "shift_values", "token_stats",
           "unpack_rows"]

#: A shared prefix shorter than this is not worth a second forward call.
MIN_SHARED_PREFIX = 16

def shared_prefix_length(ids: Tensor, mask: Tensor) -> int:
    """How many leading tokens every row of ``ids`` (B, T) shares and no position of ``mask`` needs logits or hidden
    states for: at most the first scored position minus one (its logits sit at the position before it)."""
    if ids.shape[0] < 2 or not bool(mask.any()):
        return 0
    same = (ids == ids[:1]).all(0)  # (T,)
    common = int(same.long().cumprod(0).sum())
    first_scored = int(mask.float().argmax(-1)[mask.any(-1)].min())
    return max(0, min(common, first_scored - 1))


def can_share(model: nn.Module) -> bool:
    """A transformers model that takes a KV cache: not gradient checkpointed (it refuses a cache in training), not
    sharded (an FSDP1 root expects one forward per backward)."""
    from ragen_pl.dist import is_sharded

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return False
    return not getattr(model, "is_gradient_checkpointing", False) and not is_sharded(model)


def forward_shared(model: nn.Module, ids: Tensor, attn: Tensor, prefix: int, **kwargs: Any) -> Any:
    """``model`` on (B, T) rows whose first ``prefix`` tokens are the same: the prefix once, then the rest of every
    row on its keys and values, expanded to the batch. The output covers positions ``prefix..T-1`` (a
    ``logits_to_keep`` tensor counts from there; ``hidden_states`` are (B, T - prefix, H))."""
    from transformers import DynamicCache

    B = ids.shape[0]
    cache = DynamicCache()
    head = {"logits_to_keep": 1} if "logits_to_keep" in kwargs else {}  # a causal LM: no logits needed here
    model(input_ids=ids[:1, :prefix], past_key_values=cache, use_cache=True, **head)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.expand(B, -1, -1, -1), layer.values.expand(B, -1, -1, -1)
    positions = torch.arange(prefix, ids.shape[1], device=ids.device).expand(B, -1)
    return model(input_ids=ids[:, prefix:], attention_mask=attn, position_ids=positions, past_key_values=cache,
                 use_cache=True, **kwargs)


def pack_rows(ids: Tensor, attn: Tensor) -> tuple[Tensor, Tensor]:
    """(B, T) right-padded rows -> (1, L) their real tokens one row after another and (1, L) position ids that
    restart at 0 with every row (L = the number of real tokens)."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return ids[attn][None], positions[attn][None]


def unpack_rows(x: Tensor, attn: Tensor) -> Tensor:
    """(1, L, ...) per packed position -> (B, T, ...) at each row's real positions, zeros on the padding."""
    out = x.new_zeros(*attn.shape, *x.shape[2:])
    out[attn] = x[0]
    return out


def forward_packed(model: nn.Module, ids: Tensor, attn: Tensor, **kwargs: Any) -> Any:
    """``model`` on the (B, T) right-padded rows packed into one sequence (:func:`pack_rows`). The output covers the
    L packed positions (a ``logits_to_keep`` tensor indexes them; ``hidden_states`` are (1, L, H))."""
    check_packing(model)
    flat, positions = pack_rows(ids, attn)
    return model(input_ids=flat, position_ids=positions, attention_mask=None, **{"use_cache": False, **kwargs})


_PACKING_CHECKED: weakref.WeakSet = weakref.WeakSet()


@torch.no_grad()
def check_packing(model: nn.Module) -> None:
    """Refuse (once per model) a model whose attention lets packed rows see each other: the second of two packed
    rows must get the hidden states it gets alone. Costs two forwards of a few tokens, the first time."""
    if model in _PACKING_CHECKED:
        return
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2) or 2)
    first = torch.arange(8, device=device) % vocab
    second = (torch.arange(8, device=device) * 7 + 3) % vocab
    was_training = model.training
    model.eval()
    try:
        alone = model(input_ids=second[None], output_hidden_states=True, use_cache=False).hidden_states[-1][0]
        packed = model(input_ids=torch.cat([first, second])[None], use_cache=False, output_hidden_states=True,
                       position_ids=torch.arange(8, device=device).repeat(2)[None], attention_mask=None
                       ).hidden_states[-1][0, 8:]
    finally:
        model.train(was_training)
    error = float((packed.float() - alone.float()).norm() / alone.float().norm().clamp(min=1e-6))
    if not error < 0.1:
        raise ConfigError(f"--model.ppo.pack=true: {type(model).__name__} lets packed rows attend to each other "
                          f"(hidden states off by {error:.2f} relative); set --model.ppo.pack=false")
    _PACKING_CHECKED.add(model)


def scored_positions(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Where the LM head runs for a (B, T) ``mask`` of scored tokens in the padded layout: ``cols`` (C,), the positions
    some row scores (the logits at t-1 score token t), and ``keep`` (B, C), which of each row's C head outputs score one
    of its tokens. ``head_input[keep]`` lists the scored positions row-major, the order of ``mask[:, 1:]``."""
    target = mask[:, 1:]
    cols = target.any(0).nonzero().squeeze(-1)
    return cols, target[:, cols]


def scored_logits(model: nn.Module, ids: Tensor, attn: Tensor, mask: Tensor, prefix: int = 0, pack: bool = False,
                  **kwargs: Any) -> tuple[Any, Tensor, Tensor]:
    """Forward ``model`` with its LM head run only where a token of ``mask`` is scored.

    With ``prefix`` >= :data:`MIN_SHARED_PREFIX` (see :func:`prefix_to_share`) the rows' common first ``prefix``
    tokens run once (:func:`forward_shared`); the output then starts at the prefix's end. With ``pack`` the rows run
    packed (:func:`forward_packed`); the output covers the packed positions. Returns the model output, the (N, V)
    logits scoring the N tokens of ``mask`` (row-major order, as ``mask[:, 1:]`` lists them) and those N token ids.
    """
    target = mask[:, 1:]  # (B, T-1): the logits at t-1 score token t
    if pack:
        packed_index = attn.flatten().cumsum(0).view_as(attn) - 1  # (B, T): each real position's packed index
        out = forward_packed(model, ids, attn, logits_to_keep=packed_index[:, :-1][target], **kwargs)
        return out, out.logits[0], ids[:, 1:][target]
    cols, keep = scored_positions(mask)
    if prefix >= MIN_SHARED_PREFIX:
        out = forward_shared(model, ids, attn, prefix, logits_to_keep=cols - prefix, **kwargs)
    else:
        out = model(input_ids=ids, attention_mask=attn, logits_to_keep=cols, **{"use_cache": False, **kwargs})
    return out, out.logits[keep], ids[:, 1:][:, cols][keep]


def prefix_to_share(model: nn.Module, ids: Tensor, mask: Tensor) -> int:
    """The shared prefix :func:`scored_logits` should run once for these rows (0: none worth it, or a model that
    cannot)."""
    prefix = shared_prefix_length(ids, mask) if can_share(model) else 0
    return prefix if prefix >= MIN_SHARED_PREFIX else 0


class _TokenStats(torch.autograd.Function):
    """Log-probs of ``labels`` and entropy under (N, V) ``logits``, a chunk of rows at a time, forward and backward.

    Only ``logits`` (in their own dtype: bf16 under autocast) are kept for backward; the float32 softmax of a chunk
    exists while that chunk is processed. Autograd through ``logits.float()`` and ``logsumexp`` would keep a float32
    copy of every row (the whole (N, V) in float32, twice the bf16 logits) until backward.

    Gradients: ``d log p(y) / dz = onehot(y) - p``; ``dH / dz = -p (z - E_p[z])`` (0 where p = 0: tokens outside a
    kept set, at -inf).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, chunk: int, with_entropy: bool):  # type: ignore[override]
        n = logits.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            z = logits[s:s + chunk].float()
            lse = torch.logsumexp(z, -1)
            lp[s:s + chunk] = z.gather(-1, labels[s:s + chunk, None]).squeeze(-1) - lse
            if with_entropy:
                p = torch.exp(z - lse[:, None])
                ent[s:s + chunk] = lse - torch.where(p > 0, p * z, 0.0).sum(-1)
        ctx.save_for_backward(logits, labels)
        ctx.chunk, ctx.with_entropy = chunk, with_entropy
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: Tensor, g_ent: Tensor):  # type: ignore[override]
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            e = s + ctx.chunk
            z = logits[s:e].float()
            p = torch.softmax(z, -1)
            g = -p * g_lp[s:e, None]
            g.scatter_add_(-1, labels[s:e, None], g_lp[s:e, None])
            if ctx.with_entropy and g_ent is not None:
                z_mean = torch.where(p > 0, p * z, 0.0).sum(-1, keepdim=True)
                g -= torch.where(p > 0, p * (z - z_mean), 0.0) * g_ent[s:e, None]
            grad[s:e] = g.to(grad.dtype)
        return grad, None, None, None


def token_stats(logits: Tensor, labels: Tensor, entropy: bool = False, chunk: int = 1024
                ) -> tuple[Tensor, Tensor | None]:
    """(N,) float32 log-probs of ``labels`` under (N, V) ``logits`` and, with ``entropy``, the (N,) entropies; the
    float32 softmax exists for ``chunk`` rows at a time, in forward and backward (:class:`_TokenStats`)."""
    lp, ent = _TokenStats.apply(logits, labels, chunk, entropy)
    return lp, ent if entropy else None


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``log softmax(logits)[labels]``, (..., V), (...) -> (...) float32 (see :func:`token_stats`)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return token_stats(flat, labels.reshape(-1))[0].reshape(labels.shape)


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last axis, (..., V) -> (...), float32 (see :func:`token_stats`)."""
    flat = logits.reshape(-1, logits.shape[-1])
    labels = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    return token_stats(flat, labels, entropy=True, chunk=chunk_size)[1].reshape(logits.shape[:-1])


def restrict_to_kept(logits: Tensor, kept: Tensor) -> Tensor:
    """(N, V) ``logits`` with every id outside each row's kept set (``kept`` (N, K), -1 padded) at -inf: the
    distribution a top-k / top-p sampler drew from. Rows without a kept set (all -1) stay whole."""
    has = (kept >= 0).any(-1)
    if not bool(has.any()):
        return logits
    # Padding points at the row's first kept id (a duplicate write of True): writing False for it instead could land
    # after a real id's True when that id is 0.
    index = torch.where(kept >= 0, kept, kept[:, :1]).clamp(min=0).long()
    allowed = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, index, True)
    allowed[~has] = True
    return logits.masked_fill(~allowed, float("-inf"))


def shift_values(v: Tensor) -> Tensor:
    """(B, T) values read at each position, moved one to the right: ``values[:, t]`` is the value of the state
    *before* token t (the alignment of log-probs), and position 0 is 0."""
    return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1).float()


@dataclass
class Scores:
    logprobs: Tensor
    """(B, T) float32 log-prob of each token of ``mask`` (0 elsewhere)."""
    entropy: Tensor | None = None
    """(B, T) float32 entropy of the distribution each token of ``mask`` was drawn from (0 elsewhere)."""
    hidden: Tensor | None = None
    """(B, T, H) the last hidden states (for a value head on the policy's trunk)."""
    positions: int = 0
    """Positions the model's trunk ran over (padding included; a shared prefix once): its FLOPs' token count."""
    scored: int = 0
    """Tokens scored (log-probs taken)."""
    head_positions: int = 0
    """Positions the LM head computed logits at: every row at each column some row scores (padded layout), the
    scored tokens (packed): what the head's FLOPs count."""


def _spread(target: Tensor, values: Tensor) -> Tensor:
    """(N,) values of the true positions of ``target`` (B, T-1) -> (B, T), position 0 and the rest 0."""
    pad = torch.zeros_like(target[:, :1], dtype=values.dtype)
    return torch.cat([pad, torch.zeros_like(target, dtype=values.dtype).masked_scatter(target, values)], 1)


def score(model: nn.Module, ids: Tensor, attn: Tensor, mask: Tensor, temperature: float = 1.0,
          entropy: bool = False, hidden: bool = False, share_prefix: bool = False, kept: Tensor | None = None,
          pack: bool = False) -> Scores:
    """Log-probs of ``ids`` at the positions of ``mask`` under ``model`` at ``temperature``; optionally the entropy
    there and the last hidden states (zeros on a shared prefix, where nothing is scored, and on padding). With
    ``kept`` (B, T, K), each token is scored over the ids its sampler kept (the sampling-mask replay of top-k / top-p
    sampling). ``pack`` runs the rows packed, without padding (it takes precedence over ``share_prefix``). No
    (B, T, V) tensor is built.
    """
    kwargs = {"output_hidden_states": hidden} if hidden else {}
    prefix = prefix_to_share(model, ids, mask) if share_prefix and not pack else 0
    out, logits, labels = scored_logits(model, ids, attn, mask, prefix=prefix, pack=pack, **kwargs)
    states = None
    if hidden:
        states = out.hidden_states[-1]
        if pack:
            states = unpack_rows(states, attn)
        elif states.shape[1] < ids.shape[1]:  # the prefix ran once: pad it back to (B, T, H)
            states = torch.cat([states.new_zeros(ids.shape[0], ids.shape[1] - states.shape[1], states.shape[2]),
                                states], 1)
    s = scores_from_logits(logits, labels, mask, temperature, kept=kept, entropy=entropy)
    s.hidden = states
    s.head_positions = labels.numel() if pack else ids.shape[0] * int(mask[:, 1:].any(0).sum())
    s.positions = int(attn.sum()) if pack else ids.numel() - (ids.shape[0] - 1) * prefix
    return s


def scores_from_logits(logits: Tensor, labels: Tensor, mask: Tensor, temperature: float = 1.0,
                       kept: Tensor | None = None, entropy: bool = False) -> Scores:
    """:class:`Scores` of the N tokens of ``mask`` (B, T) from the (N, V) ``logits`` that score them (row-major,
    the order of ``mask[:, 1:]``) and their (N,) ``labels``: divided by ``temperature``, restricted to each token's
    ``kept`` set (B, T, K) when given."""
    target = mask[:, 1:]
    logits = logits / temperature  # (N, V)
    if kept is not None:
        logits = restrict_to_kept(logits, kept[:, 1:][target])
    lp, ent = token_stats(logits, labels, entropy=entropy)
    return Scores(logprobs=_spread(target, lp), entropy=_spread(target, ent) if ent is not None else None,
                  scored=int(labels.numel()))
