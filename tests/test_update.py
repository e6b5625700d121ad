"""The update on its own, without Lightning (ragen_pl.update): a two-layer torch model checked against a plain
reference loop, one temperature end to end, and the sampler-vs-trainer mismatch metrics."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ragen_pl.advantages import GRPO
from ragen_pl.config import PPOConfig, RolloutConfig
from ragen_pl.policy import Models
from ragen_pl.types import TrajectoryBatch
from ragen_pl.update import StarPOUpdate, mismatch_metrics


class TwoLayer(nn.Module):
    """Embedding -> tanh(linear) -> LM head, with transformers' calling convention (no attention: position t sees
    token t only, which is all the update needs)."""

    def __init__(self, vocab: int = 11, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix, self.head = nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, vocab)
        self.config = SimpleNamespace(hidden_size=hidden)

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, use_cache=False, output_hidden_states=False):
        h = torch.tanh(self.mix(self.embed(input_ids)))
        if isinstance(logits_to_keep, torch.Tensor):
            h_kept = h[:, logits_to_keep]
        else:
            h_kept = h[:, -logits_to_keep:] if logits_to_keep else h
        return SimpleNamespace(logits=self.head(h_kept), hidden_states=(h,) if output_hidden_states else None)


def two_turn_batch() -> TrajectoryBatch:
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 0, 0], [9, 2, 3, 3, 3, 1], [9, 2, 4, 5, 1, 0]])
    attn = ids.new_tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]).bool()
    mask = ids.new_tensor([[0, 0, 1, 1, 0, 1], [0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 1, 1], [0, 0, 1, 1, 1, 0]]).bool()
    rewards = torch.zeros(4, 6)
    rewards[0, 5], rewards[1, 3], rewards[2, 5], rewards[3, 4] = 1.0, 0.0, 0.0, 2.0
    return TrajectoryBatch(input_ids=ids, attention_mask=attn, loss_mask=mask, rewards=rewards,
                           turn_ids=torch.where(mask, 0, -1), group_ids=torch.tensor([0, 0, 1, 1]),
                           env_tags=["a"] * 4)


def test_one_grpo_step_of_a_two_layer_model_matches_a_plain_reference_loop():
    """One mini-batch, one step: the ratio is 1, so PPO's gradient is that of the token-mean of -A log p minus the
    entropy bonus. The update's gradients (left on the parameters after its step) equal a loop over tokens."""
    model = TwoLayer()
    reference = copy.deepcopy(model)
    ppo = PPOConfig(mini_batch_size=4, micro_batch_size=2, entropy_coeff=0.01, grad_clip=1e9)
    update = StarPOUpdate(GRPO(scale="none"), ppo)
    batch = two_turn_batch()
    update.prepare(batch, Models(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = update.step(batch, Models(model), [opt])
    assert float(metrics["train/optimizer_steps"]) == 1
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))

    # Group means: group 0 scores (1, 0) -> advantages (0.5, -0.5); group 1 scores (0, 2) -> (-1, 1).
    advantage = [0.5, -0.5, -1.0, 1.0]
    total, count = 0.0, 0
    for b in range(4):
        logits = reference(batch.input_ids[b:b + 1]).logits[0]  # (T, V)
        for t in range(1, 6):
            if batch.loss_mask[b, t]:
                logp = torch.log_softmax(logits[t - 1], -1)
                entropy = -(logp.exp() * logp).sum()
                total = total - advantage[b] * logp[batch.input_ids[b, t]] - 0.01 * entropy
                count += 1
    (total / count).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_update_scores_at_the_temperature_the_batch_was_sampled_with(tiny):
    """Sampled at 0.7 by the hf engine: the update's old log-probs are the engine's own (mismatch ~0), which they are
    not when scored at 1.0."""
    from ragen_pl.advantages import GAE
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.policy import ValueModel
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine

    model, tok = tiny
    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    config = RolloutConfig(max_turns=2, max_new_tokens=6, temperature=0.7)
    batch = Collector(engine, tok, config).collect([EpisodeSpec(Sokoban(), seed=s, group_id=s) for s in range(4)]).batch
    assert batch.temperature == 0.7 and batch.rollout_logprobs is not None
    critic = ValueModel(copy.deepcopy(model.model), model.config.hidden_size)
    models = Models(model, critic=critic)
    StarPOUpdate(GAE(), PPOConfig(mini_batch_size=2, micro_batch_size=2)).prepare(batch, models)
    at_07 = mismatch_metrics(batch)
    assert float(at_07["mismatch/logprob_abs_diff_max"]) < 1e-4
    wrong = copy.copy(batch)
    wrong.temperature, wrong.old_logprobs, wrong.advantages = 1.0, None, None
    StarPOUpdate(GAE(), PPOConfig(mini_batch_size=2, micro_batch_size=2)).prepare(wrong, models)
    assert float(mismatch_metrics(wrong)["mismatch/logprob_abs_diff_mean"]) > 0.005  # ~0.05 for this model


def test_mismatch_metrics_hand_derived():
    batch = two_turn_batch()
    mask = batch.loss_mask
    batch.old_logprobs = torch.where(mask, -1.0, 0.0)
    batch.rollout_logprobs = torch.where(mask, -1.0, 0.0)
    batch.rollout_logprobs[0, 2] = -1.5  # trainer - sampler = +0.5 at one token
    batch.rollout_logprobs[3, 4] = -0.5  # and -0.5 at another
    m = mismatch_metrics(batch)
    n = int(mask.sum())  # 10 sampled tokens
    assert float(m["mismatch/logprob_abs_diff_mean"]) == pytest.approx(1.0 / n)
    assert float(m["mismatch/logprob_abs_diff_max"]) == pytest.approx(0.5)
    # k3 = e^d - 1 - d at d = +0.5 and -0.5
    k3 = (torch.exp(torch.tensor(0.5)) - 1.5) + (torch.exp(torch.tensor(-0.5)) - 0.5)
    assert float(m["mismatch/kl_k3"]) == pytest.approx(float(k3) / n, rel=1e-5)
    batch.rollout_logprobs = None
    assert mismatch_metrics(batch) == {}
