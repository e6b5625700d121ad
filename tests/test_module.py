import lightning.pytorch as pl
import pytest
import torch

from ragen_pl.advantages import GAE, GRPO, RLOO, BiLevelGAE, ReinforcePP
from ragen_pl.config import OptimConfig, PPOConfig, RolloutConfig
from ragen_pl.data import RolloutDataModule
from ragen_pl.envs.bandit import Bandit
from ragen_pl.envs.sokoban import Sokoban
from ragen_pl.filters import NoFilter
from ragen_pl.module import RagenModule
from ragen_pl.update import entropy_metrics, micro_batches


def make(model_path, advantage=None, ppo=None, env=None, **data):
    module = RagenModule(str(model_path), advantage=advantage or GAE(),
                         ppo=ppo or PPOConfig(mini_batch_size=4, micro_batch_size=2),
                         optim=OptimConfig(actor_lr=1e-3, critic_lr=1e-3))
    dm = RolloutDataModule(env or Sokoban(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=8), val_episodes=2, **data)
    return module, dm


def trainer(steps, **kw):
    return pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, **kw)


@pytest.mark.parametrize("advantage", [GAE(), GRPO(), BiLevelGAE(), RLOO(), ReinforcePP()],
                         ids=["gae", "grpo", "bilevel_gae", "rloo", "reinforce_pp"])
def test_two_steps_change_every_trainable_parameter(tiny_model_path, advantage):
    module, dm = make(tiny_model_path, advantage=advantage)
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    t = trainer(2)
    t.fit(module, dm)
    assert t.global_step == 2  # one step per StarPO iteration
    assert dm.iteration == 2
    m = t.callback_metrics
    for key in ("loss/policy", "loss/entropy", "actor/grad_norm", "rollout/success", "filter/kept_frac"):
        assert torch.isfinite(m[key]), key
    # The iteration's wall time covers its parts: rollout (generation, env, tokenisation), filter, prepare, update.
    parts = sum(float(v) for k, v in m.items() if k.startswith("time/") and k != "time/iteration")
    assert parts <= float(m["time/iteration"]) < parts + 5.0
    unchanged = [n for n, p in module.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert not unchanged, f"parameters that did not change: {unchanged[:5]}"
    if not type(advantage).needs_critic:
        assert module.critic is None and "loss/value" not in m
    else:
        assert module.critic is not None and torch.isfinite(m["loss/value"])


def test_reference_model_only_with_kl(tiny_model_path):
    assert RagenModule(str(tiny_model_path)).reference is None
    m = RagenModule(str(tiny_model_path), ppo=PPOConfig(kl_coeff=0.001))
    assert m.reference is not None and not any(p.requires_grad for p in m.reference.parameters())


def test_micro_batches_add_up_to_the_mini_batch(tiny_model_path):
    """Gradient accumulation over micro-batches equals one pass over the whole mini-batch."""
    grads = []
    for micro in (4, 1):
        module, dm = make(tiny_model_path, ppo=PPOConfig(mini_batch_size=4, micro_batch_size=micro))
        t = trainer(0)
        t.fit(module, dm)  # attaches trainer, runs setup
        dm.setup("fit")
        torch.manual_seed(0)
        rollout = dm.play_training_rollout()
        batch = rollout.batch
        module.prepare(batch)
        count = module.updater.loss_denominator(batch.loss_mask)
        module.zero_grad()
        for idx in torch.arange(len(batch)).split(micro):
            loss = module.updater.micro_loss(batch.select(idx), module.models, count)
            (loss.actor + loss.critic).backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_non_finite_gradient_skips_the_step(tiny_model_path, monkeypatch):
    module, dm = make(tiny_model_path, env=Bandit())
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    original = module.updater.micro_loss

    def poisoned(part, models, count, rows=None):
        loss = original(part, models, count, rows)
        return loss._replace(actor=loss.actor * float("nan"))

    monkeypatch.setattr(module.updater, "micro_loss", poisoned)
    t = trainer(1)
    t.fit(module, dm)
    assert module.skipped_steps >= 1
    assert float(t.callback_metrics["train/optimizer_steps"]) == 0
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"micro_batch_size": 8, "mini_batch_size": 4}, r"`--model.ppo.micro_batch_size` \(8\) must be <= "),
        ({"clip_low": 1.5}, r"`--model.ppo.clip_low` must be in \[0, 1\)"),
        ({"kl_mode": "penalty"}, r"`--model.ppo.kl_mode` must be one of loss, reward, got 'penalty'"),
        ({"ppo_epochs": 0}, r"`--model.ppo.ppo_epochs` must be an integer >= 1, got 0"),
    ],
)
def test_ppo_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)


def test_data_config_errors(tiny_model_path):
    with pytest.raises(ValueError, match=r"`--data.group_size` must be an integer >= 1, got 0"):
        RolloutDataModule(Bandit(), group_size=0)
    with pytest.raises(ValueError, match=r"`--data.val_envs` must have distinct tags"):
        RolloutDataModule(Bandit(), val_envs=[Sokoban(), Sokoban()])


def test_grpo_needs_groups_of_two(tiny_model_path):
    module = RagenModule(str(tiny_model_path), advantage=GRPO())
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=1, filter=NoFilter())  # (a variance filter refuses it)
    with pytest.raises(ValueError, match=r"`--data.group_size` must be >= 2 for GRPO, got 1"):
        trainer(1).fit(module, dm)


def test_explained_variance():
    from ragen_pl.update import explained_variance

    r = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[True, True, True, False]])
    assert float(explained_variance(r, r, mask)) == 1.0  # perfect critic
    assert float(explained_variance(torch.zeros_like(r) + 2, r, mask)) == 0.0  # predicts the mean
    # values [1, 1, 1]: residuals [0, 1, 2], var 1; returns var 1 -> 0
    assert float(explained_variance(torch.ones_like(r), r, mask)) == pytest.approx(0.0)


def test_reused_rollout_keeps_the_behaviour_policy(tiny_model_path):
    """With rollout_every_n_steps=2 the second step trains on the same trajectories against the log-probs of the
    policy that sampled them: the ratio is no longer 1, so the approximate KL is positive."""
    module, dm = make(tiny_model_path, ppo=PPOConfig(mini_batch_size=8, micro_batch_size=4), rollout_every_n_steps=2)
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(trainer.callback_metrics["loss/approx_kl"]))

    t = trainer(2, callbacks=[Spy()])
    t.fit(module, dm)
    assert dm.iteration == 1  # one rollout for two steps
    assert seen[0] == 0.0 and seen[1] > 0.0


def test_shared_critic_with_gradient_checkpointing_and_kl_reward(tiny_model_path):
    module = RagenModule(str(tiny_model_path), critic="shared", gradient_checkpointing=True,
                         ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2, kl_coeff=0.01, kl_mode="reward"),
                         optim=OptimConfig(actor_lr=1e-3, critic_lr=3e-2))
    assert module.critic is None and module.value_head is not None and module.reference is not None
    dm = RolloutDataModule(Sokoban(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=8))
    head = module.value_head.weight.detach().clone()
    t = trainer(1)
    t.fit(module, dm)
    m = t.callback_metrics
    assert torch.isfinite(m["loss/value"]) and torch.isfinite(m["loss/kl_reward"]) and "loss/kl" not in m
    assert not torch.equal(module.value_head.weight, head)  # the value head trains with the policy's optimiser
    (opt,) = t.optimizers  # ... in its own parameter group, at critic_lr
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 3e-2]
    assert opt.param_groups[1]["params"] == list(module.value_head.parameters())


@pytest.mark.parametrize("advantage", [GAE(), GRPO()], ids=["gae", "grpo"])
def test_training_with_a_context_window(tiny_model_path, advantage):
    """Turns as rows: filtering keeps whole trajectories, reward normalisation counts each trajectory once."""
    from ragen_pl.filters import VarianceTopP
    from ragen_pl.rewards import RewardNorm

    module = RagenModule(str(tiny_model_path), advantage=advantage, reward_norm=RewardNorm(method="mean_std"),
                         ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2), optim=OptimConfig(actor_lr=1e-3))
    dm = RolloutDataModule(Sokoban(), n_groups=4, group_size=2, filter=VarianceTopP(top_p=0.5),
                           rollout=RolloutConfig(max_turns=3, max_new_tokens=6, context_window=1))
    t = trainer(2)
    t.fit(module, dm)
    assert torch.isfinite(t.callback_metrics["loss/policy"])
    batch = dm._last.batch
    assert batch.traj_ids is not None
    inverse, first = batch.trajectory_index()
    assert len(batch) > len(first)  # several rows per trajectory
    # Whole trajectories were kept: each kept trajectory's rows are its turns 0, 1, ... in order, none missing.
    for j in range(len(first)):
        row_turns = [int(batch.turn_ids[b].max()) for b in (inverse == j).nonzero().flatten().tolist()]
        assert row_turns == list(range(len(row_turns)))
    # The normalised score sits on each trajectory's last row only.
    last_rows = {int(r) for r in torch.tensor([int((inverse == j).nonzero().max()) for j in range(len(first))])}
    for b in range(len(batch)):
        if b not in last_rows:
            assert float(batch.rewards[b].abs().sum()) == 0.0


def test_bf16_mixed_later_mini_batches_see_the_updated_weights(tiny_model_path, monkeypatch):
    """All of training_step runs inside one autocast region. A caching autocast (torch's default) would keep the
    bf16 copy of each weight from the first forward, and every later mini-batch of the iteration would run with the
    weights of its start (PPO ratio exactly 1, clipping never engaged). Lightning's bf16-mixed turns the cache off;
    this guards that the update keeps seeing its own steps."""
    import ragen_pl.losses as losses_py

    seen = []
    real = losses_py.policy_loss

    def recording(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        seen.append(float((logprobs - old_logprobs)[mask].abs().max()))
        return real(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(losses_py, "policy_loss", recording)
    module = RagenModule(str(tiny_model_path), advantage=GRPO(scale="none"),
                         ppo=PPOConfig(mini_batch_size=2, micro_batch_size=2, entropy_coeff=0.01),
                         optim=OptimConfig(actor_lr=1e-2))
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=6))
    trainer(1, precision="bf16-mixed", accelerator="cpu").fit(module, dm)
    assert len(seen) == 2  # two mini-batches of one micro-batch
    assert seen[1] > 0  # the second mini-batch is scored with the weights after the first step


def test_score_runs_the_lm_head_only_where_tokens_are_scored(tiny_model_path):
    """Log-probs and entropy from the trimmed LM head equal a plain full-logits reference, token by token."""
    module = RagenModule(str(tiny_model_path))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, module.policy.config.vocab_size, (3, 12), generator=g)
    attn = torch.ones_like(ids, dtype=torch.bool)
    attn[2, 9:] = False  # a shorter row (right padding)
    mask = torch.zeros_like(attn)
    mask[0, 5:8], mask[0, 10] = True, True  # two turns
    mask[1, 11] = True
    mask[2, 3:9] = True
    from ragen_pl.scoring import score

    with torch.no_grad():
        s = score(module.policy, ids, attn, mask, entropy=True)
        logits = module.policy(input_ids=ids, attention_mask=attn).logits.float()
    ref_lp = torch.zeros(3, 12)
    ref_ent = torch.zeros(3, 12)
    for b in range(3):
        for t in range(1, 12):
            if mask[b, t]:
                logp = torch.log_softmax(logits[b, t - 1], -1)
                ref_lp[b, t] = logp[ids[b, t]]
                ref_ent[b, t] = -(logp.exp() * logp).sum()
    torch.testing.assert_close(s.logprobs, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.entropy, ref_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("advantage", [GRPO(), GAE()], ids=["grpo", "gae_separate_critic"])
def test_one_step_update_scores_the_old_policy_itself(tiny_model_path, monkeypatch, advantage):
    """With one optimiser step per iteration, skipping prepare's policy pass changes nothing: same old log-probs,
    same weights after the update as with the pass."""
    results = []
    for skip in (True, False):
        module, dm = make(tiny_model_path, advantage=advantage, env=Bandit(),
                          ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2))
        t = trainer(0)
        t.fit(module, dm)  # attaches the trainer, runs setup
        dm.setup("fit")
        torch.manual_seed(0)
        batch = dm.play_training_rollout().batch
        assert module.updater.scores_old_policy_in_update(module.models, len(batch))
        if not skip:
            monkeypatch.setattr(module.updater, "scores_old_policy_in_update", lambda models, n: False)
        module.prepare(batch)
        assert (batch.old_logprobs is None) == skip
        metrics = module.update(batch)
        assert float(metrics["train/optimizer_steps"]) == 1
        results.append((batch.old_logprobs.clone(), {n: p.detach().clone() for n, p in module.named_parameters()},
                        entropy_metrics(batch)))
        monkeypatch.undo()
    (lp_a, w_a, e_a), (lp_b, w_b, e_b) = results
    torch.testing.assert_close(lp_a, lp_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e_a, e_b, atol=1e-5, rtol=1e-5)
    for n in w_a:
        torch.testing.assert_close(w_a[n], w_b[n], atol=1e-6, rtol=1e-5, msg=n)


def test_several_optimiser_steps_score_the_old_policy_first(tiny_model_path):
    def scores_itself(module, n):
        return module.updater.scores_old_policy_in_update(module.models, n)

    module, _ = make(tiny_model_path, advantage=GRPO(), ppo=PPOConfig(mini_batch_size=2, micro_batch_size=2))
    assert not scores_itself(module, 4)  # two mini-batches: the second sees updated weights
    assert scores_itself(module, 2)
    epochs, _ = make(tiny_model_path, advantage=GRPO(), ppo=PPOConfig(ppo_epochs=2))
    assert not scores_itself(epochs, 4)
    shared = RagenModule(str(tiny_model_path), critic="shared", ppo=PPOConfig(mini_batch_size=4))
    assert not scores_itself(shared, 4)  # the shared head's values come from that forward
    kl_reward = RagenModule(str(tiny_model_path), advantage=GRPO(), ppo=PPOConfig(kl_coeff=0.1, kl_mode="reward"))
    assert not scores_itself(kl_reward, 4)


def test_micro_batches_group_rows_by_length():
    # Right-padded rows of lengths 2, 7, 3, 6, 5, 1: micro-batches of 2 pair them longest first.
    lengths = [2, 7, 3, 6, 5, 1]
    mask = torch.arange(8)[None, :] < torch.tensor(lengths)[:, None]
    parts = micro_batches(torch.arange(6), mask, 2)
    assert [p.tolist() for p in parts] == [[1, 3], [4, 2], [0, 5]]
    # Each is cut to its own longest row: 7 + 7, 5 + 5, 2 + 2 = 28 columns instead of 7+7, 6+6, 5+5 = 36 in order.
    assert sum(len(p) * int(mask[p].sum(-1).max()) for p in parts) == 28
    rows = torch.tensor([5, 0, 3])  # a mini-batch: only its rows, still grouped by length
    assert [p.tolist() for p in micro_batches(rows, mask, 2)] == [[3, 0], [5]]


def test_update_is_the_same_for_any_micro_batch_size(tiny_model_path):
    """Length-grouped micro-batches accumulate to the whole mini-batch's gradient: one update's gradients (left on
    the parameters) equal those of a single micro-batch, for the actor and a separate critic. (Gradients, not the
    weights: Adam's first step is about lr * sign(gradient), which float noise flips where a gradient is ~0.)"""
    grads = []
    for micro in (1, 2, 4):
        module, dm = make(tiny_model_path, ppo=PPOConfig(mini_batch_size=4, micro_batch_size=micro))
        t = trainer(0)
        t.fit(module, dm)
        dm.setup("fit")
        torch.manual_seed(0)
        batch = dm.play_training_rollout().batch
        assert len(set(batch.attention_mask.sum(-1).tolist())) > 1  # rows of different lengths
        module.prepare(batch)
        assert float(module.update(batch)["train/optimizer_steps"]) == 1  # one mini-batch: its gradients remain
        grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad})
    assert any(n.startswith("critic.") for n in grads[0])
    for other in grads[1:]:
        for n in grads[0]:
            torch.testing.assert_close(other[n], grads[0][n], atol=1e-6, rtol=1e-4, msg=n)


def test_an_empty_filter_skips_the_update_and_stops_after_empty_stop_steps(tiny_model_path):
    """RAGEN-2: an iteration whose filter keeps nothing trains nothing (no optimiser step, no weight change), and
    ``empty_stop_steps`` of them in a row end the run."""
    from ragen_pl.filters import SNR

    module, dm = make(tiny_model_path, env=Bandit())
    dm.filter = SNR(empty_stop_steps=2)
    dm.filter.select = lambda stats: torch.zeros(stats.group_ids.unique().numel(), dtype=torch.bool)  # keeps none
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    t = trainer(10)
    t.fit(module, dm)
    assert t.global_step == 2 and dm.iteration == 2  # stopped after two empty iterations, not ten
    m = t.callback_metrics
    assert float(m["filter/kept_frac"]) == 0.0 and float(m["train/optimizer_steps"]) == 0.0
    assert float(m["filter/empty_in_a_row"]) == 2.0
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n]), n


def test_lora_on_the_last_layers_trains_them_and_stops_backward_there(tiny_model_path):
    """`--model.lora.last_layers=1`: adapters in the last decoder layer only, every one of them trained; the layers
    below run without autograd (their outputs need no grad), so backward never enters them."""
    pytest.importorskip("peft", reason="needs peft (pip install 'ragen-pl[peft]')")
    from ragen_pl.config import LoraSettings

    module = RagenModule(str(tiny_model_path), advantage=GRPO(), lora=LoraSettings(r=4, alpha=8, last_layers=1),
                         ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2), optim=OptimConfig(actor_lr=1e-2))
    dm = RolloutDataModule(Sokoban(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=8), val_episodes=2)
    layers = module.policy.get_base_model().model.layers
    trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    assert trained and all(f"layers.{len(layers) - 1}." in n and "lora_" in n for n in trained)
    needs_grad = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: needs_grad.setdefault(i, set()).add(
        (out[0] if isinstance(out, tuple) else out).requires_grad)) for i, layer in enumerate(layers)]
    try:
        trainer(1).fit(module, dm)
    finally:
        for h in hooks:
            h.remove()
    assert needs_grad[len(layers) - 1] == {True, False}  # the update's forward (rollouts run without grad)
    assert all(needs_grad[i] == {False} for i in range(len(layers) - 1))
    unchanged = [n for n, p in module.named_parameters() if p.requires_grad and torch.equal(p, trained[n])]
    assert not unchanged, unchanged[:3]
    with pytest.raises(ValueError, match=r"`--model.lora.last_layers` must be at most the model's \d+ layers, got 99"):
        RagenModule(str(tiny_model_path), lora=LoraSettings(last_layers=99))


def test_lora_on_the_lm_head_reads_the_last_hidden_state_and_leaves_the_embeddings(tiny_model_path):
    """`--model.lora.target_modules=[lm_head]`: an adapter on the output head only (a readout of the last hidden
    state). The tiny model ties head and input embeddings; the head gets its own copy first, so training and
    merging the adapter never touch the embeddings, no decoder layer needs grad, and the merged weights (what vLLM
    and an export get) are the head plus B A scaled."""
    pytest.importorskip("peft", reason="needs peft (pip install 'ragen-pl[peft]')")
    from ragen_pl.config import LoraSettings
    from ragen_pl.policy import policy_state_dict

    module = RagenModule(str(tiny_model_path), advantage=GRPO(),
                         lora=LoraSettings(r=4, alpha=8, target_modules=["lm_head"]),
                         ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2), optim=OptimConfig(actor_lr=1e-2))
    dm = RolloutDataModule(Sokoban(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=8), val_episodes=2)
    base = module.policy.get_base_model()
    embed, head = base.get_input_embeddings().weight, base.get_output_embeddings().base_layer.weight
    assert embed is not head and torch.equal(embed, head) and not base.config.tie_word_embeddings
    embed_before = embed.detach().clone()
    trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    assert sorted(n.split("lm_head.")[1] for n in trained) == ["lora_A.default.weight", "lora_B.default.weight"]
    needs_grad = set()
    hook = base.model.layers[-1].register_forward_hook(
        lambda m, a, out: needs_grad.add((out[0] if isinstance(out, tuple) else out).requires_grad))
    try:
        trainer(1).fit(module, dm)
    finally:
        hook.remove()
    assert needs_grad == {False}  # backward starts and ends in the head
    assert all(not torch.equal(p, trained[n]) for n, p in module.named_parameters() if p.requires_grad)
    assert torch.equal(embed, embed_before)
    lora_head = base.get_output_embeddings()
    delta = lora_head.lora_B["default"].weight @ lora_head.lora_A["default"].weight * lora_head.scaling["default"]
    merged = policy_state_dict(module.policy, lora=True)
    torch.testing.assert_close(merged["lm_head.weight"], head + delta)
    torch.testing.assert_close(merged["model.embed_tokens.weight"], embed_before)


def test_cosine_schedule_sets_each_iterations_rate(tiny_model_path):
    """`--model.optim.schedule=cosine`: after the linear warmup the actor's rate follows a half cosine down to
    `min_lr_ratio` of it at `--trainer.max_steps` (logged as `train/actor_lr`, the rate of that iteration's update);
    a cosine without max_steps and an unknown schedule are refused in one line."""
    rates = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            rates.append(float(trainer.callback_metrics["train/actor_lr"]))

    optim = OptimConfig(actor_lr=1e-2, warmup_steps=1, schedule="cosine", min_lr_ratio=0.2)
    module = RagenModule(str(tiny_model_path), advantage=GRPO(), optim=optim,
                         ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2))
    dm = RolloutDataModule(Sokoban(), n_groups=2, group_size=2, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=4))
    trainer(4, callbacks=[Record()]).fit(module, dm)
    # By hand: warmup (0 + 1) / (1 + 1); then progress 0, 1/3, 2/3 of the 3 iterations after it:
    # 0.2 + 0.8 (1 + cos(pi p)) / 2 = 1, 0.2 + 0.8 * 0.75, 0.2 + 0.8 * 0.25.
    assert rates == pytest.approx([1e-2 * f for f in (0.5, 1.0, 0.8, 0.4)], rel=1e-6)
    with pytest.raises(ValueError, match=r"`--model.optim.schedule=cosine` decays over `--trainer.max_steps`: set "
                                         r"it to the run's iterations, got -1"):
        trainer(-1, max_epochs=1).fit(RagenModule(str(tiny_model_path), advantage=GRPO(), optim=optim), dm)
    with pytest.raises(ValueError, match=r"`--model.optim.schedule` must be one of constant, cosine, got 'linear'"):
        OptimConfig(schedule="linear")


def test_a_run_of_two_envs_logs_token_entropy_for_the_env_its_filtered_batch_holds(tiny_model_path):
    """Two envs, and a filter that keeps one of the two groups: the kept batch holds one env, whose token entropy is
    still logged under its own name (the Echo Trap alarm reads it per env), as the rollout's metrics are."""
    from ragen_pl.filters import VarianceTopP

    module, dm = make(tiny_model_path, env=[Bandit(), Sokoban()])
    dm.filter = VarianceTopP(top_p=0.5)
    assert dm.by_tag is True and make(tiny_model_path)[1].by_tag is None
    t = trainer(1)
    t.fit(module, dm)
    m = t.callback_metrics
    assert float(m["filter/kept_frac"]) == 0.5
    per_env = [k for k in m if k.endswith("/token_entropy") and k != "rollout/token_entropy"]
    assert len(per_env) == 1 and per_env[0] in ("rollout/Bandit/token_entropy", "rollout/Sokoban/token_entropy")
    assert float(m[per_env[0]]) == pytest.approx(float(m["rollout/token_entropy"]))
