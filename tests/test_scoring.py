"""Scoring with a shared prefix (the rows' common prompt run once) or with packed rows (no padding) gives the plain
forward's log-probs, entropy, hidden states, critic values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from ragen_pl.policy import Models, ValueModel
from ragen_pl.scoring import MIN_SHARED_PREFIX, score, shared_prefix_length


def rows_with_a_common_prompt(vocab: int, B: int = 4, prefix: int = 40, T: int = 70, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    ids[:, :prefix] = ids[0, :prefix]
    attn = torch.ones(B, T, dtype=torch.bool)
    attn[1, 60:], attn[3, 55:] = False, False  # right padding
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, prefix + 5:prefix + 12] = True  # the first answer
    mask[0, 50:58], mask[2, 62:69], mask[3, 48:54] = True, True, True
    return ids, attn & torch.ones_like(attn), mask & attn


def test_shared_prefix_length_stops_before_the_first_scored_logit():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9]])
    mask = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert shared_prefix_length(ids, mask) == 3  # 4 tokens in common, but token 4's logits sit at position 3
    mask[1, 2] = True
    assert shared_prefix_length(ids, mask) == 1
    assert shared_prefix_length(ids[:1], mask[:1]) == 0  # one row shares nothing with anyone


@pytest.mark.parametrize("layout", ["share_prefix", "pack"])
def test_scores_values_and_gradients_equal_the_plain_forward(tiny, layout):
    model, _ = tiny
    model = copy.deepcopy(model).train()
    critic = ValueModel(copy.deepcopy(model.model), model.config.hidden_size)
    torch.nn.init.normal_(critic.head.weight, std=0.1)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    ids, attn, mask = rows_with_a_common_prompt(model.config.vocab_size)
    assert shared_prefix_length(ids, mask) == 40 >= MIN_SHARED_PREFIX  # the common prompt
    results = []
    for on in (False, True):
        for p in [*model.parameters(), *critic.parameters(), *head.parameters()]:
            p.grad = None
        s = score(model, ids, attn, mask, temperature=0.7, entropy=True, hidden=True, **{layout: on})
        if layout == "pack":
            assert s.positions == (int(attn.sum()) if on else attn.numel())  # no position spent on padding
        models = Models(model, critic=critic)
        values = models.critic_values(ids, attn, mask, share_prefix=on and layout == "share_prefix",
                                      pack=on and layout == "pack")
        shared_head = Models(model, value_head=head).shared_values(s.hidden)
        loss = (s.logprobs * mask).sum() + (s.entropy * mask).sum() + (values * mask).sum() + (shared_head * mask).sum()
        loss.backward()
        grads = [p.grad.clone() for p in [*model.parameters(), *critic.parameters(), *head.parameters()]]
        results.append((s.logprobs.detach(), s.entropy.detach(), (values * mask).detach(),
                        (shared_head * mask).detach(), grads))
    (lp0, e0, v0, h0, g0), (lp1, e1, v1, h1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e1, e0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("share", [True, False])
def test_a_gradient_checkpointed_model_never_takes_the_shared_path(tiny, share, monkeypatch):
    import ragen_pl.scoring as scoring

    model, _ = tiny
    model = copy.deepcopy(model).train()
    model.gradient_checkpointing_enable()
    called = []
    monkeypatch.setattr(scoring, "forward_shared", lambda *a, **k: called.append(1))
    ids, attn, mask = rows_with_a_common_prompt(model.config.vocab_size)
    score(model, ids, attn, mask, share_prefix=share)
    assert called == []


def test_restrict_to_kept_keeps_exactly_each_rows_set():
    """Including id 0 next to -1 padding (a scatter of False at the padding's clamped index 0 once overwrote it)."""
    from ragen_pl.scoring import restrict_to_kept

    logits = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    kept = torch.tensor([[3, 0, 5, -1, -1], [-1, -1, -1, -1, -1]])
    out = restrict_to_kept(logits, kept)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 3, 5]
    assert torch.equal(out[1], logits[1])  # no set: the whole vocabulary


def test_token_stats_values_and_gradients_equal_plain_autograd():
    """The chunked autograd function against log_softmax / softmax autograd, in float64, with chunks that do not
    divide the rows, and with -inf logits (a kept set)."""
    from ragen_pl.scoring import token_stats

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, dtype=torch.float64)
    logits[2, 3:6] = float("-inf")
    labels = torch.tensor([0, 5, 1, 10, 4, 4, 2])
    w_lp, w_ent = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    lp, ent = token_stats(a, labels, entropy=True, chunk=3)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    b = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(b, -1)
    p = logp.exp()
    ref_lp = logp.gather(-1, labels[:, None]).squeeze(-1)
    ref_ent = -(p * torch.nan_to_num(logp, neginf=0.0)).sum(-1)  # (a where() here would give NaN gradients)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)


def test_packing_is_refused_for_a_model_that_lets_rows_see_each_other(tiny):
    """A model that ignores position ids' restarts (here: a wrapper that drops them) mixes packed rows: refused in
    one line naming the flag, before any score is computed."""
    from ragen_pl.errors import ConfigError
    from ragen_pl.scoring import check_packing

    model, _ = tiny

    class IgnoresPositions(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, position_ids=None, attention_mask=None, **kwargs):
            return self.inner(**kwargs)

    check_packing(model)  # the real model keeps packed rows apart
    with pytest.raises(ConfigError, match=r"--model.ppo.pack=true: IgnoresPositions lets packed rows attend"):
        check_packing(IgnoresPositions(copy.deepcopy(model)))


def test_pack_and_share_prefix_are_one_or_the_other():
    from ragen_pl.config import PPOConfig

    PPOConfig(pack=True, share_prefix=False)
    with pytest.raises(ValueError, match=r"--model.ppo.pack=true.*choose one \(add --model.ppo.share_prefix=false\)"):
        PPOConfig(pack=True)
