"""The update's losses, metrics and gradients on a recorded batch stay what they were (issue 21's regression guard).

``tests/data/update_regression/<case>.json`` was written by this test (``RAGEN_PL_RECORD=1``) against the code before
the update moved out of ``RagenModule`` into its own module; the refactor must reproduce it. The batch is built from
seeded integer and uniform draws (the same on every CPU), the tiny model from its seeded recipe, so only float
rounding differs between machines: the tolerances allow that and nothing more.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ragen_pl.advantages import GAE, GRPO, RLOO, BiLevelGAE, ReinforcePP
from ragen_pl.config import OptimConfig, PPOConfig
from ragen_pl.module import RagenModule
from ragen_pl.rewards import RewardNorm
from ragen_pl.types import TrajectoryBatch
from ragen_pl.update import entropy_metrics

DATA = Path(__file__).parent / "data" / "update_regression"

CASES = {
    # Two mini-batches x two epochs: later steps score with updated weights (ratio != 1, clipping engages).
    "gae_separate_critic": dict(advantage=GAE(), ppo=dict(mini_batch_size=4, micro_batch_size=2, ppo_epochs=2)),
    # One optimiser step: the update's own forward gives the old log-probs.
    "grpo_one_step": dict(advantage=GRPO(), ppo=dict(mini_batch_size=8, micro_batch_size=4)),
    "bilevel_shared_kl_reward_dual_clip": dict(
        advantage=BiLevelGAE(), critic="shared",
        ppo=dict(mini_batch_size=4, micro_batch_size=4, kl_coeff=0.01, kl_mode="reward", dual_clip=3.0)),
    "rloo_norm_kl_loss_seq_sum": dict(
        advantage=RLOO(), reward_norm=RewardNorm(method="mean_std_clip"),
        ppo=dict(mini_batch_size=4, micro_batch_size=2, kl_coeff=0.05, kl_estimator="k2",
                 loss_agg="seq-mean-token-sum", entropy_coeff=0.01)),
    "reinforce_pp_temperature_0_7": dict(advantage=ReinforcePP(), temperature=0.7,
                                         ppo=dict(mini_batch_size=8, micro_batch_size=8, ppo_epochs=2)),
}


def recorded_batch(vocab: int, B: int = 8, T: int = 40, seed: int = 0) -> TrajectoryBatch:
    """8 right-padded multi-turn rows in 4 groups of 2: prompt, then 3 turns of sampled tokens with env text
    between them, a reward on each turn's last token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    attn = torch.arange(T)[None, :] < lengths[:, None]
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    turn_ids = torch.full((B, T), -1)
    rewards = torch.zeros(B, T)
    for b in range(B):
        n = int(lengths[b])
        pos = 6  # a 6-token prompt
        for turn in range(3):
            span = int(torch.randint(2, 5, (1,), generator=g))
            end = min(pos + span, n)
            if end <= pos:
                break
            loss_mask[b, pos:end], turn_ids[b, pos:end] = True, turn
            rewards[b, end - 1] = float(torch.randint(0, 3, (1,), generator=g)) - 0.5
            pos = end + 3  # env text between turns
    return TrajectoryBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, rewards=rewards,
                           turn_ids=turn_ids, group_ids=torch.arange(B) // 2, env_tags=["a", "b"] * (B // 2))


def run_case(model_path, case: dict) -> dict:
    """Prepare and update once, with the module's models and optimisers but no Trainer (the update needs none)."""
    case = dict(case)
    temperature = case.pop("temperature", 1.0)  # recorded with the old `model.ppo.temperature`; now the batch's
    module = RagenModule(str(model_path), ppo=PPOConfig(**case.pop("ppo")),
                         optim=OptimConfig(actor_lr=1e-3, critic_lr=1e-3), seed=3, **case)
    optimizers, _ = module.configure_optimizers()
    torch.manual_seed(0)
    batch = recorded_batch(module.policy.config.vocab_size)
    batch.temperature = temperature
    metrics = dict(module.updater.prepare(batch, module.models))
    metrics.update(module.updater.step(batch, module.models, optimizers))
    metrics.update(entropy_metrics(batch, by_tag=False))  # as recorded: the batch-wide figures
    grads = {n: float(p.grad.norm()) for n, p in module.named_parameters() if p.grad is not None}
    return {"metrics": {k: float(v) for k, v in sorted(metrics.items())},
            "grad_norms": dict(sorted(grads.items())),
            "advantages": batch.advantages[batch.loss_mask].tolist(),
            "old_logprobs": batch.old_logprobs[batch.loss_mask].tolist()}


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", list(CASES))
def test_update_matches_the_recorded_one(tiny_model_path, name, pack):
    """Packed rows (``--model.ppo.pack``, no padding) reproduce the padded update recorded before packing existed."""
    case = CASES[name]
    if pack:
        case = {**case, "ppo": {**case["ppo"], "pack": True, "share_prefix": False}}
    got = run_case(tiny_model_path, case)
    path = DATA / f"{name}.json"
    if os.environ.get("RAGEN_PL_RECORD") and not pack:
        path.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(path.read_text())
    # Every recorded metric is still logged; new ones may be added only as throughput counts.
    assert set(want["metrics"]) <= set(got["metrics"])
    assert all(k.startswith("throughput/") for k in set(got["metrics"]) - set(want["metrics"]))
    for key, value in want["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-3, abs=1e-5, nan_ok=True), key
    assert sorted(got["grad_norms"]) == sorted(want["grad_norms"])
    for key, value in want["grad_norms"].items():
        assert got["grad_norms"][key] == pytest.approx(value, rel=2e-3, abs=1e-6), key
    torch.testing.assert_close(torch.tensor(got["advantages"]), torch.tensor(want["advantages"]), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["old_logprobs"]), torch.tensor(want["old_logprobs"]), rtol=1e-4,
                               atol=1e-5)
