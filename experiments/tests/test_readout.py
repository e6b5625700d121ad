"""The readout hooks (ragen_pl_experiments.readout) in training: the centred, whitened, turn-centred and token
readout heads, the standardised value head, fitted by ReadoutUpdate before the first update."""

import lightning.pytorch as pl
import pytest
import torch
from ragen_pl_experiments.readout import (
    FEATURE_SCALE,
    SHARED_DIRECTIONS,
    ReadoutHead,
    StandardisedHead,
    StandardisedValues,
    project_out,
    shared_directions,
    turn_directions,
)
from ragen_pl_experiments.update import ReadoutUpdate

from ragen_pl.advantages import GAE, GRPO
from ragen_pl.config import LoraSettings, OptimConfig, PPOConfig, RolloutConfig
from ragen_pl.data import RolloutDataModule
from ragen_pl.envs.sokoban import Sokoban
from ragen_pl.filters import NoFilter
from ragen_pl.module import RagenModule
from ragen_pl.policy import policy_state_dict

pytest.importorskip("peft", reason="needs peft (pip install 'ragen-pl[peft]')")
HEAD = LoraSettings(r=4, alpha=8, target_modules=["lm_head"])


def trainer(steps, **kw):
    return pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, **kw)


def readout(path, hook: ReadoutHead, lora: LoraSettings = HEAD, **kw) -> RagenModule:
    return RagenModule(str(path), lora=lora, hooks=[hook, *kw.pop("more_hooks", [])], updater=ReadoutUpdate, **kw)


def test_a_readout_with_a_standardised_value_head_trains_both_heads_alone(tiny_model_path):
    """`--model.critic=shared` with the StandardisedValues hook on a readout (LoRA on the LM head only): the value
    head is fitted at the first update and trains, and the update's steps run no trunk position."""
    module = readout(tiny_model_path, ReadoutHead(center=2, whiten=True), advantage=GAE(lam=0.9), critic="shared",
                     more_hooks=[StandardisedValues()], ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2),
                     optim=OptimConfig(critic_lr=3e-2))
    assert isinstance(module.value_head, StandardisedHead) and not bool(module.value_head.fitted)
    dm = RolloutDataModule(Sokoban(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=8))
    t = trainer(2)
    t.fit(module, dm)
    m = t.callback_metrics
    assert bool(module.value_head.fitted) and float(module.value_head.linear.weight.detach().abs().max()) > 0
    assert torch.isfinite(m["loss/value"]) and float(m["throughput/update_positions"]) == 0


def _record_first_batch(module: RagenModule) -> list:
    """A list that gets the first batch ``module`` prepares: all of its scored positions fix a centred head's
    directions."""
    seen, prepare = [], module.updater.prepare

    def record(batch, models):
        if not seen:
            seen.append(batch)
        return prepare(batch, models)

    module.updater.prepare = record
    return seen


def _scored_states(path, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, H) a plain forward of the base model's trunk at ``batch``'s N scored positions (row-major), and their
    (N,) turns."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        h = AutoModelForCausalLM.from_pretrained(path).eval().model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    target = batch.loss_mask[:, 1:]  # the logits at t - 1 score token t
    return h[:, :-1][target].double(), batch.turn_ids[:, 1:][target]


def _rows(lengths, answer, seed):
    """Right-padded rows of ``lengths`` after a 20-token common prefix, each scoring its last ``answer`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    ids[:, :20] = torch.randint(3, 200, (20,), generator=g)  # the common prefix
    attn = torch.zeros_like(ids, dtype=torch.bool)
    mask = torch.zeros_like(attn)
    for row, n in enumerate(lengths):
        ids[row, 20:n] = torch.randint(3, 200, (n - 20,), generator=g)
        attn[row, :n] = True
        mask[row, n - answer:n] = True
    return ids, attn, mask


def _batch(ids, attn, mask):
    from ragen_pl.types import TrajectoryBatch

    return TrajectoryBatch(input_ids=ids, attention_mask=attn, loss_mask=mask, rewards=torch.zeros(ids.shape),
                           turn_ids=torch.where(mask, 0, -1), group_ids=torch.arange(len(ids)) // 2,
                           env_tags=("Sokoban",) * len(ids))


LAYOUTS = {"padded": dict(share_prefix=False), "shared_prefix": dict(share_prefix=True),
           "packed": dict(share_prefix=False, pack=True)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_centred_head_fits_its_directions_on_the_scored_positions_only(tiny, layout):
    """The centred head's U comes from the hidden states at the positions whose tokens are scored, and from nothing
    else the head reads in the same forward: not a shared prefix's forward (one position, nothing scored), not the
    columns only other rows score, not padding. Rows of different lengths after a 20-token common prefix; the
    reference is a plain forward of the base model's trunk. The reads ReadoutUpdate keeps for the head-only steps
    are those states too, each at its row's scored slots in order."""
    import copy

    from ragen_pl.lora import add_lora
    from ragen_pl.policy import Models

    base, tok = tiny
    policy = ReadoutHead(center=1).after_load(add_lora(copy.deepcopy(base), HEAD), tok).train()
    ids, attn, mask = _rows([27, 31, 24, 29], 3, seed=0)
    update = ReadoutUpdate(GRPO(), PPOConfig(mini_batch_size=4, micro_batch_size=4, **LAYOUTS[layout]))
    models = Models(policy, lora=True)
    batch = _batch(ids, attn, mask)
    update.prepare(batch, models)
    u = getattr(policy.get_base_model().get_output_embeddings().lora_A["default"], SHARED_DIRECTIONS)
    with torch.no_grad():
        h = policy.get_base_model().model(input_ids=ids, attention_mask=attn).last_hidden_state
    scored = h[:, :-1][mask[:, 1:]].double()  # the logits at t - 1 score token t: 12 positions
    assert scored.shape[0] == 12
    values, vectors = torch.linalg.eigh(scored.T @ scored)
    assert values[-1] > 1.5 * values[-2]  # the leading direction is well defined
    torch.testing.assert_close((u @ u.T).double(), vectors[:, -1:] @ vectors[:, -1:].T, atol=2e-3, rtol=0)
    kept_batch, reads = update._prepared  # (B, K, H): each row's 3 scored positions
    assert kept_batch is batch and reads.shape[:2] == (4, 3)
    torch.testing.assert_close(reads.reshape(-1, reads.shape[-1]).double(), scored, atol=1e-4, rtol=1e-4)


def test_centred_head_reads_what_differs_between_inputs(tiny_model_path):
    """``ReadoutHead(center=k)``: the head adapter's k shared directions U are fixed at the first update (the
    leading eigenvectors of the scored hidden states' second moment: orthonormal, and those a plain eigen-decomposition
    of the hidden states the head read gives), the trained adapter ignores U (A U = 0 once folded; the same logits
    before and after folding), and the merged weights an engine gets give the trained policy's logits."""
    hook = ReadoutHead(center=3)
    module = readout(tiny_model_path, hook, advantage=GRPO(), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2),
                     optim=OptimConfig(actor_lr=1e-2))
    dm = RolloutDataModule(Sokoban(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=8), val_episodes=2)
    lora_a = module.policy.get_base_model().get_output_embeddings().lora_A["default"]
    assert not getattr(lora_a, SHARED_DIRECTIONS).any()
    seen = _record_first_batch(module)
    trainer(1).fit(module, dm)
    u = getattr(lora_a, SHARED_DIRECTIONS)
    assert u.shape == (lora_a.in_features, 3)
    torch.testing.assert_close(u.T @ u, torch.eye(3), atol=1e-5, rtol=0)
    h, _ = _scored_states(tiny_model_path, seen[0])  # every row's, not the first micro-batch's (2 of 4 rows)
    assert len(seen[0]) == 4
    values, vectors = torch.linalg.eigh(h.T @ h)
    reference = vectors[:, -3:]  # the 3 largest, up to sign: compare the projectors
    torch.testing.assert_close((u @ u.T).double(), reference @ reference.T, atol=1e-4, rtol=0)
    assert values[-3] > values[-4]  # the 3 leading directions are defined
    assert (lora_a.weight @ u).abs().max() > 1e-3  # not folded yet: the hook projects the input instead
    module.policy.eval()
    ids = module.tokenizer("Turn 1:\nState:\n#_P_#", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        trained = module.policy(input_ids=ids).logits
        trained_a = lora_a.weight.clone()
        with hook.merging(module.policy):
            torch.testing.assert_close((lora_a.weight @ u).abs().max(), torch.tensor(0.0), atol=1e-6, rtol=0)
            torch.testing.assert_close(module.policy(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)
        assert torch.equal(lora_a.weight, trained_a)  # the trained weight is back
        merged = module.policy_state_dict()
        plain = type(module.policy.get_base_model()).from_pretrained(tiny_model_path, tie_word_embeddings=False)
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain.eval()(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)
        unfolded = policy_state_dict(module.policy, lora=True)  # without the hook's fold the merge is not the policy
        plain.load_state_dict(unfolded)
        assert not torch.allclose(plain(input_ids=ids).logits, trained, atol=1e-4)
    base = type(module.policy.get_base_model()).from_pretrained(tiny_model_path).eval()
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, trained)  # the adapter trained
    with pytest.raises(ValueError, match=r"ReadoutHead adapts the output head: it needs `--model.lora.target_modules` "
                                         r"with lm_head"):
        RagenModule(str(tiny_model_path), lora=LoraSettings(r=4, alpha=8), hooks=[ReadoutHead(center=4)])
    with pytest.raises(ValueError, match=r"`--model.hooks.init_args.center` must be an integer >= 0, got True"):
        ReadoutHead(center=True)


def test_whitened_readout_head_moves_only_its_tokens(tiny_model_path):
    """``ReadoutHead(whiten=True, tokens=...)``: the head adapter is a readout of the centred state
    divided by each dimension's root mean square over the first update's scored positions (s, checked against those
    positions by hand), and it moves only the given tokens' logits (lora_B stays one-hot on their rows, every other
    logit is the base model's). The merged weights an engine gets give the trained policy's logits, and the trained
    weight is unchanged afterwards (the fold is undone)."""
    module = readout(tiny_model_path, ReadoutHead(center=2, whiten=True, tokens=["Right", "Up"]),
                     LoraSettings(r=8, alpha=16, target_modules=["lm_head"]), advantage=GRPO(),
                     ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2), optim=OptimConfig(actor_lr=1e-1))
    dm = RolloutDataModule(Sokoban(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=8), val_episodes=2)
    head = module.policy.get_base_model().get_output_embeddings()
    lora_a, lora_b = head.lora_A["default"], head.lora_B["default"]
    ids = [module.tokenizer.encode(t, add_special_tokens=False)[0] for t in ["Right", "Up"]]
    assert lora_a.weight.shape[0] == 2 and not lora_a.weight.any() and not lora_b.weight.requires_grad
    b = lora_b.weight.detach().clone()
    assert b.sum() == 2 and b[ids[0], 0] == 1 and b[ids[1], 1] == 1
    seen = _record_first_batch(module)
    trainer(1).fit(module, dm)
    assert torch.equal(lora_b.weight, b) and lora_a.weight.abs().max() > 1e-3
    u, scale = getattr(lora_a, SHARED_DIRECTIONS).double(), getattr(lora_a, FEATURE_SCALE).double()
    h, _ = _scored_states(tiny_model_path, seen[0])
    centred = h - h @ u @ u.T
    rms = centred.pow(2).mean(0).sqrt()
    torch.testing.assert_close(scale, rms.clamp_min(1e-2 * float(rms.mean())), atol=1e-5, rtol=1e-4)
    module.policy.eval()
    prompt = module.tokenizer("Turn 1:\nState:\n#_P_#", return_tensors="pt")["input_ids"]
    base = type(module.policy.get_base_model()).from_pretrained(tiny_model_path).eval()
    with torch.no_grad():
        trained, plain = module.policy(input_ids=prompt).logits, base(input_ids=prompt).logits
        others = torch.ones(trained.shape[-1], dtype=torch.bool)
        others[ids] = False
        torch.testing.assert_close(trained[..., others], plain[..., others], atol=1e-5, rtol=1e-5)
        assert (trained[..., ids] - plain[..., ids]).abs().max() > 1e-3
        # by hand: the readout of the whitened centred state, added to the two tokens' logits
        last = base.model(input_ids=prompt).last_hidden_state.double()
        x = (last - last @ u @ u.T) / scale
        torch.testing.assert_close(trained[..., ids].double() - plain[..., ids].double(),
                                   x @ lora_a.weight.double().T, atol=1e-4, rtol=1e-4)
        trained_a = lora_a.weight.clone()
        merged = module.policy_state_dict()
        assert torch.equal(lora_a.weight, trained_a)
        engine = type(base).from_pretrained(tiny_model_path, tie_word_embeddings=False)
        engine.load_state_dict(merged)
        torch.testing.assert_close(engine.eval()(input_ids=prompt).logits, trained, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"`--model.hooks.init_args.center_turns` and `whiten` act on the centred "
                                         r"state: they need `center` >= 1, got center 0"):
        ReadoutHead(whiten=True)
    with pytest.raises(ValueError, match=r"`--model.hooks.init_args.tokens` must be a list of distinct non-empty "
                                         r"strings, got \['Up', 'Up'\]"):
        ReadoutHead(tokens=["Up", "Up"])
    with pytest.raises(ValueError, match=r"`--model.hooks.init_args.tokens`: 'Left' is 2 tokens of this model's "
                                         r"tokenizer"):
        RagenModule(str(tiny_model_path), lora=HEAD, hooks=[ReadoutHead(tokens=["Left"])])


def test_turn_directions_by_hand():
    """:func:`ragen_pl_experiments.readout.turn_directions`. Turn 0: (1, 1, 0) and (1, -1, 0); turn 1: (-1, 2, 0) and (-1, -2, 0):
    the turns' means differ along e1 only, although the rows vary most along e2 (the leading direction of their
    second moment); two turns give one direction, so of n = 2 the second column is zero. Unequal counts, turn 0:
    (2, 0, 0) once, turn 1: (0, 0, 1) three times: the mean is (0.5, 0, 0.75), both deviations lie along (2, 0, -1).
    Four turns whose means are e1, e2, e3 and 0 with 1, 2, 3 and 4 rows: the between-turn scatter is
    sum_t N_t (m_t - m)(m_t - m)^T with m = (1, 2, 3) / 10, and its 2 leading eigenvectors are the directions."""
    x = torch.tensor([[1.0, 1, 0], [1, -1, 0], [-1, 2, 0], [-1, -2, 0]])
    d = turn_directions(x, torch.tensor([0, 0, 1, 1]), 2)
    torch.testing.assert_close(d[:, 0].abs(), torch.tensor([1.0, 0, 0], dtype=torch.float64))
    assert not d[:, 1].any()
    d = turn_directions(torch.tensor([[2.0, 0, 0], [0, 0, 1], [0, 0, 1], [0, 0, 1]]), torch.tensor([0, 1, 1, 1]), 1)
    torch.testing.assert_close(d[:, 0].abs(), torch.tensor([2.0, 0, 1], dtype=torch.float64) / 5 ** 0.5)
    counts = [1, 2, 3, 4]
    means = torch.cat([torch.eye(3), torch.zeros(1, 3)]).double()
    x = torch.cat([means[t].expand(n, 3) for t, n in enumerate(counts)])
    turns = torch.cat([torch.full((n,), t) for t, n in enumerate(counts)])
    m = torch.tensor([1.0, 2, 3], dtype=torch.float64) / 10
    scatter = sum(n * torch.outer(means[t] - m, means[t] - m) for t, n in enumerate(counts))
    _, vectors = torch.linalg.eigh(scatter)
    d = turn_directions(x, turns, 2)
    torch.testing.assert_close(d.T @ d, torch.eye(2, dtype=torch.float64), atol=1e-10, rtol=0)
    torch.testing.assert_close(d @ d.T, vectors[:, -2:] @ vectors[:, -2:].T, atol=1e-10, rtol=0)


def test_turn_centred_head_leaves_out_the_turns_means(tiny_model_path):
    """``ReadoutHead(center=2, center_turns=2)``: at the first update U is the 2 leading directions of the
    scored positions' second moment, then the 2 leading directions of the scatter of their turns' means once those are
    left out (:func:`turn_directions` on what the head read, grouped by the batch's turn_ids: 3 turns, one row each in
    a window of 1), all orthonormal; the trained adapter reads nothing along them (A U = 0 once folded) and the
    merged weights give the trained policy's logits. Without `center` the setting is refused in one line."""
    hook = ReadoutHead(center=2, center_turns=2)
    module = readout(tiny_model_path, hook, advantage=GRPO(), ppo=PPOConfig(mini_batch_size=12, micro_batch_size=4),
                     optim=OptimConfig(actor_lr=1e-2))
    dm = RolloutDataModule(Sokoban(), n_groups=2, group_size=2, filter=NoFilter(), val_episodes=2,
                           rollout=RolloutConfig(max_turns=3, max_new_tokens=6, context_window=1))
    lora_a = module.policy.get_base_model().get_output_embeddings().lora_A["default"]
    seen = _record_first_batch(module)
    trainer(1).fit(module, dm)
    u = getattr(lora_a, SHARED_DIRECTIONS).double()
    h, turns = _scored_states(tiny_model_path, seen[0])  # all 12 turn rows, not a micro-batch's 4
    assert u.shape == (lora_a.in_features, 4) and len(seen[0]) == 12 and sorted(set(turns.tolist())) == [0, 1, 2]
    torch.testing.assert_close(u.T @ u, torch.eye(4, dtype=torch.float64), atol=1e-5, rtol=0)
    lead = shared_directions(h, 2)
    torch.testing.assert_close(u[:, :2] @ u[:, :2].T, lead @ lead.T, atol=1e-4, rtol=0)
    by_turn = turn_directions(project_out(h, lead), turns, 2)
    torch.testing.assert_close(u[:, 2:] @ u[:, 2:].T, by_turn @ by_turn.T, atol=1e-4, rtol=0)
    means = torch.stack([h[turns == t].mean(0) for t in range(3)])
    assert (means[1:] - means[0]).norm() > 10 * project_out(means[1:] - means[0], u).norm()  # left out
    module.policy.eval()
    ids = module.tokenizer("Turn 2:\nState:\n#_P_#", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        trained = module.policy(input_ids=ids).logits
        with hook.merging(module.policy):
            assert (lora_a.weight.double() @ u).abs().max() < 1e-5
        merged = module.policy_state_dict()
        plain = type(module.policy.get_base_model()).from_pretrained(tiny_model_path, tie_word_embeddings=False)
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain.eval()(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"`--model.hooks.init_args.center_turns` and `whiten` act on the centred "
                                         r"state: they need `center` >= 1, got center 0"):
        ReadoutHead(center_turns=2)
    with pytest.raises(ValueError, match=r"`--model.hooks.init_args.center_turns` must be an integer >= 0, got -1"):
        ReadoutHead(center=1, center_turns=-1)
