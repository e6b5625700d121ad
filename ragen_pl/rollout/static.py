"""The fast decode path of the ``hf`` engine on a GPU: a pre-allocated KV cache and the decode step as a CUDA graph.

A 0.5B model's decode step is a few hundred small kernels; launched one by one from Python it costs tens of
milliseconds, while the GPU needs well under one. Replaying the step as one captured CUDA graph removes that launch
cost. A graph fixes every shape and address, so:

* the KV cache is allocated once per ``generate`` call for ``width + max_new_tokens`` columns (:class:`StaticKV`),
  and each step writes one column, the same for every row (prompts are left-padded to a common width; a prompt
  whose prefix was kept from the previous turn starts with that prefix's KV, copied in ahead of the fed columns);
* the attention mask is a boolean 4D ``(B, 1, 1, L)`` tensor handed to the model ready-made (transformers returns a
  4D mask as it is and builds none), and each step flips one column of it on;
* rows that finish keep decoding (their tokens are ignored) until at most half the batch is live; then the batch
  shrinks to the live rows (:meth:`StaticDecoder.select`) and the step is captured again for the smaller batch,
  provided enough steps remain to repay the capture. Each decode step reads every row's whole KV cache, so a
  batch of mostly finished rows would keep paying for them.

Sampling stays outside the graph (the same :func:`ragen_pl.rollout.hf.sample_next`), so it is identical to the
eager path's. With ``capture=False`` the same static-cache loop runs eagerly, which is how the CPU tests check it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class StaticKV:
    """A pre-allocated KV cache with the one method transformers' attention calls: ``update``.

    Prefill (several query tokens) writes columns ``start..start+q-1``, after the ``start`` columns that
    :meth:`preload` filled with cached KV; a decode step (one query token) writes column ``self.column``, a device
    tensor the caller advances in place, so a captured graph reads the current value. Buffers are made by
    :meth:`preload` or at the first update of each layer, with that layer's dtype, heads and device.
    """

    is_compileable = True

    def __init__(self, length: int, device: torch.device) -> None:
        self.length = length
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self._seen = 0
        self.start = 0

    def preload(self, past: list[tuple[Tensor, Tensor]]) -> None:
        """Put each layer's cached (keys, values), each (B, H, C, D), in the first C columns."""
        for layer, (k, v) in enumerate(past):
            b, h, c, d = k.shape
            self.keys[layer] = k.new_zeros(b, h, self.length, d)
            self.values[layer] = v.new_zeros(b, h, self.length, v.shape[-1])
            self.keys[layer][:, :, :c] = k
            self.values[layer][:, :, :c] = v
        self.start = self._seen = past[0][0].shape[2]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs=None):
        if layer_idx not in self.keys:
            b, h, _, d = key_states.shape
            self.keys[layer_idx] = key_states.new_zeros(b, h, self.length, d)
            self.values[layer_idx] = value_states.new_zeros(b, h, self.length, value_states.shape[-1])
        q = key_states.shape[2]
        index = self.column if q == 1 else torch.arange(self.start, self.start + q, device=key_states.device)
        self.keys[layer_idx].index_copy_(2, index, key_states)
        self.values[layer_idx].index_copy_(2, index, value_states)
        if layer_idx == 0:
            self._seen = self.start + q if q > 1 else self._seen + 1
        return self.keys[layer_idx], self.values[layer_idx]

    def select_rows(self, index: Tensor) -> None:
        """Rebuild every layer's buffers from rows ``index`` (repeats allowed): prefill once, decode many."""
        for layer in self.keys:
            self.keys[layer] = self.keys[layer].index_select(0, index)
            self.values[layer] = self.values[layer].index_select(0, index)

    def layers(self) -> list[tuple[Tensor, Tensor]]:
        """Every layer's (keys, values), each (B, H, length, D)."""
        return [(self.keys[i], self.values[i]) for i in sorted(self.keys)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.length, 0


class StaticDecoder:
    """One ``generate`` call's prefill and decode steps over a :class:`StaticKV`, optionally graph-captured."""

    def __init__(self, model: nn.Module, input_ids: Tensor, attention: Tensor, max_new_tokens: int,
                 capture: bool, rows: Tensor | None = None,
                 past: list[tuple[Tensor, Tensor]] | None = None) -> None:
        """``input_ids`` (n, S): the left-padded tokens to feed. ``attention`` (n, C + S): the real columns, the
        first C those of ``past`` (each layer's cached (keys, values), (n, H, C, D); none when C is 0), the last S
        those of ``input_ids``. With ``rows``, the n prompts are distinct ones, prefilled once each, and the decode
        batch is ``rows`` (an index into them, repeats allowed)."""
        n, fed = input_ids.shape
        width = attention.shape[1]
        device = input_ids.device
        self.model, self.width = model, width
        self.kv = StaticKV(width + max_new_tokens, device)
        if past:
            self.kv.preload(past)
        keys = torch.arange(width + max_new_tokens, device=device)
        real = torch.cat([attention.bool(), attention.new_zeros(n, max_new_tokens, dtype=torch.bool)], dim=-1)
        # Prefill mask (n, 1, S, L): a query at column j sees the row's real keys up to j. A padding query sees
        # itself, so that no softmax row is empty (NaN); no real query ever sees a padding key.
        queries = torch.arange(width - fed, width, device=device)[:, None]
        prefill_mask = (real[:, None, :] & (keys[None, :] <= queries)) | (keys[None, :] == queries)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, width - fed:]
        out = model(input_ids=input_ids, attention_mask=prefill_mask[:, None],
                    position_ids=positions, past_key_values=self.kv, use_cache=True, logits_to_keep=1)
        self.first_logits = out.logits[:, -1]
        if rows is not None:
            self.kv.select_rows(rows)
            real, positions, self.first_logits = real[rows], positions[rows], self.first_logits[rows]
            n = len(rows)
        self.prompt_columns = real[:, :width].clone()
        """(n, width) the real columns of each row's prompt (cached prefix and fed tokens)."""
        self.mask = real  # (n, L) decode mask: the prompt so far; each step turns one more column on
        self.positions = positions
        # Static inputs of the decode step, updated in place before each step.
        self.ids = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.pos = self.positions[:, -1:].clone()
        self.step_mask = self.mask[:, None, None, :]  # a view: flipping self.mask updates what the graph reads
        self.column = width - 1  # the cache column last written (a Python copy of kv.column: no host sync)
        self.kv.column.fill_(self.column)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        if capture:
            self._capture()

    def _forward(self) -> Tensor:
        out = self.model(input_ids=self.ids, attention_mask=self.step_mask,
                         position_ids=self.pos, past_key_values=self.kv, use_cache=True)
        return out.logits[:, -1]

    def _capture(self) -> None:
        # Warm up on a side stream (allocator and kernel choices settle), then capture one step. The warm-up
        # steps write the next cache column, which the next real step overwrites.
        following = self.column + 1
        self._advance_to(following)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        self.mask[:, following] = False  # the next real step turns it on again
        self.kv.column.fill_(self.column)

    def select(self, index: Tensor) -> None:
        """Keep only batch rows ``index`` (the live ones), and capture the step again if it was captured."""
        captured = self.graph is not None
        self.graph = self.logits = None  # frees the old graph's memory before the new capture
        self.kv.select_rows(index)
        self.mask, self.prompt_columns = self.mask[index], self.prompt_columns[index]
        self.positions, self.pos, self.ids = self.positions[index], self.pos[index], self.ids[index]
        self.step_mask = self.mask[:, None, None, :]
        if captured:
            self._capture()

    def _advance_to(self, column: int) -> None:
        self.kv.column.fill_(column)
        self.mask[:, column] = True

    def step(self, ids: Tensor) -> Tensor:
        """Feed one sampled token per row (n,); return the next logits (n, V)."""
        self.ids.copy_(ids[:, None])
        self.pos.add_(1)
        self.column += 1
        self._advance_to(self.column)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        assert self.logits is not None
        return self.logits


__all__ = ["StaticDecoder", "StaticKV"]
