import pytest
import torch

from ragen_pl.rollout.engine import SamplingParams
from ragen_pl.rollout.hf import HFEngine
from ragen_pl.rollout.prefix import SHARED_PREFIX_MIN as HF_SHARED_MIN
from ragen_pl.rollout.sampling import sample_next
from tests.helpers import play_turns


def test_greedy_matches_model_generate_and_logprobs_match_forward(tiny):
    model, tok = tiny
    engine = HFEngine()
    engine.bind(model, tok)
    prompts = [tok("Turn 1:\nState:\n" + "#_" * k)["input_ids"] for k in range(1, 7)]  # ragged: left padding
    gens = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, stop=[]))
    for prompt, gen in zip(prompts, gens):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        assert gen.token_ids == ref[:len(gen.token_ids)] and len(gen.token_ids) in (len(ref), 12)
        assert_logprobs_of_forward(model, prompt, gen)


def test_sampling_builds_no_autograd_graph(tiny):
    """Every forward of a generate call runs without autograd, whatever the hints before it (the policy's weights
    require grad: a graph kept over a rollout would hold every activation)."""
    model, tok = tiny
    engine = HFEngine()
    engine.bind(model, tok)
    modes = []
    hook = model.register_forward_pre_hook(lambda m, args: modes.append(torch.is_grad_enabled()))
    try:
        for extends in (True, False):
            engine.next_call_extends(extends)
            engine.generate([tok("Turn 1:\nState:\n#_#")["input_ids"]], SamplingParams(max_new_tokens=4, stop=[]))
    finally:
        hook.remove()
    assert modes and not any(modes) and any(p.requires_grad for p in model.parameters())


def test_identical_prompts_are_prefilled_once(tiny):
    """A group's first turn repeats one prompt: one prefill row per distinct prompt, the same answers."""
    model, tok = tiny
    engine = HFEngine()
    engine.bind(model, tok)
    a, b = tok("Turn 1:\nState:\n#_#")["input_ids"], tok("Turn 1:\nState:\n#__#_#")["input_ids"]
    prompts = [a, b, a, a, b]
    widths = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: widths.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        gens = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6, stop=[]))
    finally:
        hook.remove()
    assert widths[0][0] == 2  # the prefill: two distinct prompts
    for prompt, gen in zip(prompts, gens):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        assert gen.token_ids == ref[:len(gen.token_ids)] and len(gen.token_ids) in (len(ref), 6)
        assert_logprobs_of_forward(model, prompt, gen)


def assert_logprobs_of_forward(model, prompt, gen):
    """Each recorded log-prob (temperature 1 or greedy) is the full forward's log-softmax at that token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1:-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(gen.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(gen.logprobs), lp, atol=1e-4, rtol=1e-4)


def test_sampled_logprobs_are_of_the_processed_distribution(tiny):
    model, tok = tiny
    engine = HFEngine(seed=3)
    engine.bind(model, tok)
    prompt = tok("Turn 1:")["input_ids"]
    params = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=6, stop=[])
    gen = engine.generate([prompt], params)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1:-1].float() / 0.7
    kth = logits.topk(20, -1).values[:, -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(gen.logprobs), lp, atol=1e-4, rtol=1e-4)


def test_sample_next_frequencies_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    ids, _ = sample_next(logits, SamplingParams(temperature=1.0), g)
    freq = torch.bincount(ids, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    ids, lps = sample_next(logits, SamplingParams(temperature=1.0, top_p=0.7), g)
    assert set(ids.tolist()) == {0, 1}  # 0.5 alone < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is {0, 1}
    torch.testing.assert_close(lps[ids == 0][:1], torch.log(torch.tensor([0.5 / 0.8])))


def _processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reference: temperature, then top-k and top-p as masks over the whole vocabulary, row by row."""
    out = []
    for row in logits.float() / params.temperature:
        if 0 < params.top_k < len(row):  # top-k at or past the vocabulary size keeps everything
            row = row.masked_fill(row < row.topk(params.top_k).values[-1], float("-inf"))
        probs = torch.softmax(row, -1)
        kept, mass = torch.zeros_like(row, dtype=torch.bool), 0.0
        for i in torch.argsort(row, descending=True).tolist():
            if mass >= params.top_p:
                break
            kept[i], mass = True, mass + float(probs[i])
        out.append(torch.log_softmax(row.masked_fill(~kept, float("-inf")), -1))
    return torch.stack(out)


@pytest.mark.parametrize("top_k,top_p", [(-1, 0.6), (5, 1.0), (5, 0.6), (50, 0.9)])
def test_sample_next_draws_from_the_processed_distribution(top_k, top_p):
    """Top-k among the k best (no vocabulary sort) and top-p: every draw lies in the reference support with the
    reference log-prob, and frequencies follow it."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=g) * 2
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    ref = _processed_logprobs(logits, params)  # (3, 40)
    n = 20000
    ids, lps = sample_next(logits.repeat_interleave(n, 0), params, g)
    rows = torch.arange(3).repeat_interleave(n)
    torch.testing.assert_close(lps, ref[rows, ids], atol=1e-5, rtol=1e-5)
    for r in range(3):
        freq = torch.bincount(ids[rows == r], minlength=40).float() / n
        torch.testing.assert_close(freq, ref[r].exp(), atol=0.015, rtol=0)


def test_stop_strings_and_reasons(tiny):
    model, tok = tiny
    engine = HFEngine()
    engine.bind(model, tok)
    gens = engine.generate([tok("x")["input_ids"]] * 4, SamplingParams(temperature=1.0, max_new_tokens=40, stop=["_"]))
    for g in gens:
        text = tok.decode(g.token_ids)
        assert g.finish_reason in ("stop", "eos", "length")
        if g.finish_reason == "stop":
            assert "_" in text and "_" not in tok.decode(g.token_ids[:-1])
        if g.finish_reason == "length":
            assert len(g.token_ids) == 40


def test_unbound_engine_errors():
    with pytest.raises(RuntimeError, match=r"before bind"):
        HFEngine().generate([[1]], SamplingParams())


def test_sampling_params_validation():
    with pytest.raises(ValueError, match=r"`top_p` must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"`top_k` must be -1 \(off\) or an integer >= 1, got 0"):
        SamplingParams(top_k=0)


def test_generator_is_made_on_the_model_device_at_first_use(tiny):
    """Lightning binds the engine before it moves the model: the generator must follow the model (issue 10)."""
    model, tok = tiny
    engine = HFEngine(seed=5)
    engine.bind(model, tok)
    assert engine.generator is None  # nothing made at bind time, on whatever device the model had then
    engine.generate([tok("x")["input_ids"]], SamplingParams(max_new_tokens=2, stop=[]))
    assert engine.generator is not None and engine.generator.device == next(model.parameters()).device


def test_sampling_state_resumes_exactly_even_before_the_first_generate(tiny):
    model, tok = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop=[])
    prompts = [tok("Turn 1:")["input_ids"]] * 3
    a = HFEngine(seed=11)
    a.bind(model, tok)
    a.generate(prompts, params)
    state = a.state_dict()
    expected = [g.token_ids for g in a.generate(prompts, params)]
    b = HFEngine(seed=999)  # another seed: only the loaded state can make it sample the same
    b.load_state_dict(state)
    b.bind(model, tok)
    assert b.state_dict()["generator"]["device_type"] == "cpu"  # a pending state is checkpointed as it is
    assert [g.token_ids for g in b.generate(prompts, params)] == expected
    legacy = HFEngine(seed=999)  # checkpoints written before the generator became lazy: a bare CPU state
    legacy.load_state_dict({"generator": state["generator"]["state"]})
    legacy.bind(model, tok)
    assert [g.token_ids for g in legacy.generate(prompts, params)] == expected


def assert_static_matches_eager(model, tok, prompts):
    """The CUDA-graph path's static KV cache and ready-made 4D masks, run eagerly on the CPU: greedy tokens equal
    the eager loop's over ragged (left-padded) prompts, and every log-prob is the full forward's."""
    engine = HFEngine()
    engine.bind(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=10, stop=[])
    with torch.no_grad():
        static = engine._generate_static(model, tok, prompts, params, torch.device("cpu"), capture=False)
    eager = engine.generate(prompts, params)
    for p, s, e in zip(prompts, static, eager):
        assert s.token_ids == e.token_ids and s.finish_reason == e.finish_reason
        assert_logprobs_of_forward(model, p, s)


def test_static_cache_decoding_matches_the_eager_loop(tiny):
    model, tok = tiny
    assert_static_matches_eager(model, tok, [tok("Turn 1:\nState:\n" + "#_" * k)["input_ids"] for k in (1, 7, 3, 12)])


def test_static_cache_prefills_identical_prompts_once(tiny):
    model, tok = tiny
    a, b = tok("Turn 1:\nState:\n#_")["input_ids"], tok("Turn 1:\nState:\n#_#_#_#")["input_ids"]
    widths = []

    def record(module, args, kwargs):
        widths.append((kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape)

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        assert_static_matches_eager(model, tok, [a, b, b, a, a])
    finally:
        hook.remove()
    assert widths[0][0] == 2  # the static path's prefill: the two distinct prompts
    assert widths[1][0] == 5  # its first decode step: every row


def test_static_cache_sampling_stops_rows_independently(tiny):
    model, tok = tiny
    engine = HFEngine(seed=2)
    engine.bind(model, tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop=["_"])
    with torch.no_grad():
        gens = engine._generate_static(model, tok, [tok("x")["input_ids"]] * 6, params, torch.device("cpu"),
                                       capture=False)
    for g in gens:
        text = tok.decode(g.token_ids)
        if g.finish_reason == "stop":
            assert "_" in text and "_" not in tok.decode(g.token_ids[:-1])
        else:
            assert g.finish_reason == "eos" or len(g.token_ids) == 30


def test_static_path_host_syncs_in_chunks_without_changing_tokens(tiny):
    """Tokens reach the host a chunk at a time; eos and stop strings still end each row at the same token (every row
    samples at every step: no compaction, which changes how many numbers are drawn from the generator)."""
    model, tok = tiny
    prompts = [tok("x")["input_ids"], tok("Turn 1:\n#_")["input_ids"]] * 3
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop=["_"])
    runs = []
    for chunk in (1, 3, 8, 64):
        engine = HFEngine(seed=5)
        engine.bind(model, tok)
        with torch.no_grad():
            gens = engine._generate_static(model, tok, prompts, params, torch.device("cpu"), capture=False,
                                           sync_every=chunk, compact=False)
        runs.append([(g.token_ids, g.logprobs, g.finish_reason) for g in gens])
    assert all(r == runs[0] for r in runs[1:])
    assert {reason for _, _, reason in runs[0]} & {"stop", "eos"}  # some rows ended early, mid-chunk


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_next_turn_prefills_only_what_is_new_with_the_same_answers(tiny, static):
    """A kept prefix changes nothing but the work: the same tokens and log-probs as prefilling every prompt whole
    (and as one full forward), while each continued row feeds only its reply and its previous last token."""
    model, tok = tiny
    a, b = tok("Turn 1:\nState:\n#_#")["input_ids"], tok("Turn 1:\nState:\n#__#_#_#_#")["input_ids"]
    first, replies = [a, b, a, b, a], ["\nReward: 1\nState:\n#_", "\n_#_"]
    kept, whole = HFEngine(), HFEngine(prefix_cache=False)
    kept.bind(model, tok), whole.bind(model, tok)
    with_kept, without = play_turns(kept, tok, first, replies, static), play_turns(whole, tok, first, replies, static)
    for (prompts, gens), (prompts_ref, gens_ref) in zip(with_kept, without):
        assert prompts == prompts_ref
        for p, g, r in zip(prompts, gens, gens_ref):
            assert g.token_ids == r.token_ids
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=1e-5)
            assert_logprobs_of_forward(model, p, g)
    # Prefill work: turn 1 feeds the two distinct prompts; later turns feed, for each continued row, its reply and
    # its previous answer's last token (sampled, never fed), and the restarted row whole.
    expected = len(a) + len(b)
    for (prev, gens), (prompts, _) in zip(with_kept, with_kept[1:]):
        expected += sum(len(p) - len(q) - len(g.token_ids) + 1 for p, q, g in zip(prompts[:-1], prev, gens))
        expected += len(prompts[-1])
    assert kept.prefilled_tokens == expected
    assert whole.prefilled_tokens == len(a) + len(b) + sum(len(p) for prompts, _ in without[1:] for p in prompts)
    assert kept.prefilled_tokens < whole.prefilled_tokens / 2


def test_max_batch_samples_in_chunks_with_the_same_answers_and_kept_prefixes(tiny):
    """max_batch=2 runs 5 prompts as chunks of 2, 2 and 1: the same greedy tokens and log-probs as one batch, and
    the next turn still prefills only what is new (the kept prefixes of every chunk survive the call)."""
    model, tok = tiny
    a, b = tok("Turn 1:\nState:\n#_#")["input_ids"], tok("Turn 1:\nState:\n#__#_#_#_#")["input_ids"]
    first, replies = [a, b, a, b, a], ["\nReward: 1\nState:\n#_", "\n_#_"]
    chunked, whole = HFEngine(max_batch=2), HFEngine()
    chunked.bind(model, tok), whole.bind(model, tok)
    calls = []
    batch = chunked._generate_batch
    chunked._generate_batch = lambda m, t, prompts, *rest: calls.append(len(prompts)) or batch(m, t, prompts, *rest)
    turns, reference = play_turns(chunked, tok, first, replies), play_turns(whole, tok, first, replies)
    assert calls == [2, 2, 1] * 3
    for (prompts, gens), (prompts_ref, gens_ref) in zip(turns, reference):
        assert prompts == prompts_ref
        for g, r in zip(gens, gens_ref):
            assert g.token_ids == r.token_ids
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=1e-5)
    # Identical prompts are prefilled once per chunk, not per call: the first turn feeds a, b | a, b | a.
    first_turn = 3 * len(a) + 2 * len(b)
    assert chunked.prefilled_tokens - first_turn == whole.prefilled_tokens - len(a) - len(b)
    with pytest.raises(ValueError, match="max_batch"):
        HFEngine(max_batch=0)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_common_prompt_prefix_is_prefilled_once_with_the_same_answers(tiny, static):
    """Prompts that share their first tokens (the rules, in a context-window rollout) prefill them once: the same
    tokens and log-probs as prefilling each prompt whole, and the exact count of tokens fed."""
    model, tok = tiny
    rules = tok("You are solving the Sokoban puzzle. " * 6)["input_ids"]
    assert len(rules) >= HF_SHARED_MIN
    prompts = [rules + tok(f"Turn {k}:\nState:\n" + "#_" * k)["input_ids"] for k in (1, 2, 3, 2)]
    shared, whole = HFEngine(), HFEngine(share_prefix=False)
    params = SamplingParams(temperature=0, max_new_tokens=6, stop=[])
    results = []
    for engine in (shared, whole):
        engine.bind(model, tok)
        with torch.no_grad():
            if static:
                results.append(engine._generate_static(model, tok, prompts, params, torch.device("cpu"),
                                                       capture=False))
            else:
                results.append(engine.generate(prompts, params))
    for prompt, g, r in zip(prompts, *results):
        assert g.token_ids == r.token_ids
        assert_logprobs_of_forward(model, prompt, g)
    common = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    assert common >= len(rules)
    distinct = prompts[:3]  # the fourth repeats the second
    assert shared.prefilled_tokens == common + sum(len(p) - common for p in distinct)
    assert whole.prefilled_tokens == sum(len(p) for p in distinct)


def test_kept_prefixes_end_with_the_rollout_and_with_new_weights(tiny):
    model, tok = tiny
    engine = HFEngine()
    engine.bind(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=3, stop=[])
    prompt = tok("Turn 1:\nState:\n#_#")["input_ids"]
    gen = engine.generate([prompt], params)[0]
    assert len(engine.prefix) == 1
    engine.end_rollout()
    assert len(engine.prefix) == 0
    before = engine.prefilled_tokens
    engine.generate([prompt + gen.token_ids + [7]], params)
    assert engine.prefilled_tokens - before == len(prompt) + len(gen.token_ids) + 1  # whole: nothing was kept
    engine.bind(model, tok)  # a re-bound policy (the strategy wrapped it) starts afresh
    assert len(engine.prefix) == 0


def test_prefix_cache_takes_the_longest_kept_sequence_a_prompt_extends():
    from ragen_pl.rollout.prefix import PrefixCache

    cache = PrefixCache()
    layers = [(torch.zeros(1, 0, 1), torch.zeros(1, 0, 1))]
    base = list(range(20))
    cache.add(base[:5], layers)
    cache.add(base[:12], layers)
    cache.add([99] * 4 + base[4:12], layers)  # the same length and last 8 tokens as base[:12], another start
    cache.add(base[:3], layers)
    assert len(cache) == 4
    hits = cache.take([base, base[:12], [7] + base, base[:4]])
    assert hits[0].tokens == base[:12]  # the longest it extends
    assert hits[1].tokens == base[:5]  # an exact copy of a kept sequence would feed nothing: a shorter one
    assert hits[2] is None
    assert hits[3].tokens == base[:3]
    assert len(cache) == 0  # taken once, then forgotten
    assert cache.take([base]) == [None]


def test_static_path_drops_finished_rows_with_the_same_answers(tiny):
    """Once at most half the rows are live, the static batch shrinks to them: greedy answers equal the full batch's,
    sampled log-probs stay those of one full forward, and what was fed is kept for the next turn either way."""
    model, tok = tiny
    prompts = [tok("x" * (1 + k % 4) + "#_" * k)["input_ids"] for k in range(8)]
    batches = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: batches.append((kw["input_ids"] if "input_ids" in kw else args[0]).shape[0]),
        with_kwargs=True)
    runs = {}
    try:
        for compact in (True, False):
            engine = HFEngine(seed=3)
            engine.bind(model, tok)
            batches.clear()
            with torch.no_grad():
                runs[compact] = engine._generate_static(model, tok, prompts, SamplingParams(
                    temperature=0, max_new_tokens=40, stop=["_#", "x#"]), torch.device("cpu"), capture=False,
                    sync_every=4, compact=compact)
            assert len(engine.prefix) == len(prompts)
            runs[compact, "sizes"] = list(batches)
            with torch.no_grad():
                sampled = engine._generate_static(model, tok, prompts, SamplingParams(
                    temperature=1.0, max_new_tokens=40, stop=["_"]), torch.device("cpu"), capture=False,
                    sync_every=4, compact=compact)
            for p, g in zip(prompts, sampled):
                assert_logprobs_of_forward(model, p, g)
    finally:
        hook.remove()
    lengths = sorted(len(g.token_ids) for g in runs[True])
    assert lengths[0] < lengths[-1] // 2  # rows end at different times
    assert min(runs[True, "sizes"]) < len(prompts) == min(runs[False, "sizes"])  # the batch shrank only with compact
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


def test_only_a_sharded_model_sampling_itself_keeps_ranks_in_lockstep(tiny, monkeypatch):
    """Under torch.distributed an unsharded policy (DDP, or a sharded one's copy) samples each rank on its own: no
    collective per decode step, and the CUDA-graph path stays open on a GPU. Asking for lockstep still gets it."""
    import torch.distributed as dist

    model, tok = tiny
    reduces = []

    def all_reduce(t, op=None):
        reduces.append(1)  # one process: the reduction of a flag is the flag itself

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # as if another rank ran beside this one
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    prompts = [tok("State: #_")["input_ids"], tok("State:")["input_ids"]]
    params = SamplingParams(temperature=0.0, max_new_tokens=5, stop=[], ignore_eos=True)
    engine = HFEngine()
    engine.bind(model, tok)
    assert not engine._sync(model)
    alone = [g.token_ids for g in engine.generate(prompts, params)]
    assert reduces == []
    stepped = HFEngine(sync_ranks=True)
    stepped.bind(model, tok)
    assert [g.token_ids for g in stepped.generate(prompts, params)] == alone
    assert len(reduces) == 1 + params.max_new_tokens  # before the prefill, then after every step


def test_each_rank_samples_its_own_stream(tiny, monkeypatch):
    """Ranks given the same prompts (a Bandit's every group) must not draw the same answers: the generator is
    seeded with seed + rank."""
    import ragen_pl.rollout.hf as hf

    model, tok = tiny
    prompts = [tok("State: #_")["input_ids"]] * 4
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop=[], ignore_eos=True)
    drawn = []
    for rank in (0, 1, 0):
        monkeypatch.setattr(hf, "process_rank", lambda rank=rank: rank)
        engine = HFEngine(seed=3)
        engine.bind(model, tok)
        drawn.append([g.token_ids for g in engine.generate(prompts, params)])
    assert drawn[0] == drawn[2]  # a rank's stream is reproducible
    assert drawn[0] != drawn[1]


def assert_top_p_logprobs_are_the_nucleus(model, tok, device: str) -> None:
    """The log-prob a top-p sampler records is that of the nucleus it drew from: ``log p - log(nucleus mass)``, the
    mass recomputed here. At temperature 0.1 the distribution is peaked, so the nucleus' mass is far from ``top_p``
    itself on most tokens (checked), and the positive control, the wrong normaliser ``log p - log(top_p)``, fails the
    same check: a flat distribution (the tiny model's at temperature 1) cannot tell the two apart."""
    import math

    params = SamplingParams(temperature=0.1, top_p=0.7, max_new_tokens=16, stop=[])
    prompts = [tok("Turn 1:\nState:\n" + "#_" * k)["input_ids"] for k in range(1, 9)]
    engine = HFEngine(seed=3)
    engine.bind(model, tok)
    gens = engine.generate(prompts, params)
    exact = wrong = apart = total = 0
    for prompt, gen in zip(prompts, gens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen.token_ids], device=device)).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits.float() / params.temperature, -1)
        lp = logp.gather(-1, torch.tensor(gen.token_ids, device=device)[:, None]).squeeze(-1)
        probs = logp.exp().sort(-1, descending=True).values
        mass = (probs * (probs.cumsum(-1) - probs < params.top_p)).sum(-1)  # the nucleus: mass before it < top_p
        recorded = torch.tensor(gen.logprobs, device=device)
        exact += int(((recorded - (lp - mass.log())).abs() < 1e-3).sum())
        wrong += int(((recorded - (lp - math.log(params.top_p))).abs() < 1e-3).sum())
        apart += int(((mass.log() - math.log(params.top_p)).abs() > 1e-2).sum())
        total += len(gen.token_ids)
    assert apart >= 0.5 * total, (apart, total)  # the two normalisers differ by more than the tolerance
    assert exact >= 0.95 * total, (exact, total)  # a token at the nucleus' edge may fall the other side in a replay
    assert wrong <= 0.5 * total, (wrong, total)  # the positive control: dividing by top_p is told apart


def test_top_p_logprobs_are_the_nucleus_on_a_peaked_distribution(tiny):
    model, tok = tiny
    assert_top_p_logprobs_are_the_nucleus(model.eval(), tok, "cpu")
