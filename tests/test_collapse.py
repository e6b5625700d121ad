"""RAGEN-2's collapse metrics: a hand-computed example, the cross log-prob matrix and the information quantities
against brute-force enumeration on a model with a 5-token vocabulary, the (X, Z) split, and a run that logs them."""

from __future__ import annotations

import math

import pytest
import torch

from ragen_pl.collapse import CollapseConfig, cross_logprobs, information, sample_pairs


def test_information_hand_computed():
    # Two contexts, two samples each. Per-sequence log-probs L[i, j] = log p(z_i | x_j):
    #   z_0, z_1 from x_0: log p = (log .5, log .1), (log .5, log .1)
    #   z_2, z_3 from x_1: (log .1, log .4), (log .1, log .4)
    L = torch.log(torch.tensor([[0.5, 0.1], [0.5, 0.1], [0.1, 0.4], [0.1, 0.4]]))
    cols = torch.tensor([0, 0, 1, 1])
    m = information(L, torch.ones(4), cols)
    # matched: log .5 (x2), log .4 (x2); H(Z|X) = -(2 log .5 + 2 log .4) / 4
    h_cond = -(2 * math.log(0.5) + 2 * math.log(0.4)) / 4
    # p_mix: (.5 + .1) / 2 = .3 for z_0, z_1; (.1 + .4) / 2 = .25 for z_2, z_3
    h_marg = -(2 * math.log(0.3) + 2 * math.log(0.25)) / 4
    assert m["conditional_entropy_seq"] == pytest.approx(h_cond)
    assert m["reasoning_entropy_seq"] == pytest.approx(h_marg)
    assert m["mi_seq"] == pytest.approx(h_marg - h_cond)
    assert m["mi_upper_bound"] == pytest.approx(math.log(2))
    assert m["retrieval_accuracy"] == 1.0 and m["retrieval_chance_level"] == 0.5
    # Per token with lengths 2: every entry halves.
    t = information(L, torch.full((4,), 2), cols)
    assert t["conditional_entropy"] == pytest.approx(h_cond / 2)
    # Z that ignores X: identical rows -> I = 0, retrieval at chance (ties go to the first column).
    flat = information(torch.log(torch.full((4, 2), 0.3)), torch.ones(4), cols)
    assert flat["mi_seq"] == pytest.approx(0.0, abs=1e-12) and flat["retrieval_accuracy"] == 0.5


@pytest.fixture(scope="module")
def five_token_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).eval()


def _brute_logp(model, x, z, temperature=1.0):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([x + z])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return sum(float(lp[len(x) - 1 + t, z[t]]) for t in range(len(z)))


def test_cross_logprobs_and_information_equal_brute_force_enumeration(five_token_model):
    model = five_token_model
    contexts = [[1, 2, 3], [4, 0], [2, 2, 1, 0]]
    every_z = [[a, b] for a in range(5) for b in range(5)]  # all 25 reasonings of length 2
    cross = cross_logprobs(model, contexts, every_z, pad_id=0, temperature=0.7)
    brute = torch.tensor([[_brute_logp(model, x, z, 0.7) for x in contexts] for z in every_z], dtype=torch.float64)
    torch.testing.assert_close(cross, brute, atol=1e-5, rtol=1e-5)
    # Exact quantities under X uniform over the 3 contexts, Z ~ p(z|x) over the 25 sequences (which sum to 1).
    N = len(contexts)
    p = brute.exp()  # (25, N): p(z | x_j)
    assert torch.allclose(p.sum(0), torch.ones(N, dtype=torch.float64))
    p_mix = p.mean(1)
    h_cond = -sum(p[i, j] * math.log(p[i, j]) for i in range(25) for j in range(N)) / N
    h_marg = -sum(p_mix[i] * math.log(p_mix[i]) for i in range(25))
    # The estimator over every (z, x) pair weighted by p(z | x) / N is the exact expectation.
    rows = torch.arange(25).repeat(N)
    cols = torch.arange(N).repeat_interleave(25)
    weights = p[rows, cols] / N
    exact = information(brute[rows], torch.full((25 * N,), 2), cols, weights=weights)
    assert exact["conditional_entropy_seq"] == pytest.approx(float(h_cond), rel=1e-6)
    assert exact["reasoning_entropy_seq"] == pytest.approx(float(h_marg), rel=1e-6)
    assert exact["mi_seq"] == pytest.approx(float(h_marg - h_cond), rel=1e-6)
    # And the plain Monte-Carlo estimate from sampled z converges to it.
    g = torch.Generator().manual_seed(0)
    draws = [torch.multinomial(p[:, j].float(), 3000, replacement=True, generator=g) for j in range(N)]
    idx = torch.cat(draws)
    mc = information(brute[idx], torch.full((len(idx),), 2), torch.arange(N).repeat_interleave(3000))
    assert mc["mi_seq"] == pytest.approx(float(h_marg - h_cond), abs=0.02)
    assert mc["conditional_entropy_seq"] == pytest.approx(float(h_cond), abs=0.05)


def test_z_is_the_text_between_the_tags_excluded(tiny):
    """Think mode: Z is the thinking, without <think> (in X) and without </think>; answer-only: the answer."""
    from ragen_pl.config import RolloutConfig
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from tests.rollout.test_collector import Scripted

    _, tok = tiny
    for think, text, want in ((True, "I go Up</think><answer>Up</answer>", "I go Up"),
                              (False, "Left || Up</answer>", "Left || Up")):
        engine = Scripted(tok, lambda turn, _, text=text: text)
        batch = Collector(engine, tok, RolloutConfig(max_turns=2, think=think, max_seq_len=4096)).collect(
            [EpisodeSpec(Sokoban(), seed=s, group_id=s) for s in range(3)]).batch
        pairs = sample_pairs(batch, tok, CollapseConfig(samples=3), torch.Generator().manual_seed(0))
        assert len(pairs) == 3
        for pair in pairs:
            assert tok.decode(pair.reasoning).strip() == want
            assert tok.decode(pair.context).endswith("<think>" if think else "<answer>")


def test_a_run_logs_the_collapse_metrics_and_their_cost(tiny_model_path):
    import lightning.pytorch as pl

    from ragen_pl.advantages import GRPO
    from ragen_pl.config import OptimConfig, PPOConfig, RolloutConfig
    from ragen_pl.data import RolloutDataModule
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.filters import NoFilter
    from ragen_pl.module import RagenModule

    module = RagenModule(str(tiny_model_path), advantage=GRPO(), ppo=PPOConfig(mini_batch_size=8, micro_batch_size=4),
                         optim=OptimConfig(actor_lr=1e-3), collapse=CollapseConfig(samples=6))
    dm = RolloutDataModule(Sokoban(), n_groups=4, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=8))
    t = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=0, accelerator="cpu")
    t.fit(module, dm)
    m = t.callback_metrics
    for key in ("collapse/mi", "collapse/mi_seq", "collapse/conditional_entropy", "collapse/reasoning_entropy",
                "collapse/retrieval_accuracy", "collapse/mi_upper_bound", "time/collapse"):
        assert key in m and torch.isfinite(m[key]), key
    assert float(m["collapse/mi_upper_bound"]) == pytest.approx(math.log(4))  # 4 groups: 4 distinct first prompts
    assert float(m["collapse/mi"]) <= float(m["collapse/mi_upper_bound"]) + 1e-6


def test_collapse_settings_are_checked():
    with pytest.raises(ValueError, match=r"`--model.collapse.samples` must be an integer >= 2, got 1"):
        CollapseConfig(samples=1)
    with pytest.raises(ValueError, match=r"`--model.collapse.turns` must be one of first, trajectory, got 'all'"):
        CollapseConfig(turns="all")


def test_metrics_computed_every_n_steps_are_logged_at_those_steps_only(tiny_model_path, tmp_path):
    """Lightning's log_dict writes a key's last value again at every later step of the epoch; collapse metrics go
    straight to the loggers, so the CSV has them at steps 0 and 2 of 3, not stale copies at step 1."""
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from ragen_pl.advantages import GRPO
    from ragen_pl.config import OptimConfig, PPOConfig, RolloutConfig
    from ragen_pl.data import RolloutDataModule
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.filters import NoFilter
    from ragen_pl.module import RagenModule

    module = RagenModule(str(tiny_model_path), advantage=GRPO(), ppo=PPOConfig(mini_batch_size=8, micro_batch_size=4),
                         optim=OptimConfig(actor_lr=1e-3), collapse=CollapseConfig(samples=4, every_n_steps=2))
    dm = RolloutDataModule(Sokoban(), n_groups=4, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=6))
    logger = CSVLogger(tmp_path, name="run")
    pl.Trainer(max_steps=3, logger=logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, limit_val_batches=0, accelerator="cpu").fit(module, dm)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    steps = sorted(int(r["step"]) for r in rows if r.get("collapse/mi"))
    assert steps == [0, 2]
    assert sorted({int(r["step"]) for r in rows if r.get("loss/policy")}) == [0, 1, 2]


def test_several_envs_get_their_own_metrics(tiny):
    from ragen_pl.collapse import collapse_metrics
    from ragen_pl.config import RolloutConfig
    from ragen_pl.envs.bandit import Bandit
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine

    model, tok = tiny
    engine = HFEngine(seed=0)
    engine.bind(model, tok)
    specs = [EpisodeSpec(env, seed=s, group_id=s) for s in range(4) for env in (Bandit(), Sokoban())]
    batch = Collector(engine, tok, RolloutConfig(max_turns=1, max_new_tokens=6)).collect(specs).batch
    m = collapse_metrics(model, tok, batch, CollapseConfig(samples=4), torch.Generator().manual_seed(0))
    for prefix in ("collapse", "collapse/Bandit", "collapse/Sokoban"):
        assert f"{prefix}/mi" in m and m[f"{prefix}/num_contexts"] >= 2, prefix
    assert m["collapse/Bandit/num_pairs"] == 4  # `samples` pairs per env
