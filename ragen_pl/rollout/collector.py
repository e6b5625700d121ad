"""The multi-turn rollout loop: many envs played in parallel by the current policy, turned into a TrajectoryBatch.

Exact token accounting (:mod:`ragen_pl.rollout.chat`): the batch holds the very ids that were fed and sampled,
``loss_mask`` is true exactly on sampled ids, and ``rollout_logprobs`` holds the engine's log-prob of each.

Each turn is one engine call over all live envs; finished envs leave the batch. An env that raises, or whose step
runs past ``step_timeout_s``, marks its trajectory failed: it is left out of the batch and counted.

Context: no prompt reaches the engine unless it leaves ``max_new_tokens`` under the context limit (the model's
context, or ``--data.rollout.max_seq_len``). A first prompt that does not fit is a setup error naming the env and the
lengths; a later turn that would not fit is not played: its trajectory ends, truncated (counted in the
``truncated`` metric, and warned once per env).
"""

from __future__ import annotations

import copy
import math
import numbers
import queue
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ragen_pl.config import RolloutConfig
from ragen_pl.envs.base import Env, anchor_state
from ragen_pl.errors import ConfigError
from ragen_pl.rollout.chat import ChatTokens, WindowChat
from ragen_pl.rollout.engine import RolloutEngine, SamplingParams
from ragen_pl.rollout.prompt import first_user_message, format_instruction, next_user_message, parse_answer
from ragen_pl.types import TrajectoryBatch


def sampling_params(config: RolloutConfig, temperature: float | None = None) -> SamplingParams:
    """The engine's sampling settings of ``config`` (``temperature`` overrides it, as evaluation does)."""
    return SamplingParams(temperature=config.temperature if temperature is None else temperature,
                          top_p=config.top_p, top_k=config.top_k, max_new_tokens=config.max_new_tokens,
                          stop=["</answer>"])


@dataclass
class EpisodeSpec:
    """One trajectory to play: an env (a fresh copy is made), its seed, its group."""

    env: Env
    seed: int
    group_id: int


class EnvFailure(RuntimeError):
    pass


@contextmanager
def _alarm(seconds: float):
    """Raise EnvFailure if the block runs longer than ``seconds`` (a SIGALRM: the main thread only)."""

    def handler(signum, frame):
        raise EnvFailure(f"env call ran past {seconds}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class _EnvThread:
    """A daemon thread that makes env calls for a rollout running off the main thread, where no SIGALRM can cut one
    (the background rollout of ``--data.max_staleness`` >= 1). The caller waits at most the time limit; past it the
    call is abandoned with its env (closed on this thread if the call ever returns) and the thread with them."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="ragen-pl-env-calls", daemon=True).start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, out, done = job
            try:
                out.append((True, fn()))
            except BaseException as err:  # noqa: BLE001 - handed to the caller, raised there
                out.append((False, err))
            done.set()

    def call(self, fn: Callable[[], Any], seconds: float) -> tuple[bool, Any]:
        """``(True, (ok, value))`` once ``fn`` returned or raised within ``seconds``, else ``(False, None)``."""
        out: list = []
        done = threading.Event()
        self.jobs.put((fn, out, done))
        return (True, out[0]) if done.wait(seconds) else (False, None)

    def abandon(self, cleanup: Callable[[], Any]) -> None:
        """Run ``cleanup`` after the hung call, if it ever returns, then end the thread."""
        self.jobs.put((cleanup, [], threading.Event()))
        self.jobs.put(None)


@dataclass
class Episode:
    spec: EpisodeSpec
    env: Env
    chat: ChatTokens | WindowChat | None = None
    rewards: dict[tuple[int, int], float] = field(default_factory=dict)
    """(row, token position) -> reward."""
    response_tokens: int = 0
    done: bool = False
    failed: str | None = None
    abandoned: bool = False
    """An env call of this episode ran past the time limit off the main thread: its env is left to that call."""
    success: bool = False
    env_return: float = 0.0
    turns: int = 0
    actions: int = 0
    valid_actions: int = 0
    effective_actions: int = 0
    format_errors: int = 0
    truncated: bool = False
    states: list[int] = field(default_factory=list)
    """The id of the state each turn started in (:func:`~ragen_pl.envs.base.state_id`)."""
    transcript: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RolloutResult:
    batch: TrajectoryBatch | None
    """The successful trajectories (None if every one failed)."""
    episodes: list[Episode]
    """Every episode, failed ones included, in spec order; ``batch`` rows follow the non-failed ones."""
    timings: dict[str, float]
    """Seconds spent in generation, env steps and tokenisation."""


def model_context(model) -> int | None:
    """The positions a transformers model was built for (``config.max_position_embeddings``), if it says."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) else None


def context_limit(config: RolloutConfig, model_context: int | None) -> int:
    """The tokens a prompt and its answer may fill: ``--data.rollout.max_seq_len``, else the model's context.

    Raises:
        ConfigError: ``max_seq_len`` past the model's context, or neither is known.
    """
    if config.max_seq_len is not None:
        if model_context is not None and config.max_seq_len > model_context:
            raise ConfigError(f"`--data.rollout.max_seq_len` ({config.max_seq_len}) must be <= the model's context "
                              f"({model_context} positions)")
        return config.max_seq_len
    if model_context is None:
        raise ConfigError("the model's context length is unknown: set `--data.rollout.max_seq_len`")
    if model_context <= config.max_new_tokens:
        raise ConfigError(f"`--data.rollout.max_new_tokens` ({config.max_new_tokens}) must be smaller than the "
                          f"model's context ({model_context} positions)")
    return model_context


class Collector:
    """Plays episodes with an engine and assembles the update batch.

    ``max_seq_len`` is the context limit (:func:`context_limit`); without it, ``--data.rollout.max_seq_len``, else
    the context of the engine's bound model, else the tokenizer's ``model_max_length``.
    """

    def __init__(self, engine: RolloutEngine, tokenizer, config: RolloutConfig | None = None,
                 max_seq_len: int | None = None) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config or RolloutConfig()
        eos = tokenizer.eos_token_id
        self._eos = {eos} if eos is not None else set()
        if max_seq_len is None:
            known = model_context(engine.model)
            if known is None:
                known = getattr(tokenizer, "model_max_length", None)
                known = known if isinstance(known, int) and known < 10**8 else None
            max_seq_len = context_limit(self.config, known)
        self.max_seq_len = max_seq_len
        self._warned: set[str] = set()
        self._env_threads: dict[int, _EnvThread] = {}  # per rollout under way off the main thread

    def _format(self) -> str:
        c = self.config
        return format_instruction(c.think, c.max_actions_per_turn, c.max_new_tokens)

    def _limited(self, ep: Episode, calls: Callable[[], Any]) -> Any:
        """``calls()`` (env calls of ``ep``) within ``--data.rollout.step_timeout_s``, else EnvFailure.

        On the main thread a SIGALRM cuts the call. Off it (the background rollout of ``--data.max_staleness`` >= 1)
        the calls run on an env thread of the rollout's own, and the rollout stops waiting at the limit whatever the
        call does (a Python loop, a C call, a sleep): the call goes on by itself with an env no one touches again.
        """
        seconds = self.config.step_timeout_s
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            with _alarm(seconds):
                return calls()
        me = threading.get_ident()
        worker = self._env_threads.get(me) or self._env_threads.setdefault(me, _EnvThread())
        finished, result = worker.call(calls, seconds)
        if not finished:
            del self._env_threads[me]
            ep.abandoned = True
            worker.abandon(lambda: _close(ep))
            raise EnvFailure(f"env call ran past {seconds}s")
        ok, value = result
        if not ok:
            raise value
        return value

    def collect(self, specs: Sequence[EpisodeSpec], temperature: float | None = None,
                progress: Callable[[int, int], Any] | None = None) -> RolloutResult:
        """Play ``specs`` turn by turn, every live episode in one engine call per turn. ``progress`` is called after
        a turn with the episodes ended so far and the episode-turns done so far, of ``len(specs) * max_turns``: the
        turns each live episode has played and the whole turn budget of each that ended (a bar of these shows an
        honest time left; most episodes end only at the last turn)."""
        c = self.config
        reported = (0, 0)

        def report(played: int) -> None:
            nonlocal reported
            if progress is None:
                return
            ended = sum(ep.done for ep in episodes)
            now = (ended, ended * c.max_turns + (len(episodes) - ended) * played)
            if now != reported:
                progress(*now)
            reported = now

        timings = {"generate": 0.0, "env": 0.0, "tokenize": 0.0}
        episodes = []
        for spec in specs:
            ep = Episode(spec, _fresh_copy(spec.env))
            t0 = time.perf_counter()
            try:
                obs = self._limited(ep, lambda ep=ep, seed=spec.seed: _checked_observation(ep.env.reset(seed), "reset"))
            except Exception as err:  # noqa: BLE001 - a broken env must not stop the rollout
                ep.failed, ep.done = f"reset: {type(err).__name__}: {err}", True
                episodes.append(ep)
                continue
            t1 = time.perf_counter()
            first = first_user_message(ep.env.instructions, obs, c.max_actions_per_episode, self._format(),
                                       c.turn_header)
            if c.context_window is None:
                ep.chat = ChatTokens(self.tokenizer, c.system_prompt, first, c.think)
            else:
                ep.chat = WindowChat(self.tokenizer, c.system_prompt, first, c.think, ep.env.instructions,
                                     c.context_window)
            length = len(ep.chat.prompt_ids())
            if length + c.max_new_tokens > self.max_seq_len:
                raise ConfigError(
                    f"env {ep.env.tag!r} (seed {spec.seed}): its first prompt is {length} tokens, which with "
                    f"`--data.rollout.max_new_tokens` ({c.max_new_tokens}) passes the context limit of "
                    f"{self.max_seq_len} tokens (the model's context or `--data.rollout.max_seq_len`)")
            ep.transcript.append({"role": "env", "observation": obs})
            timings["env"] += t1 - t0
            timings["tokenize"] += time.perf_counter() - t1
            episodes.append(ep)

        params = sampling_params(c, temperature)
        try:
            for turn in range(c.max_turns):
                live = [ep for ep in episodes if not ep.done]
                t1 = time.perf_counter()
                prompts = [ep.chat.prompt_ids() for ep in live]  # type: ignore[union-attr]
                t0 = time.perf_counter()
                timings["tokenize"] += t0 - t1
                self.engine.next_call_extends(turn + 1 < min(c.max_turns, c.context_window or c.max_turns))
                gens = self.engine.generate(prompts, params)
                timings["generate"] += time.perf_counter() - t0
                for ep, gen in zip(live, gens):
                    self._play_turn(ep, gen, turn, timings)
                report(turn + 1)
        finally:
            self.engine.end_rollout()
            for ep in episodes:
                if not ep.abandoned:  # on the thread that played it, within the limit
                    _close(ep, lambda ep=ep: self._limited(ep, ep.env.close))
            if (worker := self._env_threads.pop(threading.get_ident(), None)) is not None:
                worker.jobs.put(None)  # the env thread lives as long as the rollout
        for ep in episodes:
            if not ep.done:
                ep.done = True
        report(c.max_turns)
        t0 = time.perf_counter()
        batch = self._assemble([ep for ep in episodes if ep.failed is None])
        timings["tokenize"] += time.perf_counter() - t0
        if batch is not None:  # greedy (0) reports and scores the untempered distribution
            batch.temperature = params.temperature if params.temperature > 0 else 1.0
        return RolloutResult(batch, episodes, timings)

    def _play_turn(self, ep: Episode, gen, turn: int, timings: dict[str, float]) -> None:
        c = self.config
        chat = ep.chat
        assert chat is not None
        t0 = time.perf_counter()
        chat.add_response(gen.token_ids, turn, gen.logprobs, gen.kept)
        ep.response_tokens += len(gen.token_ids)
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        parsed = parse_answer(text, think=c.think, max_actions=c.max_actions_per_turn)
        timings["tokenize"] += time.perf_counter() - t0
        ep.turns += 1
        penalised = not parsed.format_ok
        t0 = time.perf_counter()
        try:
            played = self._limited(ep, lambda: _play_actions(ep.env, ep.transcript[-1]["observation"], parsed.actions,
                                                             c.max_actions_per_episode - ep.actions,
                                                             c.count_invalid_actions))
        except Exception as err:  # noqa: BLE001 - a broken env must not stop the rollout
            ep.failed, ep.done = f"step: {type(err).__name__}: {err}", True
            timings["env"] += time.perf_counter() - t0
            return
        state, executed, reward, invalid, counted, effective, success, done, obs = played
        ep.states.append(state)
        ep.actions += counted
        ep.valid_actions += len(executed)
        ep.effective_actions += effective
        ep.success = ep.success or success
        ep.done = ep.done or done
        penalised = penalised or invalid
        timings["env"] += time.perf_counter() - t0
        ep.env_return += reward
        ep.format_errors += penalised
        turn_reward = reward + (c.format_penalty if penalised else 0.0)
        # Engines return at least one token per call, so the turn's reward has a sampled token to sit on.
        last = chat.last_sampled()
        ep.rewards[last] = ep.rewards.get(last, 0.0) + turn_reward
        ep.transcript.append({"role": "model", "text": chat.open_tag + text, "actions": executed,
                              "answered": parsed.actions, "think": parsed.think, "reward": turn_reward,
                              "format_ok": parsed.format_ok})
        ep.transcript.append({"role": "env", "observation": obs})
        if ep.actions >= c.max_actions_per_episode or turn == c.max_turns - 1:
            ep.done = True
        if ep.done:
            return
        t0 = time.perf_counter()
        message = next_user_message(turn + 2, turn_reward, obs, c.max_actions_per_episode - ep.actions, self._format(),
                                    c.turn_header)
        ended_eos = bool(gen.token_ids) and gen.token_ids[-1] in self._eos
        if not chat.extend_user(message, ended_eos, max_prompt=self.max_seq_len - c.max_new_tokens):
            ep.done, ep.truncated = True, True
            if ep.env.tag not in self._warned:
                self._warned.add(ep.env.tag)
                warnings.warn(f"env {ep.env.tag!r}: a trajectory ended truncated before turn {turn + 2}, whose prompt "
                              f"would leave less than `--data.rollout.max_new_tokens` ({c.max_new_tokens}) under "
                              f"the context limit ({self.max_seq_len} tokens); counted in rollout/truncated "
                              f"(warned once per env)", stacklevel=2)
        timings["tokenize"] += time.perf_counter() - t0

    def _assemble(self, episodes: list[Episode]) -> TrajectoryBatch | None:
        """Rows of the update batch: one per trajectory, or one per turn with a context window."""
        rows = [(e, r, row) for e, ep in enumerate(episodes) for r, row in enumerate(ep.chat.rows())]  # type: ignore[union-attr]
        if not rows:
            return None
        c = self.config
        B, T = len(rows), max(len(row[0]) for _, _, row in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((B, T), pad, dtype=torch.long)
        attention = torch.zeros((B, T), dtype=torch.bool)
        loss_mask = torch.zeros((B, T), dtype=torch.bool)
        turn_ids = torch.full((B, T), -1, dtype=torch.long)
        rewards = torch.zeros((B, T), dtype=torch.float32)
        logprobs = torch.zeros((B, T), dtype=torch.float32)
        states = torch.zeros((B, T), dtype=torch.long)
        width = max((len(k) for _, _, row in rows for k in row[4] if k is not None), default=0)
        kept = torch.full((B, T, width), -1, dtype=torch.int32) if width else None
        for b, (e, r, (ids, sampled, turns, lps, sets)) in enumerate(rows):
            n = len(ids)
            input_ids[b, :n] = torch.tensor(ids)
            attention[b, :n] = True
            loss_mask[b, :n] = torch.tensor(sampled)
            turn_ids[b, :n] = torch.tensor(turns)
            logprobs[b, :n] = torch.tensor(lps, dtype=torch.float32)
            if kept is not None:
                for t, ids_t in enumerate(sets):
                    if ids_t:
                        kept[b, t, :len(ids_t)] = torch.tensor(ids_t, dtype=torch.int32)
            ep = episodes[e]
            states[b, :n] = torch.tensor([ep.states[t] if t >= 0 else 0 for t in turns], dtype=torch.long)
            if c.reward_placement == "turn":
                for (row, pos), reward in ep.rewards.items():
                    if row == r:
                        rewards[b, pos] = reward
            elif ep.rewards and max(ep.rewards)[0] == r:
                rewards[b, max(ep.rewards)[1]] = sum(ep.rewards.values())
        windowed = c.context_window is not None
        return TrajectoryBatch(
            input_ids=input_ids,
            attention_mask=attention,
            loss_mask=loss_mask,
            rewards=rewards,
            turn_ids=turn_ids,
            group_ids=torch.tensor([episodes[e].spec.group_id for e, _, _ in rows], dtype=torch.long),
            env_tags=tuple(episodes[e].env.tag for e, _, _ in rows),
            traj_ids=torch.tensor([e for e, _, _ in rows], dtype=torch.long) if windowed else None,
            rollout_logprobs=logprobs,
            sampling_masks=kept,
            turn_states=states,
        )


def _play_actions(env: Env, observation: str, actions: Sequence[str], budget: int, count_invalid: bool):
    """One turn's actions on ``env`` (at most ``budget`` counted), touching nothing but the env.

    Returns the id of the state the turn started in, the executed actions, their reward, whether an action was
    invalid, the actions counted against the budget, the effective ones, success, done and the new observation.
    """
    state = anchor_state(env, observation)
    executed: list[str] = []
    reward, invalid, counted, effective, success, ended = 0.0, False, 0, 0, False, False
    for action in actions:
        if counted >= budget:
            break
        obs, r, done, info = env.step(action)
        _checked_observation(obs, "step")
        if not isinstance(r, numbers.Real) or not math.isfinite(r):
            raise ValueError(f"reward must be a finite number, got {r!r}")
        valid = bool(info.get("action_is_valid", True))
        counted += valid or count_invalid
        if not valid:
            invalid = True  # an invalid action: no env step, format penalty
            continue
        executed.append(action)
        effective += bool(info.get("action_is_effective", False))
        reward += float(r)
        success = success or bool(info.get("success", False))
        if done:
            ended = True
            break
    obs = _checked_observation(env.render(), "render")
    return state, executed, reward, invalid, counted, effective, success, ended, obs


def _close(ep: Episode, closing: Callable[[], Any] | None = None) -> None:
    """End the episode's env (its session, if it holds one) with ``closing`` (default: ``ep.env.close``); a failure
    to close fails nothing already played."""
    try:
        (closing or ep.env.close)()
    except Exception as err:  # noqa: BLE001 - the trajectory is complete; say so and go on
        warnings.warn(f"env {ep.env.tag!r} (seed {ep.spec.seed}) failed to close: {type(err).__name__}: {err}",
                      stacklevel=2)


def _fresh_copy(env):
    """Each trajectory plays its own deep copy of the configured env; an env that cannot be copied is a setup error."""
    try:
        return copy.deepcopy(env)
    except Exception as err:
        raise ConfigError(
            f"env {type(env).__name__} (tag {getattr(env, 'tag', '?')!r}) cannot be deep-copied, and every trajectory "
            f"plays a fresh copy of it: {type(err).__name__}: {err}. Keep state such as locks, files or clients out "
            f"of __init__ (create it in reset) or define __deepcopy__"
        ) from err


def _checked_observation(obs, where: str) -> str:
    """Env output must be text: anything else fails the trajectory (counted), never the prompt or the batch."""
    if not isinstance(obs, str):
        raise TypeError(f"{where} must return the observation as str, got {type(obs).__name__}")
    return obs
