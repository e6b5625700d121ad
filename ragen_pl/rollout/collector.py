"""The multi-turn rollout loop: many envs played in parallel by the current policy, turned into a TrajectoryBatch.

Exact token accounting: a trajectory's token sequence is built from the very ids that were fed and sampled. The
first prompt and every env message are tokenised once and appended; the engine's sampled ids are appended as they
are, never decoded and re-tokenised (re-tokenising can merge or split tokens differently, so the update would
score tokens the policy never sampled). ``loss_mask`` is true exactly on sampled ids.

Each turn is one engine call over all live envs; finished envs leave the batch. An env that raises, or whose step
runs past ``step_timeout_s``, marks its trajectory failed: it is left out of the batch and counted.
"""

from __future__ import annotations

import copy
import math
import numbers
import signal
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ragen_pl.envs.base import Env
from ragen_pl.errors import ConfigError
from ragen_pl.rollout.engine import RolloutEngine, SamplingParams
from ragen_pl.rollout.prompt import (
    SYSTEM_PROMPT,
    first_user_message,
    format_instruction,
    next_user_message,
    parse_answer,
)
from ragen_pl.types import TrajectoryBatch

_SENTINEL = "\x00RAGEN_PL_SENTINEL\x00"


@dataclass
class RolloutConfig:
    """How trajectories are played. Defaults are the paper's."""

    max_turns: int = 5
    """Turns per trajectory."""
    max_actions_per_turn: int = 5
    """Actions executed from one answer; extra actions are ignored."""
    max_actions_per_episode: int = 10
    """Actions per trajectory across all turns."""
    count_invalid_actions: bool = False
    """Whether invalid actions use up ``max_actions_per_episode``. RAGEN drops them before counting (false);
    they still get the format penalty either way."""
    think: bool = True
    """Ask for ``<think>...</think><answer>...</answer>``; false asks for ``<answer>`` only."""
    format_penalty: float = -0.1
    """Added to a turn's reward when its answer does not parse or names an invalid action."""
    max_new_tokens: int = 400
    """Response tokens per turn."""
    temperature: float = 1.0
    """Sampling temperature in training."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 turns it off."""
    reward_placement: Literal["turn", "last_turn"] = "turn"
    """Put each turn's reward on that turn's last sampled token, or the whole return on the last turn's."""
    context_window: int | None = None
    """Keep only the last K turns in the prompt (the instructions always stay); each turn then trains as its own
    row. None keeps the whole conversation in one sequence."""
    max_seq_len: int = 4096
    """A trajectory whose tokens would pass this length ends (truncated) before the next turn."""
    step_timeout_s: float = 5.0
    """An env step or reset that runs longer fails its trajectory (enforced in the main thread on Unix)."""
    system_prompt: str = SYSTEM_PROMPT
    """The system message of every trajectory."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_actions_per_turn", "max_actions_per_episode", "max_new_tokens", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`rollout.{name}` must be an integer >= 1, got {value!r}")
        if self.reward_placement not in ("turn", "last_turn"):
            raise ValueError(f"`rollout.reward_placement` must be 'turn' or 'last_turn', got {self.reward_placement!r}")
        if self.context_window is not None and (isinstance(self.context_window, bool) or self.context_window < 1):
            raise ValueError(f"`rollout.context_window` must be an integer >= 1 or null, got {self.context_window!r}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"`rollout.step_timeout_s` must be > 0, got {self.step_timeout_s}")
        self.sampling_params()  # validates temperature, top_p, top_k

    def sampling_params(self, temperature: float | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature if temperature is None else temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop=["</answer>"],
        )


@dataclass
class EpisodeSpec:
    """One trajectory to play: an env (a fresh copy is made), its seed, its group."""

    env: Env
    seed: int
    group_id: int


class EnvFailure(RuntimeError):
    pass


@contextmanager
def _time_limit(seconds: float):
    """Raise EnvFailure if the block runs longer than ``seconds`` (main thread on Unix; else no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def handler(signum, frame):
        raise EnvFailure(f"env call ran past {seconds}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class ChatTokens:
    """Token ids of one conversation, built incrementally with exact sampled ids.

    ``ids`` is what the engine is fed next; ``sampled`` marks ids the policy produced; ``turn_ids`` gives the turn of
    each sampled id (-1 elsewhere).
    """

    def __init__(self, tokenizer, system: str, first_user: str, think: bool) -> None:
        self.tokenizer = tokenizer
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": first_user}]
        self.open_tag = "<think>" if think else "<answer>"
        text = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
        self.ids: list[int] = self._encode(text + self.open_tag)
        self.sampled: list[bool] = [False] * len(self.ids)
        self.turn_ids: list[int] = [-1] * len(self.ids)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def add_response(self, ids: Sequence[int], turn: int) -> None:
        self.ids.extend(ids)
        self.sampled.extend([True] * len(ids))
        self.turn_ids.extend([turn] * len(ids))
        self.messages.append({"role": "assistant", "content": _SENTINEL})

    def user_suffix_ids(self, text: str, ended_with_eos: bool) -> list[int]:
        """Ids that close the assistant turn, add a user message and open the next answer."""
        rendered = self.tokenizer.apply_chat_template(
            [*self.messages, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        suffix = rendered[rendered.rindex(_SENTINEL) + len(_SENTINEL):]
        eos_text = self.tokenizer.eos_token or ""
        if ended_with_eos and eos_text and suffix.startswith(eos_text):
            suffix = suffix[len(eos_text):]  # the model already sampled the end-of-turn token
        return self._encode(suffix + self.open_tag)

    def add_user(self, suffix_ids: Sequence[int], text: str) -> None:
        self.ids.extend(suffix_ids)
        self.sampled.extend([False] * len(suffix_ids))
        self.turn_ids.extend([-1] * len(suffix_ids))
        self.messages[-1] = {"role": "assistant", "content": "..."}  # content no longer matters, only the layout
        self.messages.append({"role": "user", "content": text})

    # The collector's view of a conversation (shared with WindowChat).
    def prompt_ids(self) -> list[int]:
        """What the engine is fed next."""
        return self.ids

    def extend_user(self, text: str, ended_with_eos: bool, max_prompt: int) -> bool:
        """Add the next user message, unless the next prompt would pass ``max_prompt`` tokens (then False)."""
        suffix = self.user_suffix_ids(text, ended_with_eos)
        if len(self.ids) + len(suffix) > max_prompt:
            return False
        self.add_user(suffix, text)
        return True

    def last_sampled(self) -> tuple[int, int]:
        """(row, position) of the newest sampled token: where a turn's reward goes."""
        return 0, len(self.ids) - 1

    def rows(self) -> list[tuple[list[int], list[bool], list[int]]]:
        """The training rows: (ids, sampled mask, turn ids). One row: the whole conversation."""
        return [(self.ids, self.sampled, self.turn_ids)]


class WindowChat:
    """A conversation whose prompt keeps only the last ``window`` turns (the instructions always stay).

    Each turn's prompt is rendered afresh, so a trajectory is no longer one token sequence: every turn becomes its
    own training row, made of exactly the prompt ids fed for that turn and the ids sampled after them.
    """

    def __init__(self, tokenizer, system: str, first_user: str, think: bool, instructions: str, window: int) -> None:
        self.tokenizer, self.system, self.instructions, self.window = tokenizer, system, instructions, window
        self.open_tag = "<think>" if think else "<answer>"
        self.history: list[tuple[int, str, str]] = []  # (turn, user text, assistant text), completed turns
        self.user = (0, first_user)
        self._rows: list[tuple[list[int], list[bool], list[int]]] = []
        self._prompt: list[int] | None = None
        self._pending: tuple[int, str, str] | None = None  # the turn just answered, until the next user message

    def _render(self, history: list[tuple[int, str, str]], user: tuple[int, str]) -> list[int]:
        kept = history[len(history) - (self.window - 1):] if self.window > 1 else []
        messages = [{"role": "system", "content": self.system}]
        for i, (turn, text, answer) in enumerate([*kept, (*user, None)]):
            if i == 0 and turn > 0:  # the first kept message carries the rules, as turn 1's does
                text = f"{self.instructions}\n\n{text}"
            messages.append({"role": "user", "content": text})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered + self.open_tag, add_special_tokens=False)["input_ids"]

    def prompt_ids(self) -> list[int]:
        if self._prompt is None:
            self._prompt = self._render(self.history, self.user)
        return self._prompt

    def add_response(self, ids: Sequence[int], turn: int) -> None:
        prompt = self.prompt_ids()
        self._rows.append((prompt + list(ids), [False] * len(prompt) + [True] * len(ids),
                           [-1] * len(prompt) + [turn] * len(ids)))
        answer = self.open_tag + self.tokenizer.decode(list(ids), skip_special_tokens=True)
        self._pending = (self.user[0], self.user[1], answer)

    def extend_user(self, text: str, ended_with_eos: bool, max_prompt: int) -> bool:
        assert self._pending is not None, "add_response comes before extend_user"
        history = [*self.history, self._pending]
        user = (self._pending[0] + 1, text)
        prompt = self._render(history, user)
        if len(prompt) > max_prompt:
            return False
        self.history, self.user, self._prompt = history, user, prompt
        return True

    def last_sampled(self) -> tuple[int, int]:
        return len(self._rows) - 1, len(self._rows[-1][0]) - 1

    def rows(self) -> list[tuple[list[int], list[bool], list[int]]]:
        return self._rows


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
    success: bool = False
    env_return: float = 0.0
    turns: int = 0
    actions: int = 0
    valid_actions: int = 0
    effective_actions: int = 0
    format_errors: int = 0
    truncated: bool = False
    transcript: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RolloutResult:
    batch: TrajectoryBatch | None
    """The successful trajectories (None if every one failed)."""
    episodes: list[Episode]
    """Every episode, failed ones included, in spec order; ``batch`` rows follow the non-failed ones."""
    timings: dict[str, float]
    """Seconds spent in generation, env steps and tokenisation."""


class Collector:
    """Plays episodes with an engine and assembles the update batch."""

    def __init__(self, engine: RolloutEngine, tokenizer, config: RolloutConfig | None = None) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config or RolloutConfig()
        eos = tokenizer.eos_token_id
        self._eos = {eos} if eos is not None else set()

    def _format(self) -> str:
        c = self.config
        return format_instruction(c.think, c.max_actions_per_turn, c.max_new_tokens)

    def collect(self, specs: Sequence[EpisodeSpec], temperature: float | None = None) -> RolloutResult:
        c = self.config
        timings = {"generate": 0.0, "env": 0.0, "tokenize": 0.0}
        episodes = []
        for spec in specs:
            ep = Episode(spec, _fresh_copy(spec.env))
            t0 = time.perf_counter()
            try:
                with _time_limit(c.step_timeout_s):
                    obs = _checked_observation(ep.env.reset(spec.seed), "reset")
            except Exception as err:  # noqa: BLE001 - a broken env must not stop the rollout
                ep.failed, ep.done = f"reset: {type(err).__name__}: {err}", True
                episodes.append(ep)
                continue
            t1 = time.perf_counter()
            first = first_user_message(ep.env.instructions, obs, c.max_actions_per_episode, self._format())
            if c.context_window is None:
                ep.chat = ChatTokens(self.tokenizer, c.system_prompt, first, c.think)
            else:
                ep.chat = WindowChat(self.tokenizer, c.system_prompt, first, c.think, ep.env.instructions,
                                     c.context_window)
            ep.transcript.append({"role": "env", "observation": obs})
            timings["env"] += t1 - t0
            timings["tokenize"] += time.perf_counter() - t1
            episodes.append(ep)

        params = c.sampling_params(temperature)
        try:
            for turn in range(c.max_turns):
                live = [ep for ep in episodes if not ep.done]
                t1 = time.perf_counter()
                prompts = [ep.chat.prompt_ids() for ep in live]  # type: ignore[union-attr]
                t0 = time.perf_counter()
                timings["tokenize"] += t0 - t1
                gens = self.engine.generate(prompts, params)
                timings["generate"] += time.perf_counter() - t0
                for ep, gen in zip(live, gens):
                    self._play_turn(ep, gen, turn, timings)
        finally:
            self.engine.end_rollout()
        for ep in episodes:
            if not ep.done:
                ep.done = True
        t0 = time.perf_counter()
        batch = self._assemble([ep for ep in episodes if ep.failed is None])
        timings["tokenize"] += time.perf_counter() - t0
        return RolloutResult(batch, episodes, timings)

    def _play_turn(self, ep: Episode, gen, turn: int, timings: dict[str, float]) -> None:
        c = self.config
        chat = ep.chat
        assert chat is not None
        t0 = time.perf_counter()
        chat.add_response(gen.token_ids, turn)
        ep.response_tokens += len(gen.token_ids)
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        parsed = parse_answer(text, think=c.think, max_actions=c.max_actions_per_turn)
        timings["tokenize"] += time.perf_counter() - t0
        ep.turns += 1
        reward, penalised = 0.0, not parsed.format_ok
        executed: list[str] = []
        t0 = time.perf_counter()
        try:
            with _time_limit(c.step_timeout_s):
                for action in parsed.actions:
                    if ep.actions >= c.max_actions_per_episode:
                        break
                    obs, r, done, info = ep.env.step(action)
                    _checked_observation(obs, "step")
                    if not isinstance(r, numbers.Real) or not math.isfinite(r):
                        raise ValueError(f"reward must be a finite number, got {r!r}")
                    valid = bool(info.get("action_is_valid", True))
                    ep.actions += valid or c.count_invalid_actions
                    if not valid:
                        penalised = True  # an invalid action: no env step, format penalty
                        continue
                    executed.append(action)
                    ep.valid_actions += 1
                    ep.effective_actions += bool(info.get("action_is_effective", False))
                    reward += float(r)
                    ep.success = ep.success or bool(info.get("success", False))
                    if done:
                        ep.done = True
                        break
                obs = _checked_observation(ep.env.render(), "render")
        except Exception as err:  # noqa: BLE001 - a broken env must not stop the rollout
            ep.failed, ep.done = f"step: {type(err).__name__}: {err}", True
            timings["env"] += time.perf_counter() - t0
            return
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
        message = next_user_message(turn + 2, turn_reward, obs, c.max_actions_per_episode - ep.actions, self._format())
        ended_eos = bool(gen.token_ids) and gen.token_ids[-1] in self._eos
        if not chat.extend_user(message, ended_eos, max_prompt=c.max_seq_len - c.max_new_tokens):
            ep.done, ep.truncated = True, True
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
        for b, (e, r, (ids, sampled, turns)) in enumerate(rows):
            n = len(ids)
            input_ids[b, :n] = torch.tensor(ids)
            attention[b, :n] = True
            loss_mask[b, :n] = torch.tensor(sampled)
            turn_ids[b, :n] = torch.tensor(turns)
            ep = episodes[e]
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
        )


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
