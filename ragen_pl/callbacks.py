"""Callbacks: weight sync to the rollout engine, step-0 evaluation, trajectory samples, the Echo Trap alarm.

Syncing weights is a Callback, not part of ``training_step``: the update knows nothing of engines.
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override


def _datamodule(trainer: pl.Trainer):
    dm = getattr(trainer, "datamodule", None)
    if dm is None or not hasattr(dm, "engine"):
        raise RuntimeError("this callback needs the RolloutDataModule (trainer.fit(module, datamodule=...))")
    return dm


class WeightSync(Callback):
    """After every update, hand the policy's weights to engines that keep their own copy (vLLM).

    Engines that sample with the policy's own modules (the embedded ``hf`` engine) share the weights already, and
    this callback does nothing for them.
    """

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = _datamodule(trainer).engine
        if getattr(engine, "needs_weight_sync", False):
            engine.load_weights(pl_module.policy_state_dict())


class ValidateAtStart(Callback):
    """Evaluate before the first update and log it at step 0: the paper's "success at step 0" baseline."""

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step > 0 or trainer.limit_val_batches == 0:  # resumed, or validation is off
            return
        dm = _datamodule(trainer)
        metrics: dict[str, float] = {}
        was_training = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            for env in dm.val_envs:
                metrics.update({k: float(v) for k, v in dm.evaluate(env, "val").items()})
        pl_module.train(was_training)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})


class TrajectorySamples(Callback):
    """After each evaluation, write N full sample trajectories per env as JSONL (and a wandb table if wandb logs).

    Files go to ``<log dir>/samples/step_<k>.jsonl``; ``ragen-pl report`` turns them into an HTML viewer.
    """

    def __init__(self, n: int = 8) -> None:
        """
        Args:
            n: trajectories per env per evaluation.
        """
        if n < 1:
            raise ValueError(f"`TrajectorySamples.n` must be >= 1, got {n}")
        self.n = n
        self._pending: list[dict[str, Any]] = []

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        result = getattr(_datamodule(trainer), "last_eval", None)
        if result is None:
            return
        for ep in result.episodes[: self.n]:
            self._pending.append({
                "env": ep.env.tag, "seed": ep.spec.seed, "success": ep.success, "return": ep.env_return,
                "failed": ep.failed, "transcript": ep.transcript,
            })

    @override
    @rank_zero_only
    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._pending:
            return
        root = Path(trainer.log_dir or trainer.default_root_dir)
        out = root / "samples" / f"step_{trainer.global_step:06d}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            for row in self._pending:
                f.write(json.dumps({"step": trainer.global_step, **row}) + "\n")
        for logger in trainer.loggers:
            if type(logger).__name__ == "WandbLogger":
                rows = [[r["env"], r["seed"], r["success"], r["return"], json.dumps(r["transcript"])]
                        for r in self._pending]
                logger.log_table("samples", columns=["env", "seed", "success", "return", "transcript"], data=rows)
        self._pending = []


class EchoTrapAlarm(Callback):
    """Watch for the Echo Trap (paper, section on collapse) and act before a run wastes its budget.

    The collapse signature: in-group reward std falls towards zero (first, an early warning), entropy falls, and
    the gradient norm spikes. Each signal compares the latest value with the median of a trailing window:

    * ``reward_std``: ``filter/reward_std_before`` below ``std_ratio`` x its window median (or below ``std_floor``);
    * ``entropy``: ``loss/entropy`` below ``entropy_ratio`` x its window median;
    * ``grad_spike``: ``actor/grad_norm`` above ``spike_ratio`` x its window median;
    * ``repetition``: ``rollout/repetition`` (share of duplicate reasoning texts in a group) above ``max_repetition``.

    It fires when at least ``min_signals`` signals hold for ``patience`` consecutive steps, says which fired and
    their values, and then warns, saves a checkpoint, or stops training (``action``).
    """

    def __init__(
        self,
        window: int = 10,
        std_ratio: float = 0.3,
        std_floor: float = 1e-3,
        entropy_ratio: float = 0.5,
        spike_ratio: float = 5.0,
        max_repetition: float = 0.6,
        min_signals: int = 2,
        patience: int = 2,
        action: Literal["warn", "checkpoint", "stop"] = "warn",
    ) -> None:
        """
        Args:
            window: trailing steps the latest value is compared with.
            std_ratio: reward-std signal when the latest in-group std < this x the window median.
            std_floor: reward-std signal when the latest in-group std < this, whatever the window.
            entropy_ratio: entropy signal when the latest entropy < this x the window median.
            spike_ratio: gradient signal when the latest actor gradient norm > this x the window median.
            max_repetition: repetition signal when the share of repeated reasoning exceeds this.
            min_signals: signals that must hold together.
            patience: consecutive steps they must hold.
            action: what to do when it fires.
        """
        if action not in ("warn", "checkpoint", "stop"):
            raise ValueError(f"`EchoTrapAlarm.action` must be warn, checkpoint or stop, got {action!r}")
        if window < 2 or patience < 1 or not 1 <= min_signals <= 4:
            raise ValueError(f"need window >= 2, patience >= 1, 1 <= min_signals <= 4; got {window}, {patience}, "
                             f"{min_signals}")
        self.window, self.std_ratio, self.std_floor = window, std_ratio, std_floor
        self.entropy_ratio, self.spike_ratio, self.max_repetition = entropy_ratio, spike_ratio, max_repetition
        self.min_signals, self.patience, self.action = min_signals, patience, action
        self.history: dict[str, deque[float]] = {k: deque(maxlen=window) for k in ("std", "entropy", "grad")}
        self.streak = 0
        self.fired_at: int | None = None
        self.last_signals: dict[str, float] = {}

    @override
    def state_dict(self) -> dict[str, Any]:
        """The trailing windows survive a resume, so the alarm compares against the run's own history."""
        return {"history": {k: list(v) for k, v in self.history.items()}, "streak": self.streak,
                "fired_at": self.fired_at}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k, values in state_dict.get("history", {}).items():
            self.history[k] = deque(values, maxlen=self.window)
        self.streak = state_dict.get("streak", 0)
        self.fired_at = state_dict.get("fired_at")

    def observe(self, metrics: dict[str, float]) -> dict[str, float]:
        """Feed one step's metrics; return the signals that hold now, with their values."""
        signals: dict[str, float] = {}

        def median(q: deque[float]) -> float:
            s = sorted(q)
            return s[len(s) // 2]

        std = metrics.get("filter/reward_std_before")
        if std is not None and math.isfinite(std):
            h = self.history["std"]
            if std < self.std_floor or (len(h) >= 2 and std < self.std_ratio * median(h)):
                signals["reward_std"] = std
            h.append(std)
        ent = metrics.get("loss/entropy")
        if ent is not None and math.isfinite(ent):
            h = self.history["entropy"]
            if len(h) >= 2 and ent < self.entropy_ratio * median(h):
                signals["entropy"] = ent
            h.append(ent)
        grad = metrics.get("actor/grad_norm")
        if grad is not None:
            h = self.history["grad"]
            if not math.isfinite(grad) or (len(h) >= 2 and grad > self.spike_ratio * median(h)):
                signals["grad_spike"] = grad
            if math.isfinite(grad):
                h.append(grad)
        rep = metrics.get("rollout/repetition")
        if rep is not None and rep > self.max_repetition:
            signals["repetition"] = rep
        self.streak = self.streak + 1 if len(signals) >= self.min_signals else 0
        self.last_signals = signals
        return signals

    @property
    def firing(self) -> bool:
        return self.streak >= self.patience

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1}
        signals = self.observe(metrics)
        if not self.firing:
            return
        self.fired_at = trainer.global_step
        described = ", ".join(f"{k}={v:.4g}" for k, v in signals.items())
        message = (f"Echo Trap alarm at step {trainer.global_step}: {described} held for {self.streak} steps "
                   f"(in-group reward std collapsing, entropy falling or gradient spiking). Consider a stronger "
                   f"variance filter, a lower learning rate, or clip-higher.")
        rank_zero_warn(message)
        pl_module.log("echo_trap/fired", 1.0, batch_size=1)
        if self.action == "checkpoint":
            path = Path(trainer.log_dir or trainer.default_root_dir) / f"echo-trap-step{trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            rank_zero_info(f"saved {path}")
        elif self.action == "stop":
            trainer.should_stop = True
        self.streak = 0


class RagenProgressBar(TQDMProgressBar):
    """A progress bar in StarPO iterations (the rollout stream has no epochs) with success, reward and entropy."""

    SHOWN = {"rollout/success": "success", "rollout/return_mean": "reward", "loss/entropy": "entropy",
             "filter/reward_std_before": "group_std"}

    @property
    @override
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self.trainer.max_steps > 0 else float("inf")

    @override
    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self.train_progress_bar.set_description("StarPO iteration")

    @override
    def get_metrics(self, trainer, pl_module) -> dict[str, int | str | float | dict[str, float]]:
        metrics = trainer.callback_metrics
        return {short: f"{float(metrics[key]):.3g}" for key, short in self.SHOWN.items() if key in metrics}


def default_callbacks() -> list[Callback]:
    """What every ``ragen-pl fit`` run gets unless its config already has a callback of that class."""
    return [WeightSync(), ValidateAtStart(), TrajectorySamples(), EchoTrapAlarm(), RagenProgressBar()]
