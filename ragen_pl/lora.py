"""Where LoRA adapters go (``--model.lora``): peft adapters on the decoder's linear layers (all, or the last N), or on
the output head, a readout of the last hidden state; and the centred head.

Why a centred head (``--model.lora.center_head``, issue 20): SmolLM2's last hidden state is mostly what every
prompt shares. Over FrozenLake boards each of its 576 dimensions varies by 0.064 of its size
(``benchmarks/readout_rl.py --features llm``). An adapter reading that state moves the answer every board gets (the action prior)
through the shared part, 15x as fast as the part that depends on the board, and policy-gradient noise on the prior
wins: in the readout simulation the same board features that reach the FrozenLake goal in 1,280 trajectories learn
nothing at any learning rate once given that geometry, as the SmolLM2 runs sharpened a board-blind prior. The centred
head's adapter reads the hidden state less its components along the ``k`` leading directions ``U`` of the hidden states
at the positions it scores (the top eigenvectors of their second moment, fixed before the first update from every
position the first batch scores, :func:`fit_centred_heads`; the adapter is 0 until then, so nothing sampled before
depends on ``U``). Each kind of scored position (the action, then ``</``, ``answer``, ``>``) has its own shared part,
so one direction (the mean) is not enough: on the warm SmolLM2's FrozenLake answers the shared part at the action
position stays 4.82x the board part after the mean direction is projected out, and 0.06x after the 4 leading ones,
which keep 0.953 of the board part (``benchmarks/head_geometry.py``).
``A (h - U U^T h) = A' h`` with ``A' = A (I - U U^T)``, so the adapter folds into plain LoRA weights for merges and
exports (:func:`head_folded`).

The board part is still small: after the shared directions go, each dimension left varies by a few hundredths of
the state's size, so under Adam (steps of about the learning rate per weight, whatever the input's scale) the logits
move by that fraction of what a readout of unit-scale features moves, and a rate large enough for the board part
moves whatever is left of the shared part just as fast. ``--model.lora.whiten_head`` divides each dimension of the
centred state by its root mean square over the same positions (``s``, fixed with ``U``): the input the readout
simulation learned from (``benchmarks/readout_rl.py --features llm``, standardised: 0.278 on FrozenLake in 1,920
trajectories at lr 0.003). Still linear: ``A' = A diag(1/s) (I - U U^T)``.

A multi-turn prompt has a shared part per turn too: the window-1 prompt of turn t says ``Turn t`` and the actions
left, and on the warm SmolLM2 that text moves the state at the action position as much as the board does (over 64
FrozenLake boards each written as every turn's prompt, the board's share of the variance is 0.52 and the turn text's
0.48 of what the whitened head reads; more leading directions do not remove it: ``benchmarks/head_geometry.py
--turns``). A readout of it can learn an answer per turn that ignores the board, and in the readout simulation on
those states (``benchmarks/readout_rl.py --turn-text``) the FrozenLake goal is no longer reached.
``--model.lora.center_turns`` (up to ``n`` directions) also leaves out the leading directions of the scatter of the
turns' mean states (:func:`turn_directions`, on the centred rows, fitted with ``U`` and appended to it; the turn of
each scored position comes from :data:`ragen_pl.scoring.SCORED_TURNS`). With a window of one turn,
``--data.rollout.turn_header=false`` takes that text out of the prompt itself, so there is nothing to leave out.

``--model.lora.head_tokens`` makes the head adapter that readout exactly: ``lora_B`` fixed to one-hot columns on the
given tokens' rows (FrozenLake's four actions), ``lora_A`` trained from zero. Only those tokens' logits move, so the
adapter cannot break the answer format (a plain head adapter at lr 3e-2 broke ``</answer>`` on one seed) and its
rate is the readout's.

Used by :func:`ragen_pl.policy.load_models` and ``ragen-pl export``, so a checkpoint's adapters (and ``U``, a buffer
saved with them) find the same modules in both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ragen_pl.config import LoraSettings
from ragen_pl.scoring import SCORED_ROWS, SCORED_TURNS

__all__ = ["add_lora", "centred_unfitted", "fit_centred_heads", "head_folded", "head_token_ids", "project_out",
           "root_mean_square", "shared_directions", "turn_directions", "untie_output_embeddings"]

SHARED_DIRECTIONS = "shared_directions"
"""The buffer of a centred head's ``lora_A`` module: the (hidden, k) orthonormal directions ``U`` it leaves out (zeros
until the first update). With ``center_turns``, its last ``center_turns`` columns are the turn directions (zero
columns where fewer were found)."""

TURN_DIRECTIONS = "ragen_pl_turn_directions"
"""The attribute of a turn-centred head's ``lora_A`` module: how many of the columns of ``U`` are turn directions."""

FEATURE_SCALE = "feature_scale"
"""The buffer of a whitened centred head's ``lora_A`` module: the (hidden,) root mean squares ``s`` of the centred
state's dimensions over the scored positions, which the adapter divides by (ones until the first update)."""


def add_lora(policy: nn.Module, lora: LoraSettings, tokenizer: Any = None) -> nn.Module:
    """``policy`` with peft LoRA adapters as ``lora`` places them (``tokenizer``: for ``head_tokens``)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("`--model.lora` needs peft: pip install 'ragen-pl[peft]'") from err
    targets, layers = lora.target_modules, None
    if not isinstance(targets, str) and "lm_head" in targets:
        untie_output_embeddings(policy)
    if lora.last_layers is not None:
        n = policy.config.num_hidden_layers
        if lora.last_layers > n:
            raise ValueError(f"`--model.lora.last_layers` must be at most the model's {n} layers, got "
                             f"{lora.last_layers}")
        layers = list(range(n - lora.last_layers, n))
        if targets == "all-linear":  # peft takes layer indices only with module names: the layers' linears
            targets = sorted({name.rsplit(".", 1)[-1] for name, m in policy.named_modules()
                              if isinstance(m, nn.Linear) and ".layers." in name})
        elif isinstance(targets, str):
            raise ValueError(f"`--model.lora.last_layers` needs `--model.lora.target_modules` all-linear or a "
                             f"list of module names, got {targets!r}")
    ids, pattern = None, {}
    if lora.head_tokens:
        ids = head_token_ids(tokenizer, lora.head_tokens)
        pattern = {"lm_head": len(ids)}  # alpha = rank: scaling 1, so the readout's weights are lora_A itself
    policy = get_peft_model(policy, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                               target_modules=targets, task_type="CAUSAL_LM",
                                               layers_to_transform=layers, rank_pattern=pattern,
                                               alpha_pattern=pattern))
    head = policy.get_base_model().get_output_embeddings()
    if ids is not None:
        _readout(head, ids)
    if lora.center_head:
        _center(head.lora_A["default"], lora.center_head, lora.whiten_head, lora.center_turns)
    return policy


def head_token_ids(tokenizer: Any, tokens: list[str]) -> list[int]:
    """The ids of ``--model.lora.head_tokens``, each one token of ``tokenizer``'s vocabulary."""
    if tokenizer is None:
        raise ValueError("`--model.lora.head_tokens` needs the model's tokenizer")
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"`--model.lora.head_tokens`: {token!r} is {len(encoded)} tokens of this model's "
                             f"tokenizer ({[tokenizer.decode([i]) for i in encoded]}); each must be one")
        ids.append(encoded[0])
    return ids


def _readout(head: nn.Module, ids: list[int]) -> None:
    a, b = head.lora_A["default"].weight, head.lora_B["default"].weight  # (k, H), (V, k)
    with torch.no_grad():
        a.zero_()
        b.zero_()
        b[torch.tensor(ids), torch.arange(len(ids))] = 1.0
    b.requires_grad_(False)


def untie_output_embeddings(model: nn.Module) -> None:
    """Give a causal LM's output head its own copy of the weights it shares with the input embeddings (SmolLM2,
    Qwen2.5-0.5B tie them), so that an adapter on the head never reaches the input embeddings, not even when it is
    merged for an engine or an export. The config then says untied, so a saved model keeps both."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embed.weight:
        return
    head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
    model.config.tie_word_embeddings = False
    text = getattr(model.config, "get_text_config", lambda: None)()
    if text is not None:
        text.tie_word_embeddings = False


def _center(lora_a: nn.Linear, k: int, whiten: bool, turns: int = 0) -> None:
    if k + turns > lora_a.in_features:
        raise ValueError(f"`--model.lora.center_head` plus `--model.lora.center_turns` must be at most the hidden "
                         f"size {lora_a.in_features}, got {k} + {turns}")
    lora_a.register_buffer(SHARED_DIRECTIONS, torch.zeros(lora_a.in_features, k + turns, dtype=lora_a.weight.dtype))
    setattr(lora_a, TURN_DIRECTIONS, turns)
    if whiten:
        lora_a.register_buffer(FEATURE_SCALE, torch.ones(lora_a.in_features, dtype=lora_a.weight.dtype))
    lora_a.register_forward_pre_hook(_project_out_shared)


def shared_directions(h: Tensor, k: int) -> Tensor:
    """The (H, k) leading eigenvectors of the second moment of the rows of ``h`` (n, H), summed over processes so
    that every process leaves out the same directions."""
    h = h.detach().reshape(-1, h.shape[-1]).double()
    moment = h.T @ h
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(moment)
    _, vectors = torch.linalg.eigh(moment)  # ascending eigenvalues
    return vectors[:, -k:].flip(-1)


def turn_directions(x: Tensor, turns: Tensor, n: int) -> Tensor:
    """(H, n) orthonormal directions along which the mean of the rows of ``x`` (N, H) differs between their
    ``turns`` (N,): the n leading eigenvectors of the between-turn scatter ``sum_t N_t (m_t - m)(m_t - m)^T`` (m_t the
    mean of turn t's rows, m of all rows), summed over processes; zero columns beyond its rank (turns - 1)."""
    x = x.detach().reshape(-1, x.shape[-1]).double()
    top = turns.max().reshape(1) + 1 if turns.numel() else turns.new_zeros(1)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
    sums = x.new_zeros(int(top), x.shape[1]).index_add_(0, turns, x)
    counts = torch.bincount(turns, minlength=int(top)).to(x.dtype)
    if distributed:
        torch.distributed.all_reduce(sums)
        torch.distributed.all_reduce(counts)
    seen = counts > 0
    means = sums[seen] / counts[seen, None]
    scatter = (means - sums.sum(0) / counts.sum()) * counts[seen, None].sqrt()
    _, values, vectors = torch.linalg.svd(scatter, full_matrices=False)  # descending
    rank = int((values > 1e-9 * values[:1].clamp_min(1e-300)).sum()) if len(values) else 0
    out = x.new_zeros(x.shape[1], n)
    out[:, :min(n, rank)] = vectors[:min(n, rank)].T
    return out


def centred_unfitted(policy: nn.Module) -> bool:
    """Whether ``policy`` has a centred head whose directions are not fitted yet (before its first update)."""
    return any(not bool(u.any()) for m in policy.modules()
               if isinstance(m, nn.Linear) and (u := getattr(m, SHARED_DIRECTIONS, None)) is not None)


def fit_centred_heads(policy: nn.Module, rows: Tensor, turns: Tensor | None = None) -> None:
    """Fix ``U`` (and ``s``) of each centred head of ``policy`` not fitted yet from ``rows`` (N, H), what the head reads
    at N scored positions, and ``turns`` (N,), their turns (needed with ``center_turns``). The update calls it with
    the first batch's scored positions, all of them (:meth:`ragen_pl.update.StarPOUpdate.prepare`); a head that
    reaches its first training forward unfitted fits on that forward's scored positions instead."""
    for module in policy.modules():
        u = getattr(module, SHARED_DIRECTIONS, None)
        if isinstance(module, nn.Linear) and u is not None and not bool(u.any()):
            _fit(module, rows, turns)


def _fit(module: nn.Linear, rows: Tensor, turns: Tensor | None) -> None:
    directions = getattr(module, SHARED_DIRECTIONS)
    n_turns = getattr(module, TURN_DIRECTIONS, 0)
    u = shared_directions(rows, directions.shape[1] - n_turns)
    if n_turns:
        if turns is None or turns.shape != rows.shape[:1] or bool((turns < 0).any()):
            raise RuntimeError("the turn-centred head needs the turn of each scored position: score the rows "
                               "with `turns=` (the batch's turn_ids)")
        u = torch.cat([u, turn_directions(project_out(rows.double(), u), turns, n_turns)], 1)
    directions.copy_(u)
    if hasattr(module, FEATURE_SCALE):
        getattr(module, FEATURE_SCALE).copy_(root_mean_square(project_out(rows.double(), directions.double())))


def _project_out_shared(module: nn.Linear, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    (h,) = args  # (..., H): the hidden states the head reads
    directions = getattr(module, SHARED_DIRECTIONS)
    if not bool(directions.any()):
        scored = SCORED_ROWS.get()
        if scored is None or not (torch.is_grad_enabled() and module.training):
            return args  # before the first update the adapter is 0: nothing depends on U yet
        if scored.shape != h.shape[:-1]:
            raise RuntimeError(f"the centred head read hidden states of shape {tuple(h.shape)} under a scored-rows "
                               f"mask of shape {tuple(scored.shape)}")
        # Only the positions that score a token: the head also reads other rows' answer columns and padding, and a
        # shared prefix's forward (none of them in the loss).
        _fit(module, h[scored], SCORED_TURNS.get())
    h = project_out(h, directions.to(h.dtype))
    scale = getattr(module, FEATURE_SCALE, None)
    return (h if scale is None else h / scale.to(h.dtype),)


def root_mean_square(x: Tensor, floor: float = 1e-2) -> Tensor:
    """The (H,) root mean square of each column of ``x`` (n, H), over every process's rows; columns below ``floor``
    times the mean of the columns' values are raised to it (a dimension that barely varies is not amplified into
    noise)."""
    stats = torch.cat([x.pow(2).sum(0), x.new_tensor([x.shape[0]])])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats)
    rms = (stats[:-1] / stats[-1].clamp_min(1)).sqrt()
    return rms.clamp_min(floor * float(rms.mean()))


def project_out(h: Tensor, directions: Tensor) -> Tensor:
    """``h`` (..., H) less its components along the orthonormal columns of ``directions`` (H, k)."""
    return h - (h @ directions) @ directions.T


@contextmanager
def head_folded(policy: nn.Module) -> Iterator[None]:
    """Within: each centred head's ``lora_A`` weight holds the adapter as plain LoRA on the hidden state,
    ``A diag(1/s) (I - U U^T)``, so that merging it into the head (engines, exports) is exact; the trained weight comes
    back on exit. Merge (and unmerge) inside; a forward inside would apply the input's transform twice. A no-op
    without a centred head or before its first update. Row by row, so under FSDP2 each process folds its own rows."""
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
