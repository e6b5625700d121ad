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
from ragen_pl.update import StarPOUpdate, entropy_metrics, mismatch_metrics


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


def test_entropy_metrics_hand_derived_per_env():
    from tests.helpers import make_batch

    # Env a: rows 0 and 2 (3 + 1 sampled tokens); env b: row 1 (2 tokens). Log-probs are -1, -2, -3, ...
    batch = make_batch([[1, 1, 1, 0], [0, 1, 1, 0], [1, 0, 0, 0]],
                       old_logprobs=[[-1, -2, -3, -9], [-9, -4, -6, -9], [-2, -9, -9, -9]], env_tags=["a", "b", "a"])
    m = {k: float(v) for k, v in entropy_metrics(batch).items()}
    assert m["rollout/token_entropy"] == pytest.approx((1 + 2 + 3 + 4 + 6 + 2) / 6)
    assert m["rollout/trajectory_entropy"] == pytest.approx((6 + 10 + 2) / 3)
    assert m["rollout/a/token_entropy"] == pytest.approx((1 + 2 + 3 + 2) / 4)
    assert m["rollout/b/token_entropy"] == pytest.approx((4 + 6) / 2)
    batch.env_tags = ("a", "a", "a")  # one env: the batch-wide figure says it all ...
    assert not any(k.count("/") == 2 for k in entropy_metrics(batch))
    # ... unless the run has several (its filter kept one env's groups): then that env's own figure too
    assert float(entropy_metrics(batch, by_tag=True)["rollout/a/token_entropy"]) == pytest.approx(18 / 6)


def test_off_policy_correction_hand_derived():
    """Two trajectories of two sampled tokens; d = log(p_old / p_sampler) per token:
    row 0: (0.0, ln 3) -> ratios 1, 3; row 1: (-ln 2, -ln 2) -> ratios 0.5, 0.5."""
    import math

    from ragen_pl.update import off_policy_correction

    mask = torch.tensor([[False, True, True], [False, True, True]])
    old = torch.tensor([[0.0, -1.0, -1.0 + math.log(3)], [0.0, -1.0 - math.log(2), -2.0 - math.log(2)]])
    rollout = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -2.0]])
    adv = torch.tensor([[0.0, 1.0, 1.0], [0.0, -2.0, -2.0]])
    out, metrics = off_policy_correction(adv, mask, old, rollout, tis_cap=2.0, mis_bound=None)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 2.0], [0.0, -1.0, -1.0]]))  # capped at 2; halved
    assert float(metrics["offpolicy/tis_clipped_frac"]) == pytest.approx(0.25)  # 1 of 4 tokens above the cap
    assert float(metrics["offpolicy/tis_weight_mean"]) == pytest.approx((1 + 2 + 0.5 + 0.5) / 4)
    # Masking at bound 1.8: row 0's mean log-ratio ln(3)/2 = 0.549 -> exp 1.73, kept; row 1's -ln 2 -> 0.5, out.
    out, metrics = off_policy_correction(adv, mask, old, rollout, tis_cap=None, mis_bound=1.8)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))  # row 1 weighs nothing
    assert float(metrics["offpolicy/masked_frac"]) == 0.5
    # Off by default: nothing changes, nothing is logged.
    out, metrics = off_policy_correction(adv, mask, old, rollout, None, None)
    assert out is adv and metrics == {}


def test_off_policy_correction_in_an_update_changes_the_gradient_as_the_weights_say():
    """A two-layer model: with the sampler's log-probs 1 nat below the trainer's on one row (ratio e, capped at 2),
    that row's policy gradient doubles; masking it (mean ratio e > 2) removes it: with advantage 0 and its tokens kept
    in the token-mean's denominator (``zero_advantage``), the others' gradient as it was; taken out of the mask, as
    verl's rollout correction does (``excluded``, the default), the others' gradient over their own tokens only:
    scaled by (all tokens) / (the other rows' tokens)."""
    model = TwoLayer()
    batch = two_turn_batch()
    grads = {}
    for name, cfg in {"off": {}, "tis": dict(tis_cap=2.0), "mis": dict(mis_bound=2.0),
                      "mis_zero": dict(mis_bound=2.0, mis_rejected="zero_advantage")}.items():
        m = copy.deepcopy(model)
        b = copy.deepcopy(batch)
        update = StarPOUpdate(GRPO(scale="none"), PPOConfig(mini_batch_size=4, micro_batch_size=4, entropy_coeff=0.0,
                                                             grad_clip=1e9, **cfg))
        update.prepare(b, Models(m))
        with torch.no_grad():
            from ragen_pl.scoring import score

            old = score(m, b.input_ids, b.attention_mask, b.loss_mask).logprobs
        b.rollout_logprobs = old.clone()
        b.rollout_logprobs[3] = torch.where(b.loss_mask[3], old[3] - 1.0, 0.0)  # row 3: p_old / p_sampler = e
        update.step(b, Models(m), [torch.optim.SGD(m.parameters(), lr=0.0)])
        grads[name] = torch.cat([p.grad.flatten() for p in m.parameters()])
    # Rebuild the expected gradients from the per-row pieces: the loss is a token-mean over the same denominator,
    # so it is linear in each row's advantages.
    def row_grad(rows, factor):
        m = copy.deepcopy(model)
        b = copy.deepcopy(batch)
        update = StarPOUpdate(GRPO(scale="none"), PPOConfig(mini_batch_size=4, micro_batch_size=4, entropy_coeff=0.0,
                                                             grad_clip=1e9))
        update.prepare(b, Models(m))
        keep = torch.zeros(4, dtype=torch.bool)
        keep[rows] = True
        b.advantages = torch.where(keep[:, None], b.advantages * factor, 0.0)
        update.step(b, Models(m), [torch.optim.SGD(m.parameters(), lr=0.0)])
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    others = row_grad([0, 1, 2], 1.0)
    torch.testing.assert_close(grads["off"], others + row_grad([3], 1.0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads["tis"], others + row_grad([3], 2.0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads["mis_zero"], others, atol=1e-6, rtol=1e-5)
    tokens = batch.loss_mask.sum()
    torch.testing.assert_close(grads["mis"], others * tokens / batch.loss_mask[:3].sum(), atol=1e-6, rtol=1e-5)
    assert batch.loss_mask[3].sum() > 0  # (so the two rules differ)


@pytest.mark.parametrize("sampling", [dict(top_k=5), dict(top_p=0.6), dict(top_k=20, top_p=0.7)],
                         ids=["top_k", "top_p", "top_k_and_top_p"])
def test_sampling_mask_replay_scores_each_token_over_its_samplers_set(tiny, sampling):
    """The hf engine records the ids each token was drawn from; a row-by-row reference rebuilds that set from the
    full logits; the update, replaying it, scores the engine's own log-probs (mismatch ~0), which it does not when
    it scores the whole vocabulary."""
    from ragen_pl.advantages import GAE
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.policy import ValueModel
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine

    model, tok = tiny
    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    config = RolloutConfig(max_turns=2, max_new_tokens=6, temperature=0.8, **sampling)
    batch = Collector(engine, tok, config).collect([EpisodeSpec(Sokoban(), seed=s, group_id=s) for s in range(3)]).batch
    assert batch.sampling_masks is not None
    # Row by row: the processed distribution of each sampled token, from the full logits.
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float() / 0.8
    checked = 0
    for b, t in batch.loss_mask.nonzero().tolist():
        z = logits[b, t - 1]
        order = torch.argsort(z, descending=True)
        k = sampling.get("top_k", z.numel())
        support = order[:k]
        if "top_p" in sampling:
            probs = torch.softmax(z[support], -1)
            n = int(((probs.cumsum(-1) - probs) < sampling["top_p"]).sum())
            support = support[:n]
        kept = batch.sampling_masks[b, t]
        assert sorted(kept[kept >= 0].tolist()) == sorted(support.tolist())
        expected = torch.log_softmax(z[support], -1)[(support == batch.input_ids[b, t]).nonzero()[0, 0]]
        assert float(batch.rollout_logprobs[b, t]) == pytest.approx(float(expected), abs=1e-4)
        checked += 1
    assert checked > 10
    critic = ValueModel(copy.deepcopy(model.model), model.config.hidden_size)
    results = {}
    for replay in (True, False):
        b = copy.deepcopy(batch)
        StarPOUpdate(GAE(), PPOConfig(mini_batch_size=2, micro_batch_size=2, replay_sampling_mask=replay)).prepare(
            b, Models(model, critic=critic))
        results[replay] = float(mismatch_metrics(b)["mismatch/logprob_abs_diff_max"])
    assert results[True] < 1e-4 < 0.01 < results[False]
