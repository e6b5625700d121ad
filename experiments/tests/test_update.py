"""ReadoutUpdate (ragen_pl_experiments.update) on its own, without Lightning: the head-only steps train the same
weights as the full forward; they are used only where the trunk is frozen and the head alone reproduces the forward."""

from __future__ import annotations

import copy

import pytest
import torch
from ragen_pl_experiments.readout import ReadoutHead, StandardisedHead
from ragen_pl_experiments.update import ReadoutUpdate, trunk_is_frozen
from torch import nn

from ragen_pl.advantages import GRPO
from ragen_pl.config import LoraSettings, PPOConfig, RolloutConfig
from ragen_pl.lora import add_lora
from ragen_pl.policy import Models
from ragen_pl.types import TrajectoryBatch

pytest.importorskip("peft", reason="needs peft (pip install 'ragen-pl[peft]')")


def readout_policy(base, tok, **hook):
    return ReadoutHead(**hook).after_load(add_lora(copy.deepcopy(base), LoraSettings(r=4, alpha=8,
                                                                                     target_modules=["lm_head"])), tok)


def _sokoban_batch(model, tok, n: int = 6, **sampling) -> TrajectoryBatch:
    """A tiny model's two-turn Sokoban rollout, groups of two, with rewards that differ within groups."""
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine

    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    specs = [EpisodeSpec(Sokoban(), seed=s // 2, group_id=s // 2) for s in range(n)]
    batch = Collector(engine, tok, RolloutConfig(max_turns=2, max_new_tokens=6, **sampling)).collect(specs).batch
    last = torch.where(batch.loss_mask, torch.arange(batch.loss_mask.shape[1]), -1).max(-1).values
    batch.rewards = torch.zeros_like(batch.rewards)
    batch.rewards[torch.arange(len(batch)), last] = torch.arange(len(batch), dtype=torch.float32) % 3
    return batch


@pytest.mark.parametrize("layout", [{}, {"share_prefix": False}, {"share_prefix": False, "pack": True}, {"top_k": 8}],
                         ids=["shared prefix", "padded", "packed", "top-k replayed"])
def test_a_head_only_update_runs_only_the_head_and_trains_the_same_weights(tiny, layout, monkeypatch):
    """Only the LM head trains (a centred, whitened LoRA readout): ``prepare`` keeps what the head read, the steps run
    only the head (no trunk position in the update), and the weights, losses and old log-probs are those of the
    update that runs the whole model in every micro-batch (with top-k sampling, both score over the sampler's kept
    sets)."""
    base, tok = tiny
    layout = dict(layout)
    top_k = layout.pop("top_k", None)
    batch = _sokoban_batch(base, tok, **({"top_k": top_k} if top_k else {}))
    assert (batch.sampling_masks is not None) == (top_k is not None)

    def train(reuse: bool):
        torch.manual_seed(0)
        policy = readout_policy(base, tok, center=2, whiten=True).train()
        update = ReadoutUpdate(GRPO(), PPOConfig(mini_batch_size=4, micro_batch_size=2, ppo_epochs=2, **layout),
                               reuse_head_inputs=reuse)
        models = Models(policy, lora=True)
        assert update.reuses_head_inputs(models) == reuse
        b = copy.copy(batch)
        update.prepare(b, models)
        opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
        metrics = update.step(b, models, [opt])
        return {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}, metrics, b

    reused, m_reused, b_reused = train(True)
    full, m_full, b_full = train(False)
    assert float(m_reused["throughput/update_positions"]) == 0 < float(m_full["throughput/update_positions"])
    assert float(m_reused["throughput/update_scored_tokens"]) == float(m_full["throughput/update_scored_tokens"]) > 0
    assert float(m_reused["train/optimizer_steps"]) == float(m_full["train/optimizer_steps"]) >= 4
    torch.testing.assert_close(b_reused.old_logprobs, b_full.old_logprobs)
    for name in ("loss/policy", "loss/entropy", "actor/grad_norm"):
        torch.testing.assert_close(m_reused[name], m_full[name], atol=1e-5, rtol=1e-4, msg=name)
    assert any(float(p.abs().max()) > 0 for p in reused.values())  # it trained
    for name, p in reused.items():
        torch.testing.assert_close(p, full[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("standardise", [False, True], ids=["raw value head", "standardised value head"])
def test_a_head_only_update_with_a_value_head_trains_the_same_heads(tiny, standardise, monkeypatch):
    """PPO with GAE and a value head on the policy's trunk, only the LM head adapted (a readout): the steps run the
    LM head and the value head alone on what the LM head read, and the adapter, the value head, the values and the
    losses are those of the update that runs the whole model in every micro-batch. A standardised value head is
    fitted once, on the first batch's value positions, before its first step."""
    from ragen_pl.advantages import GAE
    from ragen_pl.policy import zero_head

    base, tok = tiny
    batch = _sokoban_batch(base, tok)

    def train(reuse: bool):
        torch.manual_seed(0)
        policy = readout_policy(base, tok, center=2, whiten=True).train()
        size = base.config.hidden_size
        head = StandardisedHead(size) if standardise else zero_head(size)
        update = ReadoutUpdate(GAE(lam=0.9), PPOConfig(mini_batch_size=4, micro_batch_size=2, ppo_epochs=2),
                               reuse_head_inputs=reuse)
        models = Models(policy, value_head=head, lora=True)
        assert update.reuses_head_inputs(models) == reuse
        b = copy.copy(batch)
        update.prepare(b, models)
        if standardise:
            assert bool(head.fitted) and float(head.scale.min()) > 0
        params = [p for p in policy.parameters() if p.requires_grad] + list(head.parameters())
        metrics = update.step(b, models, [torch.optim.Adam(params, lr=1e-2)])
        trained = {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}
        trained.update({f"value_head.{n}": p.detach() for n, p in head.named_parameters()})
        return trained, metrics, b

    reused, m_reused, b_reused = train(True)
    full, m_full, b_full = train(False)
    assert float(m_reused["throughput/update_positions"]) == 0 < float(m_full["throughput/update_positions"])
    torch.testing.assert_close(b_reused.values, b_full.values)
    for name in ("loss/policy", "loss/value", "actor/grad_norm"):
        torch.testing.assert_close(m_reused[name], m_full[name], atol=1e-5, rtol=1e-4, msg=name)
    assert float(reused["value_head.linear.weight" if standardise else "value_head.weight"].abs().max()) > 0
    for name, p in reused.items():
        torch.testing.assert_close(p, full[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_value_head_is_run_on_the_lm_heads_inputs_only_where_they_are_its_hidden_states(tiny):
    """A model whose returned last hidden state is not what its LM head reads: the log-probs still match, but a
    value head on those hidden states would read other states in the head-only steps, so the update keeps the whole
    model (without a value head it may run the head alone)."""
    from ragen_pl.advantages import GAE
    from ragen_pl.policy import zero_head

    base, tok = tiny
    batch = _sokoban_batch(base, tok)
    for value_head in (None, zero_head(base.config.hidden_size)):
        head = add_lora(copy.deepcopy(base), LoraSettings(r=4, alpha=8, target_modules=["lm_head"]))

        def shifted(module, args, out):
            if out.hidden_states is not None:
                out.hidden_states = (*out.hidden_states[:-1], out.hidden_states[-1] + 1.0)
            return out

        head.get_base_model().register_forward_hook(shifted)
        update = ReadoutUpdate(GAE() if value_head is not None else GRPO(),
                               PPOConfig(mini_batch_size=4, micro_batch_size=2))
        models = Models(head, value_head=value_head, lora=True)
        update.prepare(copy.copy(batch), models)
        assert update.reuses_head_inputs(models) == (value_head is None)


def test_a_standardised_value_head_reads_each_dimension_less_its_mean_over_its_spread():
    """Hand-derived: states (1, 2), (3, 6), (2, 4) have mean (2, 4) and root mean square deviations (sqrt(2/3),
    2 sqrt(2/3)), so the head reads (-1, -1), (1, 1), (0, 0) times sqrt(3/2); a dimension that does not vary is
    read at the floor (1% of the mean spread), not divided by 0. Before its fit and its first step it is 0, and a
    training forward of it unfitted is refused (nothing fits it behind the update's back)."""
    import math

    head = StandardisedHead(3)
    states = torch.tensor([[1.0, 2.0, 5.0], [3.0, 6.0, 5.0], [2.0, 4.0, 5.0]])
    with torch.no_grad():
        assert float(head(states).abs().max()) == 0 and not bool(head.fitted)
    with pytest.raises(RuntimeError, match=r"the standardised value head \(StandardisedValues\) is fitted before the "
                                           r"first update by `--model.updater=ragen_pl_experiments.update.ReadoutUpdate`"):
        head(states)
    head.fit(states)
    r = math.sqrt(2 / 3)
    torch.testing.assert_close(head.mean, torch.tensor([2.0, 4.0, 5.0]))
    torch.testing.assert_close(head.scale, torch.tensor([r, 2 * r, 0.01 * (3 * r) / 3]))
    with torch.no_grad():
        head.linear.weight.copy_(torch.tensor([[1.0, 1.0, 1.0]]))
        head.linear.bias.fill_(0.5)
    expected = torch.tensor([-2.0, 2.0, 0.0]) / r + 0.5
    torch.testing.assert_close(head(states).squeeze(-1), expected)
    again = StandardisedHead(3)
    again.load_state_dict(head.state_dict())  # a checkpoint keeps the fit
    assert bool(again.fitted)
    torch.testing.assert_close(again(states), head(states))


def test_a_head_is_run_alone_only_where_the_trunk_is_frozen_and_nothing_follows_the_head(tiny):
    """LoRA on a layer, or full weights: the trunk trains, so the update runs the whole model. A model that changes
    its logits after the head (as Gemma's soft-capping does): the head alone does not reproduce the forward, which
    the first micro-batch shows, and the update keeps the whole model."""
    base, tok = tiny
    layer = add_lora(copy.deepcopy(base), LoraSettings(r=4, alpha=8, target_modules=["lm_head", "q_proj"]))
    assert not trunk_is_frozen(layer) and not trunk_is_frozen(copy.deepcopy(base))
    assert not trunk_is_frozen(nn.Linear(3, 3))  # no output embeddings to run alone
    head = add_lora(copy.deepcopy(base), LoraSettings(r=4, alpha=8, target_modules=["lm_head"]))
    assert trunk_is_frozen(head)

    def halve(module, args, out):
        out.logits = out.logits / 2
        return out

    head.get_base_model().register_forward_hook(halve)
    update = ReadoutUpdate(GRPO(), PPOConfig(mini_batch_size=4, micro_batch_size=2))
    models = Models(head, lora=True)
    batch = _sokoban_batch(base, tok)
    assert update.reuses_head_inputs(models)
    update.prepare(batch, models)
    assert not update.reuses_head_inputs(models)
    metrics = update.step(batch, models, [torch.optim.Adam([p for p in head.parameters() if p.requires_grad])])
    assert float(metrics["throughput/update_positions"]) > 0
