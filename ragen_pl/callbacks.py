"""Callbacks: weight sync to the rollout engine, step-0 evaluation, trajectory samples, the training budget, the run's
closing summary (the Echo Trap alarm lives in ragen_pl.echo_trap; ``ragen_pl.callbacks.EchoTrapAlarm`` stays valid in
configs).

Syncing weights is a Callback, not part of ``training_step``: the update knows nothing of engines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ragen_pl.dist import mean_over_ranks
from ragen_pl.echo_trap import EchoTrapAlarm


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
    this callback does nothing for them. Nor with ``--data.max_staleness``: the background rollouts' schedule hands
    the weights over between two rollouts (:mod:`ragen_pl.rollout.ahead`).
    """

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dm = _datamodule(trainer)
        if getattr(dm, "ahead", None) is None:
            dm.sync_engine(pl_module)


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
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=0)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        for cb in trainer.callbacks:  # the baseline's trajectories, as every later evaluation's
            if isinstance(cb, TrajectorySamples):
                cb.write(trainer)


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
        self.write(trainer)

    def write(self, trainer) -> None:
        """The latest evaluation's samples at this step (``step_<global step>.jsonl``: the weights evaluated)."""
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

    @property
    def used(self) -> bool:
        return self.spent_s >= 60 * self.minutes

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if self.used:  # a run resumed after its budget was used trains nothing more
            rank_zero_info(f"training budget of {self.minutes:g} minutes already used ({self.spent_s:.0f} s of "
                           f"iterations); no iteration after step {trainer.global_step}")
            trainer.should_stop = True

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        spent = trainer.callback_metrics.get("time/iteration")
        if spent is not None:
            self.spent_s += float(spent)
        if self.used:
            rank_zero_info(f"training budget of {self.minutes:g} minutes used ({self.spent_s:.0f} s of iterations); "
                           f"stopping after {trainer.global_step} iterations")
            trainer.should_stop = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"spent_s": self.spent_s}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.spent_s = float(state_dict.get("spent_s", 0.0))


class RunSummary(Callback):
    """At the end of ``fit``, a short table per evaluation env: success at step 0, the best and the last evaluation
    (with their steps), and the random and the optimal policy's success on the same evaluation seeds where the env
    has them (``val/<env>/random_success``, ``val/<env>/optimal_success``: :mod:`ragen_pl.baselines`)."""

    def __init__(self) -> None:
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.references: dict[str, dict[str, float]] = {}

    def _record(self, trainer, step: int) -> None:
        for key, value in trainer.callback_metrics.items():
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != "val":
                continue
            if parts[2] == "success":
                points = self.history.setdefault(parts[1], [])
                if not points or points[-1][0] != step:
                    points.append((step, float(value)))
            elif parts[2] in ("random_success", "optimal_success"):
                self.references.setdefault(parts[1], {})[parts[2]] = float(value)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self.history.clear()
        self.references.clear()
        if trainer.global_step == 0:  # the step-0 evaluation (ValidateAtStart) has just run
            self._record(trainer, 0)

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":
            self._record(trainer, trainer.global_step)

    @override
    def on_fit_end(self, trainer, pl_module) -> None:
        log_dir = trainer.log_dir  # every rank asks: it is a broadcast (rank 0 alone would hang a DDP run)
        if not trainer.is_global_zero or not self.history:
            return
        dm = getattr(trainer, "datamodule", None)
        width = max(len(tag) for tag in self.history) + 2
        lines = [f"Evaluation success ({getattr(dm, 'val_episodes', '?')} fixed seeds per env, temperature "
                 f"{getattr(dm, 'val_temperature', '?')}):",
                 f"{'env':<{width}}{'step 0':>8}{'best (step)':>15}{'last (step)':>15}{'random policy':>15}"
                 f"{'optimal policy':>16}"]

        def cell(value: float | None, width: int) -> str:
            return f"{'-' if value is None else f'{value:.3f}':>{width}}"

        for tag, points in self.history.items():
            first = next((v for step, v in points if step == 0), None)
            best = max(points, key=lambda p: p[1])
            last = points[-1]
            refs = self.references.get(tag, {})
            lines.append(f"{tag:<{width}}{cell(first, 8)}{f'{best[1]:.3f} ({best[0]})':>15}"
                         f"{f'{last[1]:.3f} ({last[0]})':>15}{cell(refs.get('random_success'), 15)}"
                         f"{cell(refs.get('optimal_success'), 16)}")
        if log_dir:
            lines.append(f"Run folder: {log_dir} (curves and sample trajectories: ragen-pl report {log_dir})")
        rank_zero_info("\n".join(lines))


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
        shown = {short: f"{float(metrics[key]):.3g}" for key, short in self.SHOWN.items() if key in metrics}
        failed, played = metrics.get("rollout/failed"), metrics.get("rollout/played")
        if failed is not None and played is not None and float(failed) > 0:  # episodes whose env failed, of all
            shown["failed"] = f"{int(failed)}/{int(played)}"
        return shown


def default_callbacks() -> list[Callback]:
    """What every ``ragen-pl fit`` run gets unless its config already has a callback of that class."""
    return [WeightSync(), ValidateAtStart(), TrajectorySamples(), EchoTrapAlarm(), RunSummary(), RagenProgressBar()]
