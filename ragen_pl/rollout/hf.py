"""The embedded default rollout engine: Hugging Face transformers with a KV cache, on CPU or GPU.

It samples with the trained policy's own modules (no weight copy, so no sync is needed) and records the log-prob of
every sampled token under the sampling distribution (temperature, top-k and top-p applied). The decode loop is
written out rather than calling ``model.generate`` so that per-token log-probs cost one gather instead of keeping
``(B, V)`` scores for every step, and so that finished rows leave the batch (and the KV cache) at once.

A multi-turn prompt extends the previous turn's prompt and answer. The engine keeps the KV of every sequence a
``generate`` call fed (:class:`PrefixCache`) until the next call, so that the next turn prefills only what is new
(the env's message): a Sokoban rollout of ``benchmarks/rollout.py`` feeds 2.4 prompt tokens per sampled one instead
of 11. Nothing is kept where the collector says no next call extends it (``next_call_extends``: the last turn, a
``context_window``). The collector ends each rollout with :meth:`HFEngine.end_rollout`; new weights clear it too.

A sharded policy (FSDP) samples through an unsharded copy of its weights by default. Sampling the sharded model
itself (``gather_sharded=False``), every rank must run the same number of forward passes (each all-gathers
parameters), so a rank that has finished keeps stepping with a one-token dummy input until every rank is done.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ragen_pl.dist import is_sharded, max_over_processes, process_rank
from ragen_pl.rollout.engine import Generation, RolloutEngine, SamplingParams
from ragen_pl.rollout.prefix import PrefixCache, kept_past, left_padded, shared_prefix
from ragen_pl.rollout.sampling import Outputs, sample_next, truncates


class HFEngine(RolloutEngine):
    """Batched sampling with a transformers causal LM (entry name ``hf``).

    The engine is built empty; :meth:`bind` gives it the policy and tokenizer (the data module does this in
    ``setup``, so the config never names the model twice). It samples with the policy's own modules, so it holds no
    weights of its own, except for a sharded policy (see ``gather_sharded``).
    """

    def __init__(self, seed: int = 0, sync_ranks: bool | None = None, cuda_graphs: bool = True,
                 gather_sharded: bool = True, prefix_cache: bool = True, share_prefix: bool = True,
                 max_batch: int | None = None) -> None:
        """
        Args:
            seed: seed of the sampling generator; each process seeds with ``seed + rank``. Its state is
                checkpointed (every rank's), so a resumed run samples the same.
            sync_ranks: keep every rank stepping until all are done (needed when a sharded model samples itself:
                its forward is collective); ``None`` turns it on exactly then. An unsharded policy (one process,
                DDP) or a sharded one's unsharded copy samples each rank on its own, through CUDA graphs on a GPU.
            cuda_graphs: on a CUDA device (and unsharded), decode with a static KV cache and the step replayed as a
                CUDA graph (:mod:`ragen_pl.rollout.static`); falls back to the eager loop, with a warning, if the
                model cannot be captured.
            gather_sharded: a sharded policy (FSDP1, FSDP2) samples through an unsharded copy of its weights on
                each process, refreshed whenever they change (once per update): one gather per iteration instead
                of one per layer and decode step, no collective while sampling (ranks need not step together), and
                CUDA graphs apply. Costs one full copy of the policy's weights per process; false samples with the
                sharded model itself.
            prefix_cache: keep the KV of what each call fed until the next call, and prefill only the part of a
                prompt past the longest kept sequence it starts with (a conversation's next turn). Costs the KV of
                one turn's sequences between calls; false prefills every prompt whole.
            share_prefix: prefill the prompt tokens every prompt of a call starts with (the system message and the
                env's rules: half of each prompt of a ``context_window`` rollout) once, not once per prompt, when
                they are at least ``SHARED_PREFIX_MIN`` tokens and longer than what a row kept. False prefills them
                per prompt.
            max_batch: sample at most this many prompts at once, a larger call in chunks (512 SmolLM2 episodes at
                once reached 13.6 GB on CPU), kept prefixes carried across; sampled draws depend on it. None: no limit.
        """
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"`--data.engine.max_batch` must be >= 1 (or null: no limit), got {max_batch}")
        self.max_batch = max_batch
        self.seed = seed
        self.sync_ranks = sync_ranks
        self.cuda_graphs = cuda_graphs
        self.gather_sharded = gather_sharded
        self._copy: nn.Module | None = None
        self._graphs_failed = False
        self.generator: torch.Generator | None = None
        """The sampling generator, made on the model's device at the first ``generate`` (see ``_generator``)."""
        self._pending_state: dict | None = None
        self.prefix = PrefixCache() if prefix_cache else None
        self._extends = True  # the next call's prompts extend this one's (`next_call_extends`); one call only
        self.share_prefix = share_prefix
        self.prefilled_tokens = 0
        """Prompt tokens fed to the model so far (a kept prefix is not fed again); for benchmarks and tests."""

    def bind(self, model: nn.Module, tokenizer) -> None:
        # No generator yet: Lightning binds the engine in `setup`, before it moves the model to its device.
        super().bind(model, tokenizer)
        self.end_rollout()

    def end_rollout(self) -> None:
        """Forget the kept prefixes (their KV belongs to the weights that computed it)."""
        if self.prefix is not None:
            self.prefix.clear()

    # ---- sharded policies: sample through an unsharded copy
    @property
    def holds_weights(self) -> bool:  # type: ignore[override]
        """True while the bound policy is sharded and sampled through a copy (see ``gather_sharded``)."""
        return self.gather_sharded and self.model is not None and is_sharded(self.model)

    def load_weights(self, state_dict) -> None:
        """The sharded policy's full weights (``RagenModule.policy_state_dict``): build or refresh the copy."""
        if not self.holds_weights:
            return
        self.end_rollout()
        if self._copy is None:
            self._copy = _unsharded_copy(self.model, state_dict)
        else:
            self._copy.load_state_dict(state_dict)

    def _sampling_model(self) -> nn.Module:
        if not self.holds_weights:
            return self.model
        if self._copy is None:
            raise RuntimeError("HFEngine: a sharded policy samples through its unsharded copy, which needs "
                               "load_weights(policy_state_dict) first (the data module does it before sampling)")
        # Under mixed precision the copy holds the compute dtype. The policy's own float32 masters are cast once per
        # autocast region (autocast caches the casts of weights that need grad); a frozen float32 copy would be
        # cast again at every decode step, reading three times the bytes of a bf16 copy.
        device = next(self._copy.parameters()).device
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
            if next(self._copy.parameters()).dtype != dtype:
                self._copy = _unsharded_copy(self.model, self._copy.state_dict(), dtype)
        return self._copy

    def _generator(self, device: torch.device) -> torch.Generator:
        """The seeded generator on ``device`` (torch.multinomial needs one on the device of its input).

        It is made on first use, where the model then lives, and re-made if the model moved. A state loaded from
        a checkpoint is applied when it was saved from a generator of the same device type.
        """
        g = self.generator
        if g is None or g.device != device:
            g = self.generator = torch.Generator(device=device).manual_seed(self.seed + process_rank())
            pending, self._pending_state = self._pending_state, None
            if pending is not None and pending["device_type"] == device.type:
                g.set_state(pending["state"])
        return g

    # ---- checkpointing of the sampling RNG
    def state_dict(self) -> dict:
        if self.generator is None:
            return {"generator": self._pending_state}
        return {"generator": {"device_type": self.generator.device.type, "state": self.generator.get_state()}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("generator")
        if saved is not None and not isinstance(saved, dict):  # checkpoints of ragen-pl 0.1: a CPU state tensor
            saved = {"device_type": "cpu", "state": saved}
        self._pending_state, self.generator = saved, None

    def _sync(self, model: nn.Module) -> bool:
        """Whether sampling ``model`` keeps the ranks in lockstep (see ``sync_ranks``)."""
        if self.sync_ranks is not None:
            return self.sync_ranks
        return dist.is_available() and dist.is_initialized() and is_sharded(model)

    def next_call_extends(self, extends: bool) -> None:
        self._extends = extends

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self.model is None:
            raise RuntimeError("HFEngine.generate called before bind(model, tokenizer)")
        try:
            return self._generate_chunks(prompts, params)
        finally:
            self._extends = True

    def _generate_chunks(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        model, tok = self._sampling_model(), self.tokenizer
        device = next(model.parameters()).device
        sync = self._sync(model)
        size = self.max_batch or max(1, len(prompts))
        chunks = -(-len(prompts) // size)
        if sync and self.max_batch is not None:  # every rank runs as many chunks (each forward is collective)
            chunks = max_over_processes(chunks, device)
        if chunks <= 1:
            return self._generate_batch(model, tok, prompts, params, device, sync)
        hits = self.prefix.take(prompts) if self.prefix is not None else None  # once; each chunk gets its own
        kept_now, gens = PrefixCache(), []
        for c in range(chunks):
            part = slice(c * size, (c + 1) * size)
            if hits is not None:
                self.prefix = PrefixCache.of(hits[part])
            gens += self._generate_batch(model, tok, prompts[part], params, device, sync)
            if hits is not None:
                kept_now.absorb(self.prefix)
        if hits is not None:
            self.prefix = kept_now
        return gens

    def _generate_batch(self, model, tok, prompts: list[list[int]], params: SamplingParams, device: torch.device,
                        sync: bool) -> list[Generation]:
        was_training = model.training
        model.eval()
        try:
            if self.cuda_graphs and device.type == "cuda" and not sync and prompts and not self._graphs_failed:
                try:
                    return self._generate_static(model, tok, prompts, params, device, capture=True)
                except Exception as err:  # noqa: BLE001 - an uncapturable model still samples, only slower
                    self._graphs_failed = True
                    warnings.warn(f"HFEngine: CUDA-graph decoding is off for this run ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}); using the eager loop",
                                  stacklevel=2)
            return self._generate(model, tok, prompts, params, device, sync)
        finally:
            model.train(was_training)

    def _prefill_inputs(self, model, tok, prompts: list[list[int]], device: torch.device
                        ) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]] | None]:
        """What the prefill of ``prompts`` feeds, after taking each one's longest kept prefix (C columns at most):
        the kept sequence it extends, or the prefix all prompts share (see ``share_prefix``), whichever is longer.

        Returns ``input_ids`` (n, S), each prompt past its kept prefix, left-padded; ``attention`` (n, C + S), its
        real columns: the kept prefix right-aligned in the first C, then the fed tokens; ``past``: each layer's
        kept (keys, values), (n, H, C, D), or None when nothing was kept.
        """
        hits = self.prefix.take(prompts) if self.prefix is not None else [None] * len(prompts)
        if self.share_prefix:
            hits, fed_once = shared_prefix(model, prompts, hits, device)
            self.prefilled_tokens += fed_once
        kept = [0 if h is None else len(h.tokens) for h in hits]
        input_ids, fed = left_padded(tok, [p[c:] for p, c in zip(prompts, kept)], device)
        self.prefilled_tokens += int(sum(len(p) - c for p, c in zip(prompts, kept)))
        width = max(kept)
        if width == 0:
            return input_ids, fed, None
        cached = (torch.arange(width) >= width - torch.tensor(kept)[:, None]).to(device=device, dtype=fed.dtype)
        return input_ids, torch.cat([cached, fed], dim=-1), kept_past(hits)

    def _keep(self, prompts: list[list[int]], out: Outputs, owners: list[int], batch: list[int],
              layers: list[tuple[Tensor, Tensor]], columns: Tensor) -> None:
        """Keep what batch rows ``batch`` fed: row j's prompt ``prompts[owners[j]]`` and all but the newest of its
        sampled tokens, whose KV sits at the true columns of its row of ``columns`` (a boolean (len(batch), L)
        mask). Two gathers per layer for all the rows at once."""
        if self.prefix is None or not batch or not self._extends:
            return
        fed = [prompts[owners[j]] + out.tokens[owners[j]][:-1] for j in batch]
        counts = columns.sum(-1).tolist()
        width = max(counts)
        # A stable sort puts each row's true columns last, in order: the last `width` are its KV right-aligned.
        index = torch.sort(columns.int(), dim=-1, stable=True).indices[:, columns.shape[1] - width:]
        select = torch.tensor(batch, device=columns.device)
        gathered = []
        for k, v in layers:
            at = index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            gathered.append((k.index_select(0, select).gather(2, at), v.index_select(0, select).gather(2, at)))
        for j, (ids, count) in enumerate(zip(fed, counts)):
            assert count == len(ids), f"kept KV columns ({count}) != tokens fed ({len(ids)})"
            self.prefix.add(ids, [(k[j, :, width - count:], v[j, :, width - count:]) for k, v in gathered])

    def _generate_static(self, model, tok, prompts, params, device, capture: bool, sync_every: int = 8,
                         compact: bool = True, recapture_steps: int = 32) -> list[Generation]:
        """Static KV cache, all rows stepping together (finished ones ignored), optionally as a CUDA graph.

        Sampled tokens stay on the device and come to the host ``sync_every`` steps at a time, where eos and stop
        strings are found token by token as before: the GPU runs ahead instead of waiting for the host each token.
        At most ``sync_every - 1`` steps run after the last row ended. With ``compact``, when at most half the batch
        is still live at such a check, the batch shrinks to the live rows; a captured step is captured again for the
        smaller batch, which is done only while at least ``recapture_steps`` steps remain to repay it. (Fewer rows
        draw fewer numbers from the generator, so at temperature > 0 the tokens depend on when that happens.)
        """
        from ragen_pl.rollout.static import StaticDecoder

        n = len(prompts)
        generator = self._generator(device)
        distinct, inverse = _distinct(prompts)
        input_ids, attention, past = self._prefill_inputs(model, tok, distinct, device)
        decoder = StaticDecoder(model, input_ids, attention, params.max_new_tokens, capture=capture,
                                rows=torch.tensor(inverse, device=device) if len(distinct) < n else None, past=past)
        out = Outputs(n, tok, params)
        rows = list(range(n))  # prompt index of each batch row
        live = set(rows)
        logits = decoder.first_logits
        pending: list[tuple[Tensor, Tensor, Tensor | None]] = []
        with_kept = truncates(params, logits.shape[-1])
        for step in range(params.max_new_tokens):
            ids, lps, kept = _draw(logits, params, generator, with_kept)
            pending.append((ids, lps, kept))
            last = step == params.max_new_tokens - 1
            if len(pending) == sync_every or last:
                ids_h = torch.stack([i for i, _, _ in pending]).tolist()  # one device-to-host copy per chunk
                lps_h = torch.stack([lp for _, lp, _ in pending]).tolist()
                kept_h = [k.tolist() if k is not None else None for _, _, k in pending]
                pending = []
                for ids_l, lps_l, kept_l in zip(ids_h, lps_h, kept_h):
                    for j, i in enumerate(rows):
                        if i in live and out.record(i, ids_l[j], lps_l[j], kept_l[j] if kept_l else None):
                            live.discard(i)
                if not live or last:
                    break
                steps_left = params.max_new_tokens - 1 - step
                if compact and len(live) <= len(rows) // 2 and (not capture or steps_left >= recapture_steps):
                    finished = [j for j, i in enumerate(rows) if i not in live]
                    self._keep_static(decoder, prompts, out, rows, finished)
                    index = [j for j, i in enumerate(rows) if i in live]
                    decoder.select(torch.tensor(index, device=device))
                    ids, rows = ids[index], [rows[j] for j in index]
            logits = decoder.step(ids)
        self._keep_static(decoder, prompts, out, rows, list(range(len(rows))))
        return out.generations()

    def _keep_static(self, decoder, prompts, out: Outputs, rows: list[int], batch: list[int]) -> None:
        """Keep what static-path batch rows ``batch`` fed: the real columns of their prompt, then one column per
        sampled token but the last (``rows`` maps a batch row to its prompt)."""
        if self.prefix is None or not batch:
            return
        device = decoder.prompt_columns.device
        sampled = torch.tensor([len(out.tokens[rows[j]]) for j in batch], device=device)
        decoded = torch.arange(decoder.kv.length - decoder.width, device=device) < sampled[:, None] - 1
        index = torch.tensor(batch, device=device)
        self._keep(prompts, out, rows, batch, decoder.kv.layers(),
                   torch.cat([decoder.prompt_columns[index], decoded], dim=-1))

    def _dummy_forward(self, model: nn.Module, device: torch.device) -> None:
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)

    def _generate(self, model, tok, prompts, params, device, sync) -> list[Generation]:
        from transformers import DynamicCache

        n = len(prompts)
        generator = self._generator(device)
        if sync and not max_over_processes(int(n > 0), device):
            return []
        out = Outputs(n, tok, params)
        rows = list(range(n))  # prompt index of each live row
        cache = DynamicCache()
        if n:
            # Identical prompts (a group's first turn) are prefilled once; their KV rows are then copied.
            distinct, inverse = _distinct(prompts)
            input_ids, attention, past = self._prefill_inputs(model, tok, distinct, device)
            if past is not None:
                cache = DynamicCache(ddp_cache_data=past)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
            logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            if len(distinct) < n:
                index = torch.tensor(inverse, device=device)
                cache.batch_select_indices(index)
                logits, attention, positions = logits[index], attention[index], positions[index]
            next_pos = positions[:, -1:] + 1
        else:  # nothing here, but other ranks generate: keep pace with them
            self._dummy_forward(model, device)
        with_kept = n > 0 and truncates(params, logits.shape[-1])
        for step in range(params.max_new_tokens):
            if rows:
                ids, lps, kept = _draw(logits, params, generator, with_kept)
                ids_l, lps_l = ids.tolist(), lps.tolist()
                kept_l = kept.tolist() if kept is not None else None
                keep = [j for j, i in enumerate(rows)
                        if not out.record(i, ids_l[j], lps_l[j], kept_l[j] if kept_l else None)]
                if step == params.max_new_tokens - 1:
                    keep = []  # out of tokens: every row is done
                if len(keep) < len(rows):  # finished rows leave the batch and the KV cache
                    done = sorted(set(range(len(rows))) - set(keep))
                    self._keep(prompts, out, rows, done, [(layer.keys, layer.values) for layer in cache.layers],
                               attention[done].bool())
                    rows = [rows[j] for j in keep]
                    if keep:
                        index = torch.tensor(keep, device=device)
                        cache.batch_select_indices(index)
                        ids, attention, next_pos = ids[index], attention[index], next_pos[index]
            local_live = bool(rows)  # rows is empty after the last step: every row is done then
            # Every rank does one all-reduce and one forward per step, so sharded forwards stay in lockstep.
            if not (max_over_processes(int(local_live), device) if sync else local_live):
                break
            if not local_live:
                self._dummy_forward(model, device)
                continue
            attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=-1)
            logits = model(input_ids=ids[:, None], attention_mask=attention, position_ids=next_pos,
                           past_key_values=cache, use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        return out.generations()


def _draw(logits: Tensor, params: SamplingParams, generator, with_kept: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``sample_next``'s ids and log-probs, and the kept sets when the distribution was truncated."""
    if with_kept:
        return sample_next(logits, params, generator, with_kept=True)  # type: ignore[return-value]
    ids, lps = sample_next(logits, params, generator)
    return ids, lps, None


def _unsharded_copy(model: nn.Module, state_dict, dtype: torch.dtype | None = None) -> nn.Module:
    """A plain transformers model of ``model``'s architecture holding ``state_dict``, on the device it computes on.

    The weights keep their dtype unless ``dtype`` is given (the sampling dtype under mixed precision: see
    ``HFEngine._sampling_model``). LoRA adapters arrive merged in ``state_dict``, so the copy is the base
    architecture.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from transformers import AutoModelForCausalLM

    base = model.module if isinstance(model, FullyShardedDataParallel) else model
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    device = (model.compute_device if isinstance(model, FullyShardedDataParallel)
              else next(model.parameters()).device)
    dtype = dtype or next(v.dtype for v in state_dict.values() if v.is_floating_point())
    with torch.device(device):
        copy = AutoModelForCausalLM.from_config(base.config, dtype=dtype)
    copy.load_state_dict(state_dict)
    return copy.eval().requires_grad_(False)


def _distinct(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in first-seen order, and each prompt's index among them."""
    seen: dict[tuple[int, ...], int] = {}
    inverse = [seen.setdefault(tuple(p), len(seen)) for p in prompts]
    return [list(p) for p in seen], inverse
