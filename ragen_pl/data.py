"""RolloutDataModule: fresh on-policy trajectories for every StarPO iteration.

Owns the envs, the rollout engine and the filter, because together they decide which trajectories exist. Each
training batch is one iteration's rollout: ``n_groups`` initial states (one env seed per group; groups go
round-robin over the training envs when there are several) x ``group_size`` trajectories, played with the current
weights, filtered, and handed to :class:`ragen_pl.module.RagenModule`, which splits it into mini-batches. With ``rollout_every_n_steps > 1`` a rollout is reused for that many steps.

With several processes each rank plays ``n_groups / world_size`` groups. The filter ranks *all* groups: the
per-trajectory stats are all-gathered, so "keep the top 25%" means 25% of the global batch. Ranks then pad their
share with masked-out rows to the same size, so every rank runs the same number of forward/backward passes.

Validation and test play ``val_episodes`` fixed-seed episodes at ``val_temperature`` on each env of ``val_envs``
and yield one dict of metrics per env (keys ``val/<tag>/...``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset
from tqdm import tqdm
from typing_extensions import override

from ragen_pl.baselines import reference_success
from ragen_pl.config import RolloutConfig, check_int, check_number
from ragen_pl.dist import gather_objects, gather_rows, max_over_processes, sum_over_processes
from ragen_pl.envs.base import Env
from ragen_pl.errors import ConfigError, RolloutError
from ragen_pl.filters import Filter, VarianceTopP
from ragen_pl.metrics import rollout_metrics
from ragen_pl.rollout.ahead import Played, RolloutsAhead
from ragen_pl.rollout.collector import Collector, EpisodeSpec, RolloutResult, context_limit, model_context
from ragen_pl.rollout.engine import RolloutEngine
from ragen_pl.rollout.hf import HFEngine
from ragen_pl.types import TrajectoryBatch, TrajectoryStats


@dataclass
class RolloutBatch:
    batch: TrajectoryBatch
    """The trajectories this rank trains on (filtered, padded to the ranks' common size)."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Rollout and filter metrics, computed over this rank's trajectories before filtering."""
    result: RolloutResult | None = None
    """The full rollout, for sample logging."""
    empty: bool = False
    """The filter kept no group (on any rank): the iteration trains nothing."""


class _Stream(IterableDataset):
    def __init__(self, produce) -> None:
        self.produce = produce

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self.produce()
            if item is None:
                return
            yield item


class _Once(IterableDataset):
    def __init__(self, produce) -> None:
        self.produce = produce

    def __iter__(self) -> Iterator[Any]:
        yield self.produce()


class RolloutDataModule(pl.LightningDataModule):
    def __init__(
        self,
        env: Env | list[Env],
        n_groups: int = 8,
        group_size: int = 16,
        engine: RolloutEngine | None = None,
        filter: Filter | None = None,
        rollout: RolloutConfig | None = None,
        val_envs: list[Env] | None = None,
        val_episodes: int = 256,
        val_temperature: float = 0.5,
        rollout_every_n_steps: int = 1,
        seed: int = 0,
        val_seed: int = 1_000_000,
        max_failed_share: float = 0.5,
        max_staleness: int = 0,
    ) -> None:
        """
        Args:
            env: the training env, or several (group k plays env k mod len(envs); metrics are kept per tag). Each
                is a prototype: every trajectory plays a fresh copy.
            n_groups: initial states per iteration (paper: 8).
            group_size: trajectories per initial state (paper: 16).
            engine: rollout engine (default: the embedded Hugging Face engine).
            filter: trajectory filter (default: StarPO-S's variance top-25%).
            rollout: turn, action and sampling budgets.
            val_envs: envs evaluated in validation and test (default: the training envs); tags must differ.
            val_episodes: fixed-seed evaluation episodes per env (paper: 256).
            val_temperature: sampling temperature in evaluation (paper: 0.5).
            rollout_every_n_steps: a new rollout every N training steps (1 = always on-policy).
            seed: first env seed of training; group k of the run uses seed + k.
            val_seed: first env seed of evaluation (fixed, so every evaluation plays the same states).
            max_failed_share: the largest share of a rollout's or an evaluation's episodes whose env may fail (raise,
                time out, return garbage) before the run stops with one line (and, in training, a checkpoint of the
                last completed iteration). Failed episodes are left out of the batch and counted either way.
            max_staleness: how many updates old the weights that sample a training rollout may be. 0: on-policy,
                rollout then update. K >= 1: the rollouts of the next K iterations are played on a background thread
                while this one updates (:mod:`ragen_pl.rollout.ahead`), by an engine with its own copy of the weights
                (``process``, ``vllm``), refreshed between rollouts. The update's log-probs are then a proximal
                policy's and the engine's the behaviour policy's: set ``--model.ppo.tis_cap`` and / or ``mis_bound``.
        """
        super().__init__()
        for name, value in (("n_groups", n_groups), ("group_size", group_size), ("val_episodes", val_episodes),
                            ("rollout_every_n_steps", rollout_every_n_steps)):
            check_int(f"--data.{name}", value)
        check_number("--data.val_temperature", val_temperature, 0.0)
        check_number("--data.max_failed_share", max_failed_share, 0.0, 1.0)
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"`--data.max_staleness` must be an integer >= 0, got {max_staleness!r}")
        if max_staleness and rollout_every_n_steps > 1:
            raise ValueError(f"`--data.max_staleness={max_staleness}` plays rollouts ahead of the update; it cannot "
                             f"also reuse them (`--data.rollout_every_n_steps={rollout_every_n_steps}`): set one")
        self.envs = list(env) if isinstance(env, (list, tuple)) else [env]
        if not self.envs:
            raise ValueError("`--data.env` must name at least one env")
        for name, envs in (("env", self.envs), ("val_envs", val_envs or [])):
            tags = [e.tag for e in envs]
            if len(set(tags)) != len(tags):
                raise ValueError(f"`--data.{name}` must have distinct tags (set `tag:` on variants), got {tags}")
        self.n_groups, self.group_size = n_groups, group_size
        self.engine = engine if engine is not None else HFEngine()
        self._engine_weights: int | None = None  # the module's weights_version the engine last got
        self._bound = None  # the policy object the engine was last bound to
        self.filter = filter if filter is not None else VarianceTopP()
        if group_size == 1 and self.filter.ranks_by_spread():
            raise ValueError(f"`--data.group_size=1`: a group of one trajectory has no reward spread, so "
                             f"`--data.filter` {type(self.filter).__name__} would keep an arbitrary share of the groups; "
                             f"use --data.group_size >= 2 or --data.filter=none")
        self.max_failed_share = max_failed_share
        self.rollout_config = rollout or RolloutConfig()
        self.val_envs = list(val_envs) if val_envs else list(self.envs)
        self.val_episodes, self.val_temperature = val_episodes, val_temperature
        self.rollout_every_n_steps = rollout_every_n_steps
        self.seed, self.val_seed = seed, val_seed
        self.max_staleness = max_staleness
        self.ahead: RolloutsAhead | None = None
        """The background rollouts (``max_staleness`` >= 1), started by the first training rollout."""
        self._staleness_max = 0
        self._stopping = False
        self._taken: Played | None = None
        self._restored: list[dict[str, Any]] = []
        """Rollouts played ahead that a checkpoint kept, to train first on resume."""
        self.iteration = 0
        """Rollouts played so far (the env seed counter); checkpointed."""
        self.empty_filters = 0
        """Iterations in a row whose filter kept nothing."""
        self._last: RolloutBatch | None = None
        self._steps_since_rollout = 0
        self._unfinished: tuple[int, dict[str, Any]] | None = None
        """The training step the latest fresh rollout is for, and the state before it (:meth:`rewind_unfinished_rollout`)."""
        self._warned_failures: set[str] = set()
        """The env tags whose failed episodes were warned of (once each)."""
        self.collector: Collector | None = None
        self.eval_results: dict[str, RolloutResult] = {}
        """The latest evaluation's episodes of this rank, by env tag (for :class:`~ragen_pl.callbacks.TrajectorySamples`)."""
        self._references: dict[tuple, dict[str, float]] = {}
        """The random and optimal policies' success per evaluation env and seeds (computed once per run)."""

    # ------------------------------------------------------------------------------------------- setup
    @property
    def world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    @property
    def by_tag(self) -> bool | None:
        """How a step's metrics split by env: for every env, whenever the run has several (a rank, or a filtered batch,
        may hold only some, and its metrics must still say which: see ragen_pl.metrics.mean_over_ranks); else None
        (per env only where a batch holds several tags)."""
        return True if len(self.envs) > 1 else None

    @override
    def setup(self, stage: str) -> None:
        rank, world = self.world
        if self.n_groups % world:
            raise ConfigError(f"`--data.n_groups` ({self.n_groups}) must be divisible by the number of processes "
                             f"({world})")
        module = self.trainer.lightning_module
        advantage = getattr(module, "advantage", None)
        if getattr(advantage, "needs_groups", False) and self.group_size < 2:
            raise ConfigError(f"`--data.group_size` must be >= 2 for {type(advantage).__name__}, got {self.group_size}")
        self._bind(module)
        limit = context_limit(self.rollout_config, model_context(module.policy))
        served = getattr(self.engine, "max_model_len", None)  # a server's own context (vllm_server)
        if served is not None and limit > served:
            if self.rollout_config.max_seq_len is not None:
                raise ConfigError(f"`--data.rollout.max_seq_len` ({limit}) must be <= the rollout server's context "
                                  f"({served} positions, its --max-model-len)")
            limit = served
        self.collector = Collector(self.engine, module.tokenizer, self.rollout_config, max_seq_len=limit)
        if self.max_staleness and stage == "fit":
            self._check_async(module)

    def _check_async(self, module) -> None:
        k = f"`--data.max_staleness={self.max_staleness}`"
        if not self.engine.holds_weights:
            raise ConfigError(f"{k} samples while the policy updates, so the engine needs its own copy of the "
                              f"weights; {type(self.engine).__name__} samples with the policy's own: use "
                              f"--data.engine=process (or vllm)")
        ppo = getattr(module, "ppo", None)
        if ppo is not None and ppo.tis_cap is None and ppo.mis_bound is None:
            raise ConfigError(f"{k} trains on rollouts of older weights: set --model.ppo.tis_cap (e.g. 2.0) and / or "
                              f"--model.ppo.mis_bound to weigh them by proximal / behaviour policy (the decoupled "
                              f"objective; without it the update ignores how stale they are)")

    @override
    def teardown(self, stage: str) -> None:
        """Stop the background rollouts and an engine that runs in its own process."""
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None
        if stage == "fit":
            self.engine.close()

    # ---------------------------------------------------------------------------------------- training
    def next_rollout(self) -> RolloutBatch:
        """This iteration's batch: a fresh rollout every ``rollout_every_n_steps`` calls, else the last one; with
        ``max_staleness`` the oldest rollout played ahead (a checkpoint's first, on resume)."""
        if self.max_staleness and self.ahead is None:
            self.ahead = RolloutsAhead(lambda i: self.play(i, sync=False), lambda: self.sync_engine(self._sync_binding()),
                                       self.engine, self.max_staleness, self.iteration)
        if self.ahead is not None:
            self._sync_binding()
            step = self.trainer.global_step
            played = Played.from_state(self._restored.pop(0)) if self._restored else self.ahead.take(step)
            self.ahead.refill(step)
            self.iteration = self.ahead.next_iteration  # (queued: played or playing)
            self._taken = played
            return self.finish_rollout(played, step)
        if self._last is not None and self._steps_since_rollout < self.rollout_every_n_steps:
            self._steps_since_rollout += 1
            return self._last
        self._unfinished = self._rollout_start()
        self._last = self.play_training_rollout()
        self._steps_since_rollout = 1
        return self._last

    def _rollout_start(self) -> tuple[int, dict[str, Any]]:
        """The training step a fresh rollout is for, and what the data module's checkpoint holds before it."""
        import copy

        step = self.trainer.global_step if getattr(self, "trainer", None) is not None else -1
        return step, {"iteration": self.iteration, "engine": copy.deepcopy(self.engine.state_dict()),
                      "empty_filters": self.empty_filters}

    def rewind_unfinished_rollout(self, global_step: int) -> bool:
        """Undo a rollout whose training step did not complete (a stop signal or an error mid-iteration): the seed
        counter and the sampling state go back to before it, so that a checkpoint saved now resumes with that very
        rollout (with ``max_staleness``, the rollout itself goes back to the front of the ones played ahead). Whether
        there was one to undo."""
        if self.ahead is not None:
            self._stopping = True  # the checkpoint saved now does not wait for the rollouts in flight
            taken, self._taken = self._taken, None
            if taken is None or taken.step != global_step:
                return False
            self._restored.insert(0, taken.state())
            self.empty_filters = taken.empty_filters_before
            return True
        unfinished, self._unfinished = self._unfinished, None
        if unfinished is None or unfinished[0] != global_step:
            return False
        state = unfinished[1]
        self.iteration, self.empty_filters = state["iteration"], state["empty_filters"]
        self.engine.load_state_dict(state["engine"])
        self._last, self._steps_since_rollout = None, 0
        return True

    def training_specs(self, iteration: int) -> list[EpisodeSpec]:
        """This rank's episodes of training iteration ``iteration``: its share of the groups, ``group_size`` each."""
        rank, world = self.world
        local = self.n_groups // world
        first_group = iteration * self.n_groups + rank * local
        return [EpisodeSpec(self.envs[g % len(self.envs)], seed=self.seed + g, group_id=g)
                for g in range(first_group, first_group + local) for _ in range(self.group_size)]

    def play(self, iteration: int, sync: bool = True) -> Played:
        """Play training iteration ``iteration`` on this rank (no collective: a background thread may run it)."""
        result = self._collect(self.training_specs(iteration), sync=sync)
        metrics = rollout_metrics(result.episodes, by_tag=self.by_tag)
        for k, v in result.timings.items():
            metrics[f"time/rollout_{k}"] = torch.tensor(v)
        return Played(iteration, result.batch, metrics, _failed(result), len(result.episodes), result)

    def play_training_rollout(self) -> RolloutBatch:
        played = self.play(self.iteration)
        self.iteration += 1
        return self.finish_rollout(played)

    def finish_rollout(self, played: Played, step: int | None = None) -> RolloutBatch:
        """Count the failures over the ranks, filter and pad ``played`` (collectives: every rank, the trainer's
        thread)."""
        metrics = dict(played.metrics)
        where = f"training iteration {played.iteration}"
        failed, played_n = self._check_failures(played.failures, played.played, f"trajectory of {where}", where)
        metrics["rollout/failed"], metrics["rollout/played"] = torch.tensor(failed), torch.tensor(played_n)
        batch = played.batch
        if batch is None:  # every episode of this rank failed, not of all (else _check_failures said so)
            raise RolloutError(f"every trajectory of training iteration {played.iteration} failed on rank "
                               f"{self.world[0]}; {_failures(played.failures)}")
        if played.version is not None and step is not None:
            behind = step - played.version
            if behind > self.max_staleness:  # RolloutsAhead guarantees it; a bug if not
                raise RuntimeError(f"training iteration {played.iteration} was sampled {behind} updates ago, more "
                                   f"than --data.max_staleness={self.max_staleness}")
            batch.policy_versions = torch.full((len(batch),), played.version, dtype=torch.long)
            self._staleness_max = max(self._staleness_max, behind)
            metrics["async/staleness"] = torch.tensor(float(behind))
            metrics["async/staleness_max"] = torch.tensor(float(self._staleness_max))
            metrics["async/rollout_wait_s"] = torch.tensor(played.waited)
        played.empty_filters_before, played.step = self.empty_filters, step
        t0 = time.perf_counter()
        keep, filter_metrics = self._filter(batch)
        metrics.update(filter_metrics)
        metrics["time/filter"] = torch.tensor(time.perf_counter() - t0)
        kept = float(filter_metrics["filter/kept_frac"])  # of every rank's groups
        batch = self._pad_for_ranks(batch, keep)
        batch.loss_scale = self.filter.loss_scale(kept)
        self.empty_filters = self.empty_filters + 1 if kept == 0 else 0
        metrics["filter/empty_in_a_row"] = torch.tensor(float(self.empty_filters))
        stop = self.filter.empty_stop_steps
        if stop is not None and self.empty_filters >= stop and getattr(self, "trainer", None) is not None:
            rank_zero_warn(f"the filter kept no group in {self.empty_filters} iterations in a row "
                           f"(`--data.filter.empty_stop_steps` {stop}): stopping training")
            self.trainer.should_stop = True
        return RolloutBatch(batch, metrics, played.result or _result_of(played), empty=kept == 0)

    def _collect(self, specs: list[EpisodeSpec], temperature: float | None = None, sync: bool = True,
                 progress: Callable[[int, int], Any] | None = None) -> RolloutResult:
        """Play with the engine awake, and let it free its memory again afterwards (vLLM's sleep mode). ``sync``:
        first bind the policy again if the strategy replaced it and hand the engine the current weights (the
        trainer's thread; a background rollout gets its weights from :class:`RolloutsAhead`)."""
        assert self.collector is not None, "setup() binds the engine first"
        if sync:
            module = self._sync_binding()
            if module is not None:
                self.sync_engine(module)
        self.engine.wake_up()
        try:
            return self.collector.collect(specs, temperature=temperature, progress=progress)
        finally:
            self.engine.sleep()

    def _sync_binding(self):
        """The module, after binding the engine again if the strategy replaced the policy after ``setup`` (FSDP1
        wraps it in ``configure_model``)."""
        module = self.trainer.lightning_module if getattr(self, "trainer", None) is not None else None
        if module is not None and self._bound is not module.policy:
            self._bind(module)
        return module

    def _bind(self, module) -> None:
        self.engine.bind(module.policy, module.tokenizer)
        self._bound = module.policy

    def sync_engine(self, module) -> None:
        """Hand the policy's weights to an engine that holds its own copy (``holds_weights``), if they changed since
        it got them.

        The module counts its weight changes (``weights_version``: optimiser steps, checkpoint loads); an engine
        has never been given weights at first, so the first rollout or evaluation (a resumed run, a validation from
        a checkpoint) syncs before it samples. On several processes every rank calls this at the same points
        (gathering sharded weights is collective).
        """
        if not self.engine.holds_weights:
            return
        version = module.weights_version
        if version == self._engine_weights:
            return
        if getattr(self.engine, "takes_adapters", False):  # the LoRA adapters alone (a server's sync=lora)
            if module.lora is None or getattr(module, "hooks", None):
                raise ConfigError("`--data.engine.sync=lora` sends the LoRA adapters alone: it needs --model.lora "
                                  "and no --model.hooks (their changes live outside the adapters)")
            self.engine.load_adapter(module.policy)
        else:
            with module.policy_weights() as weights:  # one tensor at a time, to an engine that streams them
                self.engine.load_weights(weights if getattr(self.engine, "streams_weights", False) else dict(weights))
        self._engine_weights = version

    def _filter(self, batch: TrajectoryBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """(B,) kept rows: the filter keeps whole groups of trajectories (and so every row of a trajectory)."""
        stats = batch.stats()
        rows, _ = batch.trajectory_index()
        rank, world = self.world
        if world == 1:
            out = self.filter(stats)
            return out.keep[rows], out.metrics
        # Gather every rank's small per-trajectory stats (ranks may hold different numbers), filter them together.
        device = self.trainer.strategy.root_device
        entropy = stats.entropy.double() if stats.entropy is not None else torch.full_like(stats.scores, math.nan).double()
        mine = torch.stack([stats.scores.double(), stats.group_ids.double(), stats.lengths.double(), entropy], -1)
        gathered = gather_rows(mine, device)  # (n_rank, 4) each
        flat = torch.cat(gathered)
        everyone = TrajectoryStats(flat[:, 0], flat[:, 1].long(), flat[:, 2].long(),
                                   None if bool(flat[:, 3].isnan().any()) else flat[:, 3])
        out = self.filter(everyone)
        start = sum(len(g) for g in gathered[:rank])
        return out.keep[start:start + len(stats)][rows], out.metrics

    def _pad_for_ranks(self, batch: TrajectoryBatch, keep: Tensor) -> TrajectoryBatch:
        """Keep the filtered rows, then pad with masked-out rows to the largest kept count over ranks."""
        kept = batch.select(keep)
        target = len(kept)
        if self.world[1] > 1:
            target = max_over_processes(target, self.trainer.strategy.root_device)
        target = max(target, 1)
        if len(kept) == target:
            return kept
        filler = batch.select(torch.zeros(target - len(kept), dtype=torch.long))  # copies of row 0 ...
        filler.loss_mask = torch.zeros_like(filler.loss_mask)  # ... that carry no loss,
        filler.rewards = torch.zeros_like(filler.rewards)
        # ... and sit in groups of their own, so group statistics (GRPO, RLOO, reward norm) never see them.
        filler.group_ids = -1 - torch.arange(len(filler), dtype=filler.group_ids.dtype)
        if filler.traj_ids is not None:
            filler.traj_ids = -1 - torch.arange(len(filler), dtype=filler.traj_ids.dtype)
        if len(kept) == 0:
            return filler
        return TrajectoryBatch.cat(kept, filler)  # both come from `batch`, so they share its padded length T

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(self.next_rollout), batch_size=None, num_workers=0)

    # -------------------------------------------------------------------------------------- evaluation
    def eval_seeds(self) -> range:
        """This rank's share of the fixed evaluation seeds (every ``world``-th one)."""
        rank, world = self.world
        return range(self.val_seed + rank, self.val_seed + self.val_episodes, world)

    def evaluate(self, env: Env, prefix: str) -> dict[str, Tensor]:
        """Play this rank's share of the fixed evaluation episodes of ``env``; return its metrics."""
        specs = [EpisodeSpec(env, seed=s, group_id=s) for s in self.eval_seeds()]
        # with rollouts ahead: the engine between two background rollouts, with the current weights
        idle = self.ahead.engine_idle() if self.ahead is not None else nullcontext()
        with self._episode_bar(len(specs), f"{prefix}/{env.tag}") as bar, idle:
            result = self._collect(specs, temperature=self.val_temperature, progress=bar)
            if self.ahead is not None:
                self.ahead.engine_step = self.trainer.global_step
        failed, played = self._check_failures(_failed(result), len(result.episodes),
                                              f"{prefix} episode of env {env.tag!r}", f"env {env.tag!r}")
        metrics = rollout_metrics(result.episodes, prefix=f"{prefix}/{env.tag}")
        references = self.reference_success(env)
        for name, value in references.items():
            metrics[f"{prefix}/{env.tag}/{name}"] = torch.tensor(value)
        share = f" (rank 0's share; the logged value averages all {self.world[1]} ranks)" if self.world[1] > 1 else ""
        counted = sum(ep.failed is None for ep in result.episodes)  # what the success share averages
        lost = f"; {int(failed)} of {int(played)} episodes failed and are not counted" if failed else ""
        beside = ", ".join(f"{name.split('_')[0]} policy {value:.3f}" for name, value in references.items())
        rank_zero_info(f"{prefix}/{env.tag}: success {float(metrics[f'{prefix}/{env.tag}/success']):.3f} over "
                       f"{counted} episodes{f' ({beside} on the same seeds)' if beside else ''}{share}{lost}")
        self.eval_results[env.tag] = result
        return metrics

    @contextmanager
    def _episode_bar(self, total: int, name: str) -> Iterator[Callable[[int, int], Any] | None]:
        """A progress bar of the evaluation, on rank 0 of a trainer that shows progress bars (an evaluation of 256
        episodes runs for minutes; Lightning's own bar counts it as one batch). It counts episode-turns, each ended
        episode as its whole turn budget, so its time left holds though most episodes end only at the last turn; the
        episodes ended so far stand beside it."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or trainer.progress_bar_callback is None or not trainer.is_global_zero:
            yield None
            return
        turns = self.rollout_config.max_turns
        bar = tqdm(total=total * turns, desc=f"{name} episode turns", unit="turn", leave=False, dynamic_ncols=True,
                   postfix=f"0/{total} episodes ended")

        def update(ended: int, done: int) -> None:  # once a turn: a refresh each
            bar.update(done - bar.n)
            bar.set_postfix_str(f"{ended}/{total} episodes ended")

        try:
            yield update
        finally:
            bar.close()

    def reference_success(self, env: Env) -> dict[str, float]:
        """The random and the optimal policy's success on this rank's evaluation seeds of ``env`` with the rollout's
        action budget (:func:`ragen_pl.baselines.reference_success`), computed at the first evaluation and kept."""
        seeds = self.eval_seeds()
        budget = self.rollout_config.max_actions_per_episode
        key = (env.tag, seeds.start, seeds.stop, seeds.step, budget)
        if key not in self._references:
            self._references[key] = reference_success(env, seeds, budget)
        return self._references[key]

    def _check_failures(self, failures: list[tuple[str, int, str]], played: int, what: str, where: str
                        ) -> tuple[float, float]:
        """Count the failed episodes (``failures``: env tag, seed and reason of each, of ``played`` episodes) over
        every process (every rank plays its share at the same point); warn once per env with its first error; stop
        the run in one line (:class:`RolloutError`) when every ``what`` failed or more than ``max_failed_share`` of
        them did (in ``where``). Returns (failed, played) over every process."""
        trainer = getattr(self, "trainer", None)
        device = trainer.strategy.root_device if trainer is not None else "cpu"
        counts = sum_over_processes(torch.tensor([float(len(failures)), float(played)], device=device))
        failed, played = float(counts[0]), float(counts[1])
        for tag, seed, reason in failures:
            if tag not in self._warned_failures:
                self._warned_failures.add(tag)
                rank_zero_warn(f"env {tag!r}: episodes fail (left out of the batch and counted as "
                               f"`failed_envs`); the first: seed {seed}: {reason}")
        if played and failed == played:
            raise RolloutError(f"every {what} failed; {_failures(failures)}")
        if played and failed / played > self.max_failed_share:
            raise RolloutError(f"{int(failed)} of {int(played)} episodes failed ({where}), more "
                               f"than --data.max_failed_share={self.max_failed_share:g}; {_failures(failures)}")
        return failed, played

    def _eval_loaders(self, prefix: str) -> list[DataLoader]:
        return [DataLoader(_Once(lambda env=env: self.evaluate(env, prefix)), batch_size=None, num_workers=0)
                for env in self.val_envs]

    @override
    def val_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders("val")

    @override
    def test_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders("test")

    # ---------------------------------------------------------------------------------- checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        """The env seed counter and the engine's sampling state: every rank's (each samples its own stream), gathered
        from all ranks. Lightning calls this on every rank when it saves and writes rank 0's copy."""
        state: dict[str, Any] = {"iteration": self.iteration}
        engine = self.engine.state_dict() if self.ahead is None else None
        if self.ahead is not None:  # the rollouts played ahead, and the stream after them
            ahead = self.ahead.state(wait=not self._stopping)
            state.update(iteration=ahead["iteration"], ahead=self._restored + ahead["ahead"],
                         max_staleness=self.max_staleness)
            engine = ahead["engine"]
        by_rank = gather_objects(engine)
        state["engine"] = by_rank[0]  # where checkpoints of one process kept it before
        state["engine_by_rank"] = by_rank
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.iteration = state_dict["iteration"]
        ahead = state_dict.get("ahead") or []
        saved = state_dict.get("max_staleness", 0)
        if ahead and self.max_staleness < saved:  # (a stopped step's rollout is kept too: up to K + 1 of them)
            raise ConfigError(f"the checkpoint holds {len(ahead)} rollout(s) played up to {saved} updates ahead "
                              f"(--data.max_staleness={saved}); resume with --data.max_staleness >= {saved} (it "
                              f"trains on them first), got {self.max_staleness}")
        self._restored = list(ahead)
        if "engine" in state_dict:
            rank, world = self.world
            by_rank = state_dict.get("engine_by_rank", [state_dict["engine"]])
            if len(by_rank) == world:
                self.engine.load_state_dict(by_rank[rank])
            else:
                rank_zero_warn(f"the checkpoint holds the sampling state of {len(by_rank)} process(es) and this run "
                               f"has {world}: sampling restarts from the engine's seed")
        # A reused rollout is not checkpointed: resuming mid-reuse starts a fresh rollout.
        self._last = None
        self._steps_since_rollout = 0


def _result_of(played: Played) -> RolloutResult:
    """A rollout restored from a checkpoint: its batch, without the episodes (their envs are not kept)."""
    return RolloutResult(played.batch, [], {})


def _failed(result: RolloutResult) -> list[tuple[str, int, str]]:
    """(env tag, seed, reason) of each failed episode of ``result``."""
    return [(ep.env.tag, ep.spec.seed, str(ep.failed)) for ep in result.episodes if ep.failed is not None]


def _failures(failures: list[tuple[str, int, str]], shown: int = 3) -> str:
    """The distinct reasons episodes failed, most common first (each names the env's own error)."""
    from collections import Counter

    counts = Counter(f"{tag}: {reason}" for tag, _, reason in failures)
    reasons = "; ".join(f"{reason} (x{n})" for reason, n in counts.most_common(shown))
    return f"the envs said: {reasons}" if reasons else "no episode was played"
