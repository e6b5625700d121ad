"""The Echo Trap alarm (paper, section on collapse): per env, a significant fall of training success, named with the
signals that narrowing behaviour leaves (repetition, entropy, I(X;Z), gradient spikes). ``benchmarks/echo_trap.py``
judges it on recorded runs and on simulated runs with no learning, and whether those signals move first."""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override


class EchoTrapAlarm(Callback):
    """Watch for the Echo Trap (paper, section on collapse) and act before a run wastes more of its budget.

    A collapse is an env whose training success falls, significantly for the episodes behind it. In the
    quickstart's GRPO runs Bandit success fell from 0.44-0.64 to 0.00-0.13 within one to three iterations, onto the
    safe arm, with repetition rising later. Narrowing alone is no alarm: a PPO run that *solves* Bandit narrows too
    (repetition 0.07 -> 0.86). So per env tag (in a multi-env run one env can collapse while another improves):

    * ``success_drop`` (required): over the last k steps (each k in 1..``smooth``) the env's success is below
      ``drop_ratio`` x the best k-step success it reached, and the fall is significant: a two-proportion z of at
      least ``min_z``, counting the episodes behind each share (``rollout/<tag>/episodes``) over the run's mean
      design effect (episodes / ``rollout/<tag>/effective_episodes``: trajectories of a group share a board, and on
      RAGEN's random boards their successes cluster, so a share varies more than a binomial of its episodes). With
      0/1 rewards a noisy success at 15% halves by chance every few steps; the z-test, not a minimum peak, keeps that
      quiet, so an env that never reached 0.3 (SmolLM2 on Sokoban) can still raise it;
    * ``min_signals - 1`` more signals (none by default: on recorded runs they held as often without a collapse),
      each *not* arithmetically tied to success (the in-group reward std is not one: with 0/1 rewards it falls
      whenever success does), named in the warning when they hold:
      ``repetition`` (the env's share of repeated answers in a group above ``repetition_ratio`` x and
      ``repetition_margin`` over its trailing median, or above ``max_repetition``), ``entropy`` (the env's
      ``rollout/<tag>/token_entropy`` where a multi-env run logs it, else ``loss/entropy``, below ``entropy_ratio``
      x its trailing median), ``mi`` (``collapse/mi``, RAGEN-2's I(X;Z), below
      ``mi_ratio`` x its trailing median when that median is at least ``mi_floor``: the reasoning stops depending
      on the input), ``grad_spike`` (``actor/grad_norm`` above ``spike_ratio`` x its trailing median).

    It fires when these hold for ``patience`` consecutive steps, names the env and the signals with their values, and
    then warns, saves a checkpoint, or stops training (``action``). It fires once per env. It is a detector, not a
    forecast: it needs the fall to be visible in the counts. ``benchmarks/echo_trap.py`` prints its delay (steps
    from the halving of success to the alarm) on recorded runs, the runs its defaults were chosen on apart from
    held-out ones, and its false alarms on simulated runs with no learning at several success levels.
    In a multi-process run ``episodes`` is a per-process mean, so the test counts fewer episodes than were
    played: less sensitive, never more.

    Apart from the alarm, one early warning: where the advantage is the critic's, whitened over the batch (PPO's
    GAE, the default), a batch whose kept groups carry no reward variance (``filter/reward_std_after``, else
    ``rollout/group_reward_std``, at most ``no_signal_std``) is trained on the critic's error scaled to unit size,
    an update on noise. While some env succeeds at least ``no_signal_success`` (the run has learned something it
    can lose; below it, a run on boards too hard for it has no variance either, and nothing to lose), and that holds
    ``no_signal_steps`` steps in a row, it warns once and logs
    ``echo_trap/no_signal`` (``benchmarks/echo_trap.py`` prints how far ahead of the recorded PPO collapses it held
    and where it held without one). A filter that keeps no such group (``DropZeroVariance``, ``SNR`` with
    ``include_zero: false``) removes the cause. Its thresholds came from 6 recorded runs; on 3 held-out collapses
    it came ahead of none (README: the early warning), so read it as a named symptom, not a forecast.
    """

    def __init__(
        self,
        window: int = 10,
        smooth: int = 3,
        drop_ratio: float = 0.5,
        min_z: float = 4.0,
        repetition_ratio: float = 1.5,
        repetition_margin: float = 0.1,
        max_repetition: float = 0.6,
        entropy_ratio: float = 0.5,
        mi_ratio: float = 0.5,
        mi_floor: float = 0.02,
        spike_ratio: float = 5.0,
        min_signals: int = 1,
        patience: int = 2,
        action: Literal["warn", "checkpoint", "stop"] = "warn",
        no_signal_steps: int = 2,
        no_signal_std: float = 0.02,
        no_signal_success: float = 0.5,
    ) -> None:
        """
        Args:
            window: trailing steps the co-signals compare the latest value with.
            smooth: the success test also compares k-step means, k = 1..smooth (a slow fall at low success).
            drop_ratio: success-drop signal when an env's success < this x its best so far ...
            min_z: ... and the fall is at least this many standard errors (two-proportion z-test).
            repetition_ratio: repetition signal when the env's repetition > this x its trailing median ...
            repetition_margin: ... and more than this above it (small shares fluctuate by several x).
            max_repetition: repetition signal when the env's repetition > this, whatever the window.
            entropy_ratio: entropy signal when the latest entropy < this x the trailing median.
            mi_ratio: I(X;Z) signal when the latest ``collapse/mi`` < this x its trailing median ...
            mi_floor: ... and that median is at least this (nats; below it the input is not read anyway).
            spike_ratio: gradient signal when the latest actor gradient norm > this x the trailing median.
            min_signals: signals that must hold together, the success drop included.
            patience: consecutive steps they must hold.
            action: what to do when it fires.
            no_signal_steps: warn after this many steps in a row without reward variance in the update (0: never).
            no_signal_std: a batch's mean in-group reward std at or below this counts as none ...
            no_signal_success: ... while some env's training success is at least this.
        """
        if action not in ("warn", "checkpoint", "stop"):
            raise ValueError(f"`EchoTrapAlarm.action` must be warn, checkpoint or stop, got {action!r}")
        if window < 2 or smooth < 1 or patience < 1 or not 1 <= min_signals <= 5:
            raise ValueError(f"`EchoTrapAlarm` needs window >= 2, smooth >= 1, patience >= 1, 1 <= min_signals <= 5; "
                             f"got {window}, {smooth}, {patience}, {min_signals}")
        if not 0 < drop_ratio < 1 or not min_z > 0:
            raise ValueError(f"`EchoTrapAlarm` needs 0 < drop_ratio < 1 and min_z > 0; got {drop_ratio}, {min_z}")
        self.window, self.smooth, self.drop_ratio, self.min_z = window, smooth, drop_ratio, min_z
        self.repetition_ratio, self.max_repetition = repetition_ratio, max_repetition
        self.repetition_margin = repetition_margin
        self.entropy_ratio, self.spike_ratio = entropy_ratio, spike_ratio
        self.mi_ratio, self.mi_floor = mi_ratio, mi_floor
        if no_signal_steps < 0 or no_signal_std < 0:
            raise ValueError(f"`EchoTrapAlarm` needs no_signal_steps >= 0 and no_signal_std >= 0; got "
                             f"{no_signal_steps}, {no_signal_std}")
        self.min_signals, self.patience, self.action = min_signals, patience, action
        self.no_signal_steps, self.no_signal_std = no_signal_steps, no_signal_std
        self.no_signal_success = no_signal_success
        self.no_signal_streak = 0
        self.no_signal_at: int | None = None  # the step of the early warning (once a run)
        self.whitened = True  # whether updates whiten the critic's advantages; set from the module at fit start
        self.history: dict[str, deque[float]] = {}
        self.successes: dict[str, deque[tuple[float, float]]] = {}  # tag -> last `smooth` (success, episodes)
        self.peaks: dict[str, dict[int, tuple[float, float]]] = {}  # tag -> k -> best k-step (success, episodes)
        self.design: dict[str, tuple[float, int]] = {}  # tag -> (sum, count) of the steps' design effects
        self.streaks: dict[str, int] = {}
        self.fired_at: int | None = None
        self.fired_tags: set[str] = set()
        self.last_signals: dict[str, float] = {}
        self.last_tag: str | None = None
        self.held: dict[str, dict[str, float]] = {}  # env tag -> every signal that held at the latest step

    @override
    def state_dict(self) -> dict[str, Any]:
        """The trailing windows and peaks survive a resume, so the alarm compares against the run's own history."""
        return {"history": {k: list(v) for k, v in self.history.items()},
                "successes": {k: [list(x) for x in v] for k, v in self.successes.items()},
                "peaks": {t: {str(k): list(v) for k, v in p.items()} for t, p in self.peaks.items()},
                "design": {t: list(v) for t, v in self.design.items()},
                "streaks": dict(self.streaks), "fired_at": self.fired_at, "fired_tags": sorted(self.fired_tags),
                "no_signal": [self.no_signal_streak, self.no_signal_at]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {k: deque(v, maxlen=self.window) for k, v in state_dict.get("history", {}).items()}
        self.successes = {k: deque((tuple(x) for x in v), maxlen=self.smooth)  # type: ignore[misc]
                          for k, v in state_dict.get("successes", {}).items()}
        peaks = state_dict.get("peaks", {})
        self.peaks = {t: {int(k): tuple(v) for k, v in p.items()} for t, p in peaks.items()  # type: ignore[misc]
                      if isinstance(p, dict)}  # a checkpoint of the old alarm kept one float per tag: start afresh
        self.design = {t: (float(v[0]), int(v[1])) for t, v in state_dict.get("design", {}).items()}
        self.streaks = dict(state_dict.get("streaks", {}))
        self.fired_at = state_dict.get("fired_at")
        self.fired_tags = set(state_dict.get("fired_tags", []))
        self.no_signal_streak, self.no_signal_at = state_dict.get("no_signal", [0, None])

    def _below(self, key: str, value: float | None, ratio: float, floor: float = 0.0) -> bool:
        """Whether ``value`` is below ``ratio`` x the trailing median of ``key`` (a median of at least ``floor``);
        record it."""
        if value is None or not math.isfinite(value):
            return False
        h = self.history.setdefault(key, deque(maxlen=self.window))
        low = len(h) >= 2 and (base := _median(h)) >= floor and value < ratio * base
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

    def _success_dropped(self, tag: str, success: float, episodes: float, effective: float | None = None) -> bool:
        """Record this step's success; whether some k-step mean fell significantly below its best (see class)."""
        recent = self.successes.setdefault(tag, deque(maxlen=self.smooth))
        recent.append((success, episodes))
        total, steps = self.design.get(tag, (0.0, 0))
        if effective is not None and math.isfinite(effective) and effective > 0:
            total, steps = total + max(1.0, episodes / effective), steps + 1
            self.design[tag] = (total, steps)
        deff = total / steps if steps else 1.0  # runs logged before effective_episodes: the binomial count
        peaks = self.peaks.setdefault(tag, {})
        dropped = False
        for k in range(1, len(recent) + 1):
            window = list(recent)[-k:]
            n = sum(e for _, e in window)
            now = sum(s * e for s, e in window) / n
            best, n_best = peaks.get(k, (now, n))
            if now >= best:
                peaks[k] = (now, n)
            elif now < self.drop_ratio * best and drop_z(best, n_best / deff, now, n / deff) >= self.min_z:
                dropped = True
        return dropped

    def observe(self, metrics: dict[str, float]) -> dict[str, float]:
        """Feed one step's metrics; return the signals of the env that is collapsing now (empty if none)."""
        std = metrics.get("filter/reward_std_after", metrics.get("rollout/group_reward_std"))
        best = max((v for k, v in metrics.items() if k.startswith("rollout/") and k.endswith("/success")),
                   default=0.0)
        quiet = (std is not None and math.isfinite(std) and std <= self.no_signal_std
                 and best >= self.no_signal_success
                 and metrics.get("filter/kept_frac", 1.0) > 0)  # nothing kept: no update at all
        self.no_signal_streak = self.no_signal_streak + 1 if quiet else 0
        tags = sorted({k.split("/")[1] for k in metrics if k.startswith("rollout/") and k.count("/") == 2
                       and k.endswith("/success")}) or [""]
        # Each env's own entropy where the run logs it; once seen, for the rest of the run.
        per_env = any(k.endswith("/entropy") for k in self.history) or any(
            f"rollout/{tag}/token_entropy" in metrics for tag in tags if tag)
        batch: dict[str, float] = {}
        if not per_env and self._below("entropy", metrics.get("loss/entropy"), self.entropy_ratio):
            batch["entropy"] = metrics["loss/entropy"]
        if self._above("grad", metrics.get("actor/grad_norm"), self.spike_ratio):
            batch["grad_spike"] = metrics["actor/grad_norm"]
        worst: dict[str, float] = {}
        self.last_tag = None
        for tag in tags:
            prefix = f"rollout/{tag}/" if tag else "rollout/"
            signals = dict(batch)
            entropy = metrics.get(f"{prefix}token_entropy") if per_env else None
            if self._below(f"{tag}/entropy", entropy, self.entropy_ratio):
                signals["entropy"] = entropy  # type: ignore[assignment]
            mi_key = f"collapse/{tag}/mi" if f"collapse/{tag}/mi" in metrics else "collapse/mi"
            if self._below(f"{tag}/mi", metrics.get(mi_key), self.mi_ratio, self.mi_floor):
                signals["mi"] = metrics[mi_key]
            rep = metrics.get(prefix + "repetition")
            if self._above(f"{tag}/repetition", rep, self.repetition_ratio, self.max_repetition,
                           self.repetition_margin):
                signals["repetition"] = rep  # type: ignore[assignment]
            success, episodes = metrics.get(prefix + "success"), metrics.get(prefix + "episodes")
            if (success is not None and episodes is not None and math.isfinite(success) and episodes > 0
                    and self._success_dropped(tag, success, episodes, metrics.get(prefix + "effective_episodes"))):
                signals["success_drop"] = success
            self.held[tag] = signals
            collapsing = "success_drop" in signals and len(signals) >= self.min_signals and tag not in self.fired_tags
            self.streaks[tag] = self.streaks.get(tag, 0) + 1 if collapsing else 0
            if collapsing and (self.last_tag is None or self.streaks[tag] > self.streaks[self.last_tag]):
                worst, self.last_tag = signals, tag
        self.last_signals = worst
        return worst

    @property
    def no_signal(self) -> bool:
        """Whether the updates have had no reward variance for ``no_signal_steps`` steps (the early warning)."""
        return 0 < self.no_signal_steps <= self.no_signal_streak

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        advantage = getattr(pl_module, "advantage", None)
        self.whitened = bool(getattr(advantage, "needs_critic", False) and getattr(advantage, "whiten", False))

    @property
    def firing(self) -> bool:
        return self.last_tag is not None and self.streaks.get(self.last_tag, 0) >= self.patience

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1}
        signals = self.observe(metrics)
        if self.no_signal and self.whitened and self.no_signal_at is None:
            self.no_signal_at = trainer.global_step
            rank_zero_warn(f"Echo Trap early warning at step {trainer.global_step}: the updated groups have had no "
                           f"reward variance for {self.no_signal_streak} steps (in-group std <= {self.no_signal_std}),"
                           f" so the whitened advantages are the critic's error at unit scale: updates on noise. "
                           f"Consider a filter that drops zero-variance groups (ragen_pl.filters.DropZeroVariance).")
            self._log(pl_module, "echo_trap/no_signal")
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
        self._log(pl_module, "echo_trap/fired")
        if self.action == "checkpoint":
            path = Path(trainer.log_dir or trainer.default_root_dir) / f"echo-trap-step{trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            rank_zero_info(f"saved {path}")
        elif self.action == "stop":
            trainer.should_stop = True
        self.streaks[self.last_tag or ""] = 0

    @staticmethod
    def _log(pl_module, key: str) -> None:
        if hasattr(pl_module, "log_sporadic"):  # logged once, at this step (not repeated by Lightning)
            pl_module.log_sporadic({key: 1.0})
        else:
            pl_module.log(key, 1.0, batch_size=1)


def drop_z(before: float, n_before: float, after: float, n_after: float) -> float:
    """How many standard errors a success share fell from ``before`` (over ``n_before`` episodes) to ``after``
    (over ``n_after``): the pooled two-proportion z statistic (infinite for a certain fall, 0 for none)."""
    pooled = (before * n_before + after * n_after) / (n_before + n_after)
    variance = pooled * (1 - pooled) * (1 / n_before + 1 / n_after)
    if variance <= 0:
        return math.inf if before > after else 0.0
    return (before - after) / math.sqrt(variance)


def _median(values) -> float:
    s = sorted(values)
    return s[len(s) // 2]


__all__ = ["EchoTrapAlarm", "drop_z"]
