"""The readout under 2 CPU processes (gloo): ReadoutUpdate's head-only steps under DDP, with a standardised value
head fitted over both ranks; the centred head fitted over both ranks and merged under FSDP2."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SMALL = ["--trainer.max_steps=2", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.precision=32-true",
         "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--data.n_groups=4",
         "--data.group_size=2", "--data.filter.init_args.top_p=0.5", "--data.rollout.max_turns=2",
         "--data.rollout.max_new_tokens=4", "--model.ppo.mini_batch_size=4", "--model.ppo.micro_batch_size=2",
         "--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.name=sokoban"]


@pytest.mark.slow
@pytest.mark.parametrize("value_head", ["none", "standardised"])
def test_two_cpu_processes_train_the_head_alone(value_head, tiny_model_path, tmp_path):
    """Two DDP processes train only a LoRA head with ReadoutUpdate: the update's steps run the head alone (no trunk
    position in the update); a standardised value head on the policy's trunk (fitted over both ranks) with it."""
    args = [sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(ROOT / "configs" / "sokoban.yaml"),
            "--trainer.strategy=ddp", "--model.lora.target_modules=[lm_head]", "--model.lora.r=4",
            "--model.lora.alpha=8", "--model.updater=ragen_pl_experiments.update.ReadoutUpdate"]
    if value_head == "standardised":
        args += ["--model.critic=shared", "--model.hooks=[ragen_pl_experiments.readout.StandardisedValues]"]
    args += [f"--model.model={tiny_model_path}", f"--trainer.logger.init_args.save_dir={tmp_path}", *SMALL]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(next(tmp_path.glob("sokoban/version_*/metrics.csv"))) as f:
        steps = [r for r in csv.DictReader(f) if r.get("filter/kept_frac")]
    assert len(steps) == 2
    for r in steps:
        assert float(r["train/optimizer_steps"]) >= 1 and float(r["throughput/update_positions"]) == 0
        assert float(r["loss/policy"]) == float(r["loss/policy"])  # finite, not nan


def _two_workers(script: str, model_path, tmp_path) -> list[dict]:
    """Run ``experiments/tests/<script>`` as ranks 0 and 1 of a gloo group (one thread each); what each wrote."""
    from ragen_pl.servers import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # the core tests' worker helpers
    procs = [subprocess.Popen([sys.executable, str(HERE / script), str(rank), "2", str(port), str(model_path),
                               str(tmp_path / f"rank{rank}.json")], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                              text=True) for rank in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_sharded_readout_fits_and_merges_like_one_process(tiny_model_path, tmp_path):
    """FSDP2 on 2 CPU processes with LoRA on layers and a centred, whitened head (``ReadoutHead(center=2, whiten)``):
    both ranks fix the same shared directions, those of the second moment summed over both ranks' hidden states, and
    the same scales, the root mean squares of the centred states over both ranks' rows; and the merged weights an
    engine gets (sharded weights gathered, the centring folded) equal a one-process merge of the same adapters with
    those directions. The turn directions of `center_turns` are those of both ranks' rows together, also for a turn
    only one rank saw."""
    from lora_shard_worker import turn_rows
    from ragen_pl_experiments.readout import FEATURE_SCALE, SHARED_DIRECTIONS, ReadoutHead, turn_directions
    from transformers import AutoModelForCausalLM

    from ragen_pl.config import LoraSettings
    from ragen_pl.lora import add_lora
    from ragen_pl.policy import policy_state_dict

    ranks = _two_workers("lora_shard_worker.py", tiny_model_path, tmp_path)
    # the turn directions of `center_turns`: the turns' means over both ranks' rows (rank 0 never saw turn 2)
    (rows0, turns0), (rows1, turns1) = turn_rows(0), turn_rows(1)
    one = turn_directions(torch.cat([rows0, rows1]), torch.cat([turns0, turns1]), 2)
    by_turn = torch.tensor(ranks[0]["by_turn"], dtype=torch.float64)
    assert torch.equal(by_turn, torch.tensor(ranks[1]["by_turn"], dtype=torch.float64)) and by_turn[:, 1].any()
    torch.testing.assert_close(by_turn @ by_turn.T, one @ one.T, atol=1e-10, rtol=0)
    directions = torch.tensor(ranks[0]["directions"])
    assert torch.equal(directions, torch.tensor(ranks[1]["directions"]))
    _, vectors = torch.linalg.eigh(sum(torch.tensor(r["moment"], dtype=torch.float64) for r in ranks))
    reference = vectors[:, -2:]
    torch.testing.assert_close((directions @ directions.T).double(), reference @ reference.T, atol=1e-4, rtol=0)
    scale = torch.tensor(ranks[0]["scale"])
    assert torch.equal(scale, torch.tensor(ranks[1]["scale"]))
    moment = sum(torch.tensor(r["moment"], dtype=torch.float64) for r in ranks)
    keep = torch.eye(len(scale), dtype=torch.float64) - reference @ reference.T
    rms = (torch.diagonal(keep @ moment @ keep) / sum(r["rows"] for r in ranks)).sqrt()
    torch.testing.assert_close(scale.double(), rms.clamp_min(1e-2 * rms.mean()), atol=1e-4, rtol=1e-3)

    lora = LoraSettings(r=4, alpha=8, target_modules=["lm_head", "q_proj", "down_proj"])
    hook = ReadoutHead(center=2, whiten=True)
    policy = hook.after_load(add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), lora), None)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        head_a = policy.get_base_model().get_output_embeddings().lora_A["default"]
        getattr(head_a, SHARED_DIRECTIONS).copy_(directions)
        getattr(head_a, FEATURE_SCALE).copy_(scale)
    plain = policy_state_dict(policy, lora=True, hooks=[hook])
    for rank in ranks:
        assert set(rank["merged"]) == {"lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                                       "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.down_proj.weight"}
        for key, value in rank["merged"].items():
            torch.testing.assert_close(torch.tensor(value), plain[key], atol=1e-5, rtol=1e-5)
