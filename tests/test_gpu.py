"""The CUDA path (issue 10): device-side seeded sampling, and a training run under every strategy on one GPU,
including the resume of a sharded FSDP checkpoint. Run with `pytest -m gpu` (`tox -e gpu`) on a CUDA machine."""

import csv
import warnings
from pathlib import Path

import pytest
import torch

from ragen_pl.cli import main
from ragen_pl.rollout.engine import SamplingParams
from ragen_pl.rollout.hf import HFEngine
from tests.helpers import play_turns
from tests.rollout.test_hf import assert_top_p_logprobs_are_the_nucleus

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu

SHRINK = [
    "--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.enable_progress_bar=false",
    "--trainer.limit_val_batches=0", "--data.n_groups=2", "--data.group_size=4", "--data.rollout.max_new_tokens=8",
    "--data.rollout.max_turns=2", "--model.ppo.mini_batch_size=4", "--model.ppo.micro_batch_size=2",
]
STRATEGIES = {
    "single": [],
    "ddp": ["--trainer.strategy=ddp"],
    "fsdp": ["--config", str(ROOT / "configs" / "variants" / "fsdp.yaml")],
    "fsdp2": ["--config", str(ROOT / "configs" / "variants" / "fsdp2.yaml"),
              "--trainer.strategy.init_args.data_parallel_size=1"],
}


def test_hf_engine_samples_on_cuda_seeded(tiny):
    model, tok = tiny
    model = model.to("cuda")
    prompts = [tok("Turn 1:\nState:\n" + "#_" * k)["input_ids"] for k in range(1, 9)]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, stop=[])
    runs = []
    for _ in range(2):
        engine = HFEngine(seed=7)
        engine.bind(model, tok)
        runs.append(engine.generate(prompts, params))
        assert engine.generator.device.type == "cuda"
    assert [g.token_ids for g in runs[0]] == [g.token_ids for g in runs[1]]  # seeded on the device
    state = engine.state_dict()
    assert state["generator"]["device_type"] == "cuda"
    expected = engine.generate(prompts, params)
    again = HFEngine(seed=0)
    again.load_state_dict(state)
    again.bind(model, tok)
    assert [g.token_ids for g in again.generate(prompts, params)] == [g.token_ids for g in expected]
    assert_top_p_logprobs_are_the_nucleus(model, tok, "cuda")


def _graphs_match_eager(model, tok, prompts, params):
    """The CUDA-graph path is captured (no fallback) and gives the eager loop's greedy tokens and log-probs."""
    graphs, eager = HFEngine(cuda_graphs=True), HFEngine(cuda_graphs=False)
    for engine in (graphs, eager):
        engine.bind(model, tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the eager loop would warn
        fast = graphs.generate(prompts, params)
    assert not graphs._graphs_failed
    slow = eager.generate(prompts, params)
    assert [g.token_ids for g in fast] == [g.token_ids for g in slow]
    for f, e in zip(fast, slow):
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=1e-4)
    return graphs, slow


def test_cuda_graph_decoding_matches_the_eager_loop(tiny):
    """The static-cache CUDA-graph path is captured (no fallback) and gives the eager loop's greedy tokens."""

    model, tok = tiny
    model = model.to("cuda")
    prompts = [tok("Turn 1:\nState:\n" + "#_" * k)["input_ids"] for k in (1, 7, 3, 12)]
    graphs, _ = _graphs_match_eager(model, tok, prompts, SamplingParams(temperature=0, max_new_tokens=16, stop=[]))
    sampled = graphs.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, stop=["_"]))
    assert all(len(g.token_ids) >= 1 for g in sampled)


def test_kept_prefixes_on_the_graph_path_match_whole_prompts(tiny):
    """Three turns on the CUDA-graph path with kept prefixes: the eager loop's greedy tokens with every prompt
    prefilled whole, and a fraction of its prompt tokens fed."""
    model, tok = tiny
    model = model.to("cuda")
    a, b = tok("Turn 1:\nState:\n#_#")["input_ids"], tok("Turn 1:\nState:\n#__#_#_#_#")["input_ids"]
    first, replies = [a, b, a, b, a], ["\nReward: 1\nState:\n#_", "\n_#_"]
    kept, whole = HFEngine(cuda_graphs=True), HFEngine(cuda_graphs=False, prefix_cache=False)
    for engine in (kept, whole):
        engine.bind(model, tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the eager loop would warn
        fast = play_turns(kept, tok, first, replies)
    slow = play_turns(whole, tok, first, replies)
    for (prompts, gens), (prompts_ref, gens_ref) in zip(fast, slow):
        assert prompts == prompts_ref
        for g, r in zip(gens, gens_ref):
            assert g.token_ids == r.token_ids
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), atol=1e-4, rtol=1e-4)
    assert kept.prefilled_tokens < whole.prefilled_tokens / 2


def test_graph_path_drops_finished_rows_and_captures_again(tiny, monkeypatch):
    """Rows that end early leave the captured batch (the step is captured again for the live rows): the eager
    loop's greedy tokens all the same."""

    from ragen_pl.rollout.static import StaticDecoder

    model, tok = tiny
    model = model.to("cuda")
    prompts = [tok("x" * (1 + k % 4) + "#_" * k)["input_ids"] for k in range(8)]
    params = SamplingParams(temperature=0, max_new_tokens=96, stop=["_#", "x#"])
    selects = []
    select = StaticDecoder.select
    monkeypatch.setattr(StaticDecoder, "select", lambda self, index: selects.append(len(index)) or select(self, index))
    _, slow = _graphs_match_eager(model, tok, prompts, params)
    lengths = sorted(len(g.token_ids) for g in slow)
    if lengths[len(lengths) // 2] > params.max_new_tokens - 32:
        pytest.fail(f"half the rows must end early for this check; lengths {lengths}")
    assert selects and selects[0] <= 4  # the batch shrank to the live rows, captured again


def _metrics(root: Path) -> list[dict]:
    files = sorted(root.glob("*/version_*/metrics.csv"))
    assert files, f"no metrics.csv under {root}"
    with open(files[-1]) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fit_and_resume_on_one_gpu(strategy, tiny_model_path, tmp_path, monkeypatch):
    """Two iterations under the strategy, then a resume from the run's own (for FSDP, sharded) last checkpoint."""
    monkeypatch.chdir(tmp_path)
    graph_calls: list = []  # a spy: every rollout that returned from the CUDA-graph path (a failed capture falls back)
    static = HFEngine._generate_static

    def spy(self, *args, **kwargs):
        out = static(self, *args, **kwargs)
        graph_calls.append(kwargs.get("capture"))
        return out

    monkeypatch.setattr(HFEngine, "_generate_static", spy)
    base = ["fit", "--config", str(ROOT / "configs" / "sokoban.yaml"), *STRATEGIES[strategy],
            f"--model.model={tiny_model_path}", *SHRINK, f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"]
    assert main([*base, "--trainer.max_steps=2"]) == 0
    rows = [r for r in _metrics(tmp_path / "runs") if r.get("loss/policy")]
    assert len(rows) == 2 and all(float(r["train/optimizer_steps"]) >= 1 for r in rows)
    assert all(torch.isfinite(torch.tensor(float(r["loss/policy"]))) for r in rows)
    # Every strategy samples through CUDA graphs: an unsharded policy itself, a sharded one (FSDP1, FSDP2) through
    # its unsharded copy (`engine.gather_sharded`).
    assert graph_calls and all(graph_calls), (strategy, graph_calls)
    last = next((tmp_path / "runs").rglob("last.ckpt"))
    assert main([*base, "--trainer.max_steps=3", f"--ckpt_path={last}"]) == 0
    resumed = [r for r in _metrics(tmp_path / "runs") if r.get("loss/policy")]
    assert len(resumed) == 1 and int(resumed[0]["step"]) >= 2  # continued at iteration 3, not from scratch
