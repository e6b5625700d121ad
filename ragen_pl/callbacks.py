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
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from ragen_pl.dist import mean_over_ranks


def _datamodule(trainer: pl.Trainer):
    dm = getattr(trainer, "datamodule", None)
    if dm is None or not hasattr(dm, "engine"):
        raise RuntimeError("this callback needs the RolloutDataModule (trainer.fit(module, datamodule=...))")
    return dm


class WeightSync(Callback):
    """After every update, hand the policy's weights to engines that keep their own copy (vLLM).

    The data module also does it before any rollout or evaluation whose engine holds other weights than the
    policy's (:meth:`~ragen_pl.data.RolloutDataModule.sync_engine`): a resumed run, a validation from a checkpoint.
    Engines that sample with the policy's own modules (the embedded ``hf`` engine) share the weights already, and
    this callback does nothing for them.
    """

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _datamodule(trainer).sync_engine(pl_module)


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
        metrics = mean_over_ranks(metrics, {}, default_weight=len(dm.eval_seeds()))  # every rank's episodes
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

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        # Every rank asks: `trainer.log_dir` is a broadcast, so asking on rank 0 alone hangs a multi-process run.
        root = Path(trainer.log_dir or trainer.default_root_dir)
        results = getattr(_datamodule(trainer), "eval_results", {})
        # Each env's own episodes (Lightning plays the next env's evaluation before the previous batch's hooks run,
        # so a per-batch hook would see the wrong env).
        rows = [{"env": ep.env.tag, "seed": ep.spec.seed, "success": ep.success, "return": ep.env_return,
                 "failed": ep.failed, "transcript": ep.transcript}
                for result in results.values() for ep in result.episodes[: self.n]]
        results.clear()
        if not trainer.is_global_zero or not rows:
            return
        out = root / "samples" / f"step_{trainer.global_step:06d}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            for row in rows:
                f.write(json.dumps({"step": trainer.global_step, **row}) + "\n")
        for logger in trainer.loggers:
            if type(logger).__name__ == "WandbLogger":
                table = [[r["env"], r["seed"], r["success"], r["return"], json.dumps(r["transcript"])] for r in rows]
                logger.log_table("samples", columns=["env", "seed", "success", "return", "transcript"], data=table)


class EchoTrapAlarm(Callback):
    """Watch for the Echo Trap (paper, section on collapse) and act before a run wastes its budget.

    A collapse is an env whose training success falls while its behaviour narrows: in the quickstart's real GRPO
    runs Bandit success fell from 0.44-0.48 to 0.00-0.06 while its in-group reward std went to ~0 and repetition
    rose. Narrowing alone is no alarm: a PPO run that *solves* Bandit also reaches std 0 and repetition 0.86. So
    a falling success is required, per env tag (in a multi-env run one env can collapse while another improves):

    * ``success_drop`` (required): ``rollout/<tag>/success`` below ``success_ratio`` x the best value it reached,
      once that best is at least ``min_peak``;
    * ``reward_std``: the env's in-group reward std below ``std_ratio`` x the median of its trailing ``window``
      (or below ``std_floor``);
    * ``repetition``: the env's share of repeated answers in a group above ``repetition_ratio`` x its trailing median
      and at least ``repetition_margin`` above it (or above ``max_repetition``);
    * ``entropy``: ``loss/entropy`` below ``entropy_ratio`` x its trailing median (the whole batch);
    * ``grad_spike``: ``actor/grad_norm`` above ``spike_ratio`` x its trailing median (the whole batch).

    It fires when ``success_drop`` and at least ``min_signals - 1`` other signals hold for ``patience`` consecutive
    steps, names the env and the signals with their values, and then warns, saves a checkpoint, or stops
    training (``action``). It fires once per env. The defaults were chosen on recorded quickstart runs, 5 PPO seeds
    and 5 GRPO seeds (``tests/data/echo_trap``): it fires on every GRPO run whose Bandit collapsed and on none of the
    PPO runs; ``repetition_margin`` came from a PPO run of the findings grid whose FrozenLake success dipped from
    0.34 to 0.16 for two iterations while its (tiny) repetition share went from 0.02 to 0.09.
    """

    def __init__(
        self,
        window: int = 10,
        success_ratio: float = 0.5,
        min_peak: float = 0.3,
        std_ratio: float = 0.5,
        std_floor: float = 0.02,
        repetition_ratio: float = 1.5,
        repetition_margin: float = 0.1,
        max_repetition: float = 0.6,
        entropy_ratio: float = 0.5,
        spike_ratio: float = 5.0,
        min_signals: int = 2,
        patience: int = 2,
        action: Literal["warn", "checkpoint", "stop"] = "warn",
    ) -> None:
        """
        Args:
            window: trailing steps the latest value is compared with.
            success_ratio: success-drop signal when an env's success < this x its best so far.
            min_peak: the best success must have reached this before a drop counts (noise at low success).
            std_ratio: reward-std signal when the env's in-group std < this x its trailing median.
            std_floor: reward-std signal when the env's in-group std < this, whatever the window.
            repetition_ratio: repetition signal when the env's repetition > this x its trailing median ...
            repetition_margin: ... and more than this above it (small shares fluctuate by several x).
            max_repetition: repetition signal when the env's repetition > this, whatever the window.
            entropy_ratio: entropy signal when the latest entropy < this x the trailing median.
            spike_ratio: gradient signal when the latest actor gradient norm > this x the trailing median.
            min_signals: signals that must hold together, the success drop included.
            patience: consecutive steps they must hold.
            action: what to do when it fires.
        """
        if action not in ("warn", "checkpoint", "stop"):
            raise ValueError(f"`EchoTrapAlarm.action` must be warn, checkpoint or stop, got {action!r}")
        if window < 2 or patience < 1 or not 1 <= min_signals <= 5:
            raise ValueError(f"need window >= 2, patience >= 1, 1 <= min_signals <= 5; got {window}, {patience}, "
                             f"{min_signals}")
        self.window, self.success_ratio, self.min_peak = window, success_ratio, min_peak
        self.std_ratio, self.std_floor = std_ratio, std_floor
        self.repetition_ratio, self.max_repetition = repetition_ratio, max_repetition
        self.repetition_margin = repetition_margin
        self.entropy_ratio, self.spike_ratio = entropy_ratio, spike_ratio
        self.min_signals, self.patience, self.action = min_signals, patience, action
        self.history: dict[str, deque[float]] = {}
        self.peaks: dict[str, float] = {}
        self.streaks: dict[str, int] = {}
        self.fired_at: int | None = None
        self.fired_tags: set[str] = set()
        self.last_signals: dict[str, float] = {}
        self.last_tag: str | None = None

    @override
    def state_dict(self) -> dict[str, Any]:
        """The trailing windows and peaks survive a resume, so the alarm compares against the run's own history."""
        return {"history": {k: list(v) for k, v in self.history.items()}, "peaks": dict(self.peaks),
                "streaks": dict(self.streaks), "fired_at": self.fired_at, "fired_tags": sorted(self.fired_tags)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {k: deque(v, maxlen=self.window) for k, v in state_dict.get("history", {}).items()}
        self.peaks = dict(state_dict.get("peaks", {}))
        self.streaks = dict(state_dict.get("streaks", {}))
        self.fired_at = state_dict.get("fired_at")
        self.fired_tags = set(state_dict.get("fired_tags", []))

    def _below(self, key: str, value: float | None, ratio: float, floor: float | None = None) -> bool:
        """Whether ``value`` is below ``ratio`` x the trailing median of ``key`` (or below ``floor``); record it."""
        if value is None or not math.isfinite(value):
            return False
        h = self.history.setdefault(key, deque(maxlen=self.window))
        low = (floor is not None and value < floor) or (len(h) >= 2 and value < ratio * _median(h))
        h.append(value)
        return low

    def _above(self, key: str, value: float | None, ratio: float, ceiling: float | None = None,
               margin: float = 0.0) -> bool:
        """Whether ``value`` is above ``ratio`` x (and ``margin`` over) the trailing median of ``key``, or above
        ``ceiling``; non-finite counts as above. Records it."""
        if value is None:
            return False
        h = self.history.setdefault(key, deque(maxlen=self.window))
        if not math.isfinite(value):
            return True
        base = _median(h) if len(h) >= 2 else None
        high = (ceiling is not None and value > ceiling) or (
            base is not None and value > ratio * max(base, 1e-6) and value > base + margin)
        h.append(value)
        return high

    def observe(self, metrics: dict[str, float]) -> dict[str, float]:
        """Feed one step's metrics; return the signals of the env that is collapsing now (empty if none)."""
        batch: dict[str, float] = {}
        if self._below("entropy", metrics.get("loss/entropy"), self.entropy_ratio):
            batch["entropy"] = metrics["loss/entropy"]
        if self._above("grad", metrics.get("actor/grad_norm"), self.spike_ratio):
            batch["grad_spike"] = metrics["actor/grad_norm"]
        tags = sorted({k.split("/")[1] for k in metrics if k.startswith("rollout/") and k.count("/") == 2
                       and k.endswith("/success")}) or [""]
        worst: dict[str, float] = {}
        self.last_tag = None
        for tag in tags:
            prefix = f"rollout/{tag}/" if tag else "rollout/"
            signals = dict(batch)
            success = metrics.get(prefix + "success")
            if success is not None and math.isfinite(success):
                peak = self.peaks[tag] = max(self.peaks.get(tag, success), success)
                if peak >= self.min_peak and success < self.success_ratio * peak:
                    signals["success_drop"] = success
            std = metrics.get(prefix + "group_reward_std")
            if self._below(f"{tag}/std", std, self.std_ratio, self.std_floor):
                signals["reward_std"] = std  # type: ignore[assignment]
            rep = metrics.get(prefix + "repetition")
            if self._above(f"{tag}/repetition", rep, self.repetition_ratio, self.max_repetition,
                           self.repetition_margin):
                signals["repetition"] = rep  # type: ignore[assignment]
            collapsing = "success_drop" in signals and len(signals) >= self.min_signals and tag not in self.fired_tags
            self.streaks[tag] = self.streaks.get(tag, 0) + 1 if collapsing else 0
            if collapsing and (self.last_tag is None or self.streaks[tag] > self.streaks[self.last_tag]):
                worst, self.last_tag = signals, tag
        self.last_signals = worst
        return worst

    @property
    def firing(self) -> bool:
        return self.last_tag is not None and self.streaks.get(self.last_tag, 0) >= self.patience

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1}
        signals = self.observe(metrics)
        if not self.firing:
            return
        self.fired_at = trainer.global_step
        self.fired_tags.add(self.last_tag or "")
        described = ", ".join(f"{k}={v:.4g}" for k, v in signals.items())
        env = f" in env {self.last_tag}" if self.last_tag else ""
        message = (f"Echo Trap alarm at step {trainer.global_step}{env}: {described} held for "
                   f"{self.streaks[self.last_tag or '']} steps (success collapsing while behaviour narrows). "
                   f"Consider a stronger variance filter, a lower learning rate, or clip-higher.")
        rank_zero_warn(message)
        if hasattr(pl_module, "log_sporadic"):  # logged once, at this step (not repeated by Lightning)
            pl_module.log_sporadic({"echo_trap/fired": 1.0})
        else:
            pl_module.log("echo_trap/fired", 1.0, batch_size=1)
        if self.action == "checkpoint":
            path = Path(trainer.log_dir or trainer.default_root_dir) / f"echo-trap-step{trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            rank_zero_info(f"saved {path}")
        elif self.action == "stop":
            trainer.should_stop = True
        self.streaks[self.last_tag or ""] = 0


class TrainingBudget(Callback):
    """Stop training once its iterations (rollout, filter, scoring, update: ``time/iteration``) have used
    ``minutes`` of wall time; evaluations do not count. The run then ends as at ``max_steps`` (checkpoint saved)."""

    def __init__(self, minutes: float) -> None:
        """
        Args:
            minutes: training time allowed, evaluations not counted.
        """
        if not minutes > 0:
            raise ValueError(f"`TrainingBudget.minutes` must be > 0, got {minutes}")
        self.minutes = minutes
        self.spent_s = 0.0

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        spent = trainer.callback_metrics.get("time/iteration")
        if spent is not None:
            self.spent_s += float(spent)
        if self.spent_s >= 60 * self.minutes:
            rank_zero_info(f"training budget of {self.minutes:g} minutes used ({self.spent_s:.0f} s of iterations); "
                           f"stopping after {trainer.global_step} iterations")
            trainer.should_stop = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"spent_s": self.spent_s}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.spent_s = float(state_dict.get("spent_s", 0.0))


def _median(values) -> float:
    s = sorted(values)
    return s[len(s) // 2]


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
