"""The readout head of the SmolLM2 CPU runs: a LoRA adapter on the output head that reads the last hidden state less
the part every input shares, optionally whitened, optionally moving only a few tokens' logits.

A :class:`ragen_pl.hooks.ModelHook` (``--model.hooks=[readout_head]``, with ``--model.lora.target_modules=[lm_head]``)
plus :class:`StandardisedValues`, a hook that builds a standardised value head. Their statistics are fitted by
:class:`ragen_pl_experiments.update.ReadoutUpdate` before the first update; a training forward of an unfitted head
is refused, so no forward fits state behind the update's back.

Why (docs/experiments/smollm2.md has the measurements): SmolLM2's last hidden state is mostly what every prompt
shares, so an adapter reading it moves the answer every board gets through the shared part, far faster than the part
that depends on the board. The centred head's adapter reads ``h - U U^T h``, ``U`` the ``center`` leading directions of
the second moment of the hidden states at the scored positions (each kind of scored position, the action, then
``</``, ``answer``, ``>``, has its own shared part, so one direction is not enough). ``whiten`` divides each dimension
of that by its root mean square ``s``; ``center_turns`` also leaves out the directions along which the turns' mean
states differ (a multi-turn prompt's own text, ``Turn 3``, moves the state as much as the board does). ``tokens``
makes the adapter a readout that moves only those tokens' logits: ``lora_B`` fixed to one-hot columns, ``lora_A``
trained from zero. All of it stays linear, ``A' = A diag(1/s) (I - U U^T)``, so the adapter folds into plain LoRA
weights for merges and exports (:meth:`ReadoutHead.merging`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ragen_pl.config import check_int
from ragen_pl.dist import max_over_processes, sum_over_processes
from ragen_pl.hooks import ModelHook
from ragen_pl.policy import zero_head

__all__ = ["FEATURE_SCALE", "SHARED_DIRECTIONS", "ReadoutHead", "StandardisedHead", "StandardisedValues",
           "fit_readout_heads", "head_token_ids", "project_out", "readout_unfitted", "root_mean_square",
           "shared_directions", "turn_directions"]

SHARED_DIRECTIONS = "shared_directions"
"""The buffer of a centred head's ``lora_A`` module: the (hidden, k) orthonormal directions ``U`` it leaves out (zeros
until fitted). With ``center_turns``, its last ``center_turns`` columns are the turn directions."""

TURN_DIRECTIONS = "ragen_pl_turn_directions"
"""The attribute of a turn-centred head's ``lora_A`` module: how many of the columns of ``U`` are turn directions."""

FEATURE_SCALE = "feature_scale"
"""The buffer of a whitened head's ``lora_A`` module: the (hidden,) root mean squares ``s`` it divides by."""

UNFITTED = ("the readout head (`--model.hooks` ReadoutHead with center > 0) is fitted before the first update by "
            "`--model.updater=ragen_pl_experiments.update.ReadoutUpdate`; this run trains it unfitted")


class ReadoutHead(ModelHook):
    """The output head's LoRA adapter as a readout of the centred (and whitened) last hidden state.

    Args:
        center: leading directions of the scored positions' hidden states the adapter leaves out (0: none; about the
            number of kinds of answer token, 4 for FrozenLake's ``Up</answer>``).
        center_turns: with ``center``, also up to this many directions of the turns' mean states (0: none).
        whiten: with ``center``, divide each dimension of the centred state by its root mean square.
        tokens: the adapter moves only these tokens' logits (each one token of the model's vocabulary), with rank
            the number of tokens; None: a plain adapter on every token.
    """

    def __init__(self, center: int = 0, center_turns: int = 0, whiten: bool = False,
                 tokens: list[str] | None = None) -> None:
        check_int("--model.hooks.init_args.center", center, low=0)
        check_int("--model.hooks.init_args.center_turns", center_turns, low=0)
        if not isinstance(whiten, bool):
            raise ValueError(f"`--model.hooks.init_args.whiten` must be true or false, got {whiten!r}")
        if (center_turns or whiten) and not center:
            raise ValueError("`--model.hooks.init_args.center_turns` and `whiten` act on the centred state: they need "
                             f"`center` >= 1, got center {center}")
        if tokens is not None and (isinstance(tokens, str) or not tokens or len(set(tokens)) != len(tokens)
                                   or not all(isinstance(t, str) and t for t in tokens)):
            raise ValueError(f"`--model.hooks.init_args.tokens` must be a list of distinct non-empty strings, got "
                             f"{tokens!r}")
        self.center, self.center_turns, self.whiten = center, center_turns, whiten
        self.tokens = list(tokens) if tokens is not None else None

    def after_load(self, policy: nn.Module, tokenizer: Any) -> nn.Module:
        head = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
        if head is None or not hasattr(head, "lora_A") or "default" not in head.lora_A:
            raise ValueError("ReadoutHead adapts the output head: it needs `--model.lora.target_modules` with lm_head")
        if self.tokens is not None:
            _readout(head, head_token_ids(tokenizer, self.tokens))
        if self.center:
            lora_a = head.lora_A["default"]
            if self.center + self.center_turns > lora_a.in_features:
                raise ValueError(f"`--model.hooks.init_args.center` plus `center_turns` must be at most the hidden size "
                                 f"{lora_a.in_features}, got {self.center} + {self.center_turns}")
            lora_a.register_buffer(SHARED_DIRECTIONS, torch.zeros(lora_a.in_features, self.center + self.center_turns,
                                                                  dtype=lora_a.weight.dtype))
            setattr(lora_a, TURN_DIRECTIONS, self.center_turns)
            if self.whiten:
                lora_a.register_buffer(FEATURE_SCALE, torch.ones(lora_a.in_features, dtype=lora_a.weight.dtype))
            lora_a.register_forward_pre_hook(_project_out_shared)
        return policy

    @contextmanager
    def merging(self, policy: nn.Module) -> Iterator[None]:
        """Within: each centred head's ``lora_A`` weight holds ``A diag(1/s) (I - U U^T)``, plain LoRA on the hidden
        state, so that merging it is exact; the trained weight comes back on exit. Row by row, so under FSDP2 each
        process folds its own rows."""
        saved = []
        for module in policy.modules():
            u = getattr(module, SHARED_DIRECTIONS, None)
            if isinstance(module, nn.Linear) and u is not None and bool(u.any()):
                w = module.weight
                w = w.to_local() if hasattr(w, "to_local") else w  # a DTensor sharded by rows (FSDP2's dim 0)
                saved.append((w, w.detach().clone()))
                with torch.no_grad():
                    scale = getattr(module, FEATURE_SCALE, None)
                    if scale is not None:
                        w /= scale.to(w.dtype)
                    u = u.to(w.dtype)
                    w -= (w @ u) @ u.T
        try:
            yield
        finally:
            with torch.no_grad():
                for w, trained in saved:
                    w.copy_(trained)


def head_token_ids(tokenizer: Any, tokens: list[str]) -> list[int]:
    """The ids of ``tokens``, each one token of ``tokenizer``'s vocabulary."""
    if tokenizer is None:
        raise ValueError("`--model.hooks.init_args.tokens` needs the model's tokenizer")
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"`--model.hooks.init_args.tokens`: {token!r} is {len(encoded)} tokens of this model's "
                             f"tokenizer ({[tokenizer.decode([i]) for i in encoded]}); each must be one")
        ids.append(encoded[0])
    return ids


def _readout(head: nn.Module, ids: list[int]) -> None:
    """Replace the head's adapter by a readout of rank len(ids): ``lora_A`` (k, H) from zero, ``lora_B`` (V, k) fixed
    one-hot on the tokens' rows, scaling 1, so the readout's weights are ``lora_A`` itself."""
    a, b = head.lora_A["default"], head.lora_B["default"]
    k = len(ids)
    new_a = nn.Linear(a.in_features, k, bias=False, dtype=a.weight.dtype, device=a.weight.device)
    new_b = nn.Linear(k, b.out_features, bias=False, dtype=b.weight.dtype, device=b.weight.device)
    with torch.no_grad():
        new_a.weight.zero_()
        new_b.weight.zero_()
        new_b.weight[torch.tensor(ids), torch.arange(k)] = 1.0
    new_b.weight.requires_grad_(False)
    head.lora_A["default"], head.lora_B["default"] = new_a, new_b
    head.r["default"], head.lora_alpha["default"], head.scaling["default"] = k, k, 1.0


def _project_out_shared(module: nn.Linear, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    (h,) = args  # (..., H): the hidden states the head reads
    directions = getattr(module, SHARED_DIRECTIONS)
    if not bool(directions.any()):
        if torch.is_grad_enabled() and module.training:
            raise RuntimeError(UNFITTED)
        return args  # before its first update the adapter is 0: nothing depends on U yet
    h = project_out(h, directions.to(h.dtype))
    scale = getattr(module, FEATURE_SCALE, None)
    return (h if scale is None else h / scale.to(h.dtype),)


def readout_unfitted(policy: nn.Module) -> bool:
    """Whether ``policy`` has a centred head whose directions are not fitted yet."""
    return any(not bool(u.any()) for m in policy.modules()
               if isinstance(m, nn.Linear) and (u := getattr(m, SHARED_DIRECTIONS, None)) is not None)


def fit_readout_heads(policy: nn.Module, rows: Tensor, turns: Tensor | None = None) -> None:
    """Fix ``U`` (and ``s``) of each centred head of ``policy`` not fitted yet from ``rows`` (N, H), what the head reads
    at N scored positions, and ``turns`` (N,), their turns (needed with ``center_turns``); over every process's rows."""
    for module in policy.modules():
        directions = getattr(module, SHARED_DIRECTIONS, None)
        if not isinstance(module, nn.Linear) or directions is None or bool(directions.any()):
            continue
        n_turns = getattr(module, TURN_DIRECTIONS, 0)
        u = shared_directions(rows, directions.shape[1] - n_turns)
        if n_turns:
            if turns is None or turns.shape != rows.shape[:1] or bool((turns < 0).any()):
                raise RuntimeError("the turn-centred head needs the turn of each scored position")
            u = torch.cat([u, turn_directions(project_out(rows.double(), u), turns, n_turns)], 1)
        directions.copy_(u)
        if hasattr(module, FEATURE_SCALE):
            getattr(module, FEATURE_SCALE).copy_(root_mean_square(project_out(rows.double(), directions.double())))


def shared_directions(h: Tensor, k: int) -> Tensor:
    """The (H, k) leading eigenvectors of the second moment of the rows of ``h`` (n, H), summed over processes so
    that every process leaves out the same directions."""
    h = h.detach().reshape(-1, h.shape[-1]).double()
    _, vectors = torch.linalg.eigh(sum_over_processes(h.T @ h))  # ascending eigenvalues
    return vectors[:, -k:].flip(-1)


def turn_directions(x: Tensor, turns: Tensor, n: int) -> Tensor:
    """(H, n) orthonormal directions along which the mean of the rows of ``x`` (N, H) differs between their
    ``turns`` (N,): the n leading eigenvectors of the between-turn scatter ``sum_t N_t (m_t - m)(m_t - m)^T`` (m_t the
    mean of turn t's rows, m of all rows), summed over processes; zero columns beyond its rank (turns - 1)."""
    x = x.detach().reshape(-1, x.shape[-1]).double()
    top = max_over_processes(int(turns.max()) + 1 if turns.numel() else 0)
    sums = sum_over_processes(x.new_zeros(top, x.shape[1]).index_add_(0, turns, x))
    counts = sum_over_processes(torch.bincount(turns, minlength=top).to(x.dtype))
    seen = counts > 0
    means = sums[seen] / counts[seen, None]
    scatter = (means - sums.sum(0) / counts.sum()) * counts[seen, None].sqrt()
    _, values, vectors = torch.linalg.svd(scatter, full_matrices=False)  # descending
    rank = int((values > 1e-9 * values[:1].clamp_min(1e-300)).sum()) if len(values) else 0
    out = x.new_zeros(x.shape[1], n)
    out[:, :min(n, rank)] = vectors[:min(n, rank)].T
    return out


def root_mean_square(x: Tensor, floor: float = 1e-2) -> Tensor:
    """The (H,) root mean square of each column of ``x`` (n, H), over every process's rows; columns below ``floor``
    times the mean of the columns' values are raised to it (a dimension that barely varies is not amplified)."""
    stats = sum_over_processes(torch.cat([x.pow(2).sum(0), x.new_tensor([x.shape[0]])]))
    rms = (stats[:-1] / stats[-1].clamp_min(1)).sqrt()
    return rms.clamp_min(floor * float(rms.mean()))


def project_out(h: Tensor, directions: Tensor) -> Tensor:
    """``h`` (..., H) less its components along the orthonormal columns of ``directions`` (H, k)."""
    return h - (h @ directions) @ directions.T


class StandardisedHead(nn.Module):
    """A value head on the policy's last hidden state that reads each dimension less its mean, divided by its root
    mean square deviation, both fixed by :meth:`fit` from the states of the first update's scored positions. It
    starts at 0, so nothing before the fit depends on it; a training forward before the fit is refused.

    Why: a readout's trunk is frozen, and its last hidden state is mostly what every prompt shares, so a plain linear
    head moves every state's value through that shared part and learns the mean value only."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = zero_head(hidden_size)
        self.register_buffer("mean", torch.zeros(hidden_size))
        self.register_buffer("scale", torch.ones(hidden_size))
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))

    @property
    def weight(self) -> Tensor:
        return self.linear.weight

    @torch.no_grad()
    def fit(self, states: Tensor) -> None:
        """Fix the mean and scale from ``states`` (N, H), over every process's rows."""
        x = states.detach().reshape(-1, states.shape[-1]).double()
        sums = sum_over_processes(torch.cat([x.sum(0), x.new_tensor([x.shape[0]])]))
        mean = sums[:-1] / sums[-1].clamp_min(1)
        self.mean.copy_(mean)
        self.scale.copy_(root_mean_square(x - mean))
        self.fitted.fill_(True)

    def forward(self, hidden: Tensor) -> Tensor:
        if not bool(self.fitted) and torch.is_grad_enabled() and self.training:
            raise RuntimeError("the standardised value head (StandardisedValues) is fitted before the first update "
                               "by `--model.updater=ragen_pl_experiments.update.ReadoutUpdate`; this run trains it "
                               "unfitted")
        return self.linear((hidden - self.mean.to(hidden.dtype)) / self.scale.to(hidden.dtype))


class StandardisedValues(ModelHook):
    """Builds the shared value head (``--model.critic=shared``) as a :class:`StandardisedHead`."""

    def value_head(self, hidden_size: int) -> nn.Module:
        return StandardisedHead(hidden_size)
