"""Several processes: DDP and FSDP2 (ModelParallelStrategy) with 2 CPU processes over gloo, and the cross-rank
filter, which must rank all groups of all ranks together."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ragen_pl.data import RolloutDataModule
from ragen_pl.envs.bandit import Bandit
from ragen_pl.filters import SNR, VarianceTopP
from tests.helpers import make_batch

ROOT = Path(__file__).resolve().parents[1]


def _rank_batch(scores, first_group, group_size):
    n = len(scores)
    return make_batch([[0, 1]] * n, rewards=[[0, s] for s in scores],
                      group_ids=[first_group + i // group_size for i in range(n)])


FILTERS = {
    "variance_top_p": VarianceTopP(top_p=0.25),
    "snr_top_p_linear": SNR(strategy="top_p", value=0.5, include_zero=False),
    "snr_top_p_softmax": SNR(strategy="top_p", value=0.3, top_p_mode="softmax"),
    "snr_top_k": SNR(strategy="top_k", value=0.25),
    "snr_top_k_abs": SNR(strategy="top_k_abs", value=2),
    "snr_min_p": SNR(strategy="min_p", value=0.5),
    "snr_sampled_nll": SNR(strategy="top_k", value=0.25, metric="sampled_nll"),
}


@pytest.mark.parametrize("name", list(FILTERS))
def test_filter_ranks_all_groups_across_ranks(monkeypatch, name):
    """Two simulated ranks: the kept trajectories equal a single-process filter over the union. Rank 0 holds both
    top groups, so a filter that ranked each rank's groups on its own (keeping some on rank 1) would differ."""
    import ragen_pl.data as data_py

    group_size, filt = 2, FILTERS[name]
    per_rank = [[0, 4, 5, 0, 0, 1, 9, 0], [1, 1, 0, 1, 2, 2, 0, 0]]  # 4 groups per rank
    entropy = [[3, 3, 0.1, 0.1, 0.2, 0.2, 4, 4], [1, 1, 0.5, 0.5, 0.2, 0.2, 0.3, 0.3]]  # rank 0: top 2 again
    batches = []
    for r, (s, e) in enumerate(zip(per_rank, entropy)):
        b = _rank_batch(s, 4 * r, group_size)
        b.rollout_logprobs = torch.tensor([[0.0, -x] for x in e])  # one sampled token: its entropy estimate is x
        batches.append(b)
    gathered = []
    for b in batches:  # what each rank contributes to the gather (see RolloutDataModule._filter)
        st = b.stats()
        gathered.append(torch.stack([st.scores.double(), st.group_ids.double(), st.lengths.double(),
                                     st.entropy.double()], dim=1))
    monkeypatch.setattr(data_py, "gather_rows", lambda mine, device: gathered)
    monkeypatch.setattr(RolloutDataModule, "world", property(lambda self: (self.trainer.global_rank, 2)))
    keeps = []
    for rank in range(2):
        dm = RolloutDataModule(Bandit(), n_groups=8, group_size=group_size, filter=filt)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2,
                                     strategy=SimpleNamespace(root_device=torch.device("cpu")))
        keep, metrics = dm._filter(batches[rank])
        keeps.append(keep)
    union = _rank_batch(per_rank[0] + per_rank[1], 0, group_size)
    union.rollout_logprobs = torch.cat([b.rollout_logprobs for b in batches])
    expected = filt(union).keep
    assert torch.equal(torch.cat(keeps), expected)
    assert keeps[0].any() and not keeps[1].any()  # the kept groups are all rank 0's ...
    assert filt(batches[1]).keep.any()  # ... where ranking rank 1 alone would keep some of its own


SMALL = [
    "--trainer.max_steps=2", "--trainer.precision=32-true", "--trainer.accelerator=cpu", "--trainer.devices=2",
    "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
    "--data.n_groups=4", "--data.group_size=2", "--data.rollout.max_new_tokens=6", "--data.rollout.max_turns=2",
    "--data.filter.init_args.top_p=0.5", "--model.ppo.mini_batch_size=2", "--model.ppo.micro_batch_size=1",
    "--torch_threads=1",
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "ddp, lm_head lora", "ddp, gigpo"])
def test_two_cpu_processes(strategy, tiny_model_path, tmp_path):
    """Two processes train (DDP, FSDP2, DDP with only a LoRA head trained, and DDP with GiGPO, whose groups each
    rank plays whole)."""
    args = [sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(ROOT / "configs" / "sokoban.yaml")]
    if strategy == "fsdp2":
        args += ["--config", str(ROOT / "configs" / "variants" / "fsdp2.yaml")]
    else:
        args += ["--trainer.strategy=ddp"]
    if strategy == "ddp, gigpo":
        args += ["--config", str(ROOT / "configs" / "variants" / "gigpo.yaml")]
    if strategy == "ddp, lm_head lora":
        args += ["--model.lora.target_modules=[lm_head]", "--model.lora.r=4", "--model.lora.alpha=8"]
    args += [f"--model.model={tiny_model_path}", f"--trainer.logger.init_args.save_dir={tmp_path}", *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    with open(next(tmp_path.glob("sokoban/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r.get("filter/kept_frac")]
    assert len(steps) == 2
    for r in steps:
        assert float(r["filter/kept_frac"]) == 0.5  # top 50% of the 4 groups of both ranks together
        assert float(r["train/optimizer_steps"]) >= 1
        assert float(r["loss/policy"]) == float(r["loss/policy"])  # finite, not nan
        assert float(r["throughput/update_positions"]) > 0
        if strategy == "ddp, gigpo":
            assert float(r["gigpo/anchor_group_size"]) >= 1.0 and "loss/value" not in r
        else:
            assert float(r["loss/value"]) == float(r["loss/value"])


@pytest.mark.slow
def test_a_ddp_run_evaluates_and_writes_samples(tiny_model_path, tmp_path):
    """Evaluation under 2 processes: the evaluation before training and after each iteration finish (a callback that
    asked for the log folder on rank 0 alone hung the run at the first evaluation), are averaged over both ranks'
    episodes, and rank 0 writes the sample trajectories."""
    small = [a for a in SMALL if not a.startswith(("--trainer.limit_val_batches", "--trainer.max_steps"))]
    args = [sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(ROOT / "configs" / "bandit.yaml"),
            "--trainer.strategy=ddp", f"--model.model={tiny_model_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
            *small, "--trainer.max_steps=2", "--trainer.val_check_interval=1", "--data.val_episodes=4"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = next(tmp_path.glob("bandit/version_*"))
    with open(run / "metrics.csv") as f:
        evaluated = [r for r in csv.DictReader(f) if r.get("val/Bandit/success")]
    assert [r["step"] for r in evaluated] == ["0", "1", "2"]  # before training, then after iterations 1 and 2
    samples = sorted((run / "samples").glob("step_*.jsonl"))
    assert [p.name for p in samples] == ["step_000000.jsonl", "step_000001.jsonl", "step_000002.jsonl"]
    for path in samples:  # rank 0's 2 of each env's 4 episodes
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [(r["env"], r["seed"]) for r in rows] == [("Bandit", 1_000_000), ("Bandit", 1_000_002),
                                                          ("BanditTraderLibrarian", 1_000_000),
                                                          ("BanditTraderLibrarian", 1_000_002)]


@pytest.mark.slow
def test_ranks_playing_different_envs_log_every_envs_metrics(tiny_model_path, tmp_path):
    """Two envs, one group per rank: rank 0 plays only Bandit and rank 1 only FrozenLake. Both envs' metrics are
    logged, each from the rank that played it, and the batch-wide success is their mean (equal trajectory counts)."""
    small = [a for a in SMALL if not a.startswith(("--data.", "--trainer.max_steps"))]
    args = [sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
            "--trainer.strategy=ddp", f"--model.model={tiny_model_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
            *small, "--trainer.max_steps=1", "--data.n_groups=2", "--data.group_size=2",
            "--data.rollout.max_new_tokens=6", "--data.rollout.max_turns=2"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(next(tmp_path.glob("quickstart/version_*/metrics.csv"))) as f:
        row = [r for r in csv.DictReader(f) if r.get("rollout/success")][-1]
    for name in ("success", "format_error_rate", "response_tokens", "turns"):
        bandit, lake = float(row[f"rollout/Bandit/{name}"]), float(row[f"rollout/FrozenLakeNoSlip/{name}"])
        assert float(row[f"rollout/{name}"]) == pytest.approx((bandit + lake) / 2), name


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_exactly(tiny_model_path, tmp_path):
    """FSDP2 on 2 CPU processes saves a distributed checkpoint (a folder of shards); a run resumed from it with
    `--ckpt_path=last` logs the same third step as an uninterrupted run: weights, optimiser states, the engine's
    sampling RNG, the shuffling RNG and the env seeds all came back."""
    def fit(root, steps, *extra):
        args = [sys.executable, "-m", "ragen_pl.cli", "fit", "--config", str(ROOT / "configs" / "sokoban.yaml"),
                "--config", str(ROOT / "configs" / "variants" / "fsdp2.yaml"), f"--model.model={tiny_model_path}",
                f"--trainer.logger.init_args.save_dir={root}", *SMALL, f"--trainer.max_steps={steps}",
                "--trainer.enable_checkpointing=true", *extra]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=root,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]

    def last_step(root, version):
        with open(root / "sokoban" / f"version_{version}" / "metrics.csv") as f:
            row = [r for r in csv.DictReader(f) if r.get("filter/kept_frac")][-1]
        return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/")) and k != "epoch"}

    for name in ("straight", "resumed"):
        (tmp_path / name).mkdir()
    fit(tmp_path / "straight", 3)
    fit(tmp_path / "resumed", 2)
    assert (tmp_path / "resumed" / "sokoban" / "version_0" / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    fit(tmp_path / "resumed", 3, "--ckpt_path=last")
    straight, resumed = last_step(tmp_path / "straight", 0), last_step(tmp_path / "resumed", 1)
    assert resumed["step"] == "2" and float(resumed["loss/policy"]) == float(resumed["loss/policy"])
    assert resumed == straight


def test_ranks_pad_to_the_same_size_with_inert_rows(monkeypatch):
    """A rank that keeps fewer trajectories pads with rows that carry no loss and join no real group."""
    from ragen_pl.advantages import GRPO

    batch = _rank_batch([0, 1, 2, 3], 0, 2)
    keep = torch.tensor([True, True, False, False])

    import ragen_pl.data as data_py

    monkeypatch.setattr(data_py, "max_over_processes", lambda n, device: max(n, 4))  # the other rank kept 4
    monkeypatch.setattr(RolloutDataModule, "world", property(lambda self: (0, 2)))
    dm = RolloutDataModule(Bandit(), n_groups=4, group_size=2)
    dm.trainer = SimpleNamespace(global_rank=0, world_size=2, strategy=SimpleNamespace(root_device="cpu"))
    padded = dm._pad_for_ranks(batch, keep)
    assert len(padded) == 4
    assert padded.loss_mask[2:].sum() == 0 and padded.rewards[2:].abs().sum() == 0
    assert padded.group_ids.tolist() == [0, 0, -1, -2]
    adv, _ = GRPO()(padded)
    torch.testing.assert_close(adv[:2], GRPO()(batch.select(keep))[0])  # padding changes no real advantage
    assert adv[2:].abs().sum() == 0


def _two_workers(script: str, model_path, tmp_path) -> list[dict]:
    """Run ``tests/<script>`` as ranks 0 and 1 of a gloo group (one thread each) and return what each wrote."""
    from ragen_pl.servers import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / script), str(rank), "2", str(port),
                               str(model_path), str(tmp_path / f"rank{rank}.json")],
                              cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_sharded_policy_samples_through_an_unsharded_copy(tiny_model_path, tmp_path):
    """FSDP2 on 2 CPU processes: the hf engine samples a sharded policy through an unsharded copy, without a single
    all-gather while sampling and without ranks waiting for each other, and gets the unsharded model's tokens (the
    sharded model sampling itself, in lockstep, gets them too). Under autocast the copy holds the compute dtype."""
    for r in _two_workers("sharded_sampling_worker.py", tiny_model_path, tmp_path):
        assert r["copied"] == r["expected"] == r["itself"]
        assert r["gathers_while_sampling"] == 0
        assert r["copy_dtype"] == "torch.bfloat16" and all(n >= 1 for n in r["mixed_lengths"])


def test_sharded_lora_merges_like_one_process(tiny_model_path, tmp_path):
    """FSDP2 on 2 CPU processes with LoRA on the head and on layers: the merged weights an engine gets (sharded weights
    gathered) equal a one-process merge of the same adapters. Before, the merge handed the engine sharded pieces and
    every FSDP2 run with LoRA failed at its first rollout."""
    from transformers import AutoModelForCausalLM

    from ragen_pl.config import LoraSettings
    from ragen_pl.lora import add_lora
    from ragen_pl.policy import policy_state_dict

    ranks = _two_workers("lora_shard_worker.py", tiny_model_path, tmp_path)
    policy = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                      LoraSettings(r=4, alpha=8, target_modules=["lm_head", "q_proj", "down_proj"]))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    plain = policy_state_dict(policy, lora=True)
    for rank in ranks:
        assert set(rank["merged"]) == {"lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                                       "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.down_proj.weight"}
        for key, value in rank["merged"].items():
            torch.testing.assert_close(torch.tensor(value), plain[key], atol=1e-5, rtol=1e-5)
