"""The rollout-engine contract (entry-point group ``ragen_pl.rollout_engines``).

An engine samples continuations for a batch of token-id prompts and reports, for every sampled token, its id and
its log-probability under the distribution it sampled from. It knows nothing of envs or chats: the collector builds
the prompts and reads the answers. What the data module (:class:`ragen_pl.data.RolloutDataModule`) does with an
engine, in order:

1. ``bind(model, tokenizer)`` in ``setup``, and again whenever the strategy replaces the policy object (FSDP wraps it
   after ``setup``). The base class keeps both as ``self.model`` and ``self.tokenizer``; an engine that needs more
   (vLLM builds its ``LLM`` from the model's checkpoint folder) overrides it and calls ``super().bind``.
2. If ``holds_weights`` is true, the engine samples from its *own copy* of the weights: ``load_weights`` gets the
   policy's full weights (transformers names, LoRA merged) before the first rollout or evaluation, after every
   update, and after a checkpoint load, always before the next ``generate``. An engine that samples with the
   policy's own modules (``holds_weights = False``) never gets ``load_weights``.
3. Each rollout or evaluation: ``wake_up()``, then per turn ``next_call_extends(extends)`` (whether the next turn's
   prompts extend this turn's: keep state for them or not) and one ``generate``, then ``end_rollout()`` (drop what
   was kept between the turns) and ``sleep()`` (free memory for the update).
4. ``state_dict()`` / ``load_state_dict()``: what a checkpoint keeps for a resumed run to sample the same (the
   sampling RNG); every rank's is kept.

``holds_weights`` may be a property when it depends on the bound model (the ``hf`` engine holds a copy only for a
sharded policy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from ragen_pl.config import check_sampling


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """Sampling temperature (1.0 in training, 0.5 in the paper's evaluation; 0 means greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 turns it off."""
    max_new_tokens: int = 400
    """Tokens per turn (400 in the paper)."""
    stop: list[str] = field(default_factory=lambda: ["</answer>"])
    """Strings that end a turn; the stop string is kept in the output."""
    ignore_eos: bool = False
    """Keep sampling past the end-of-sequence token (for benchmarks that need fixed lengths)."""

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k, self.max_new_tokens)


@dataclass
class Generation:
    token_ids: list[int]
    """The sampled token ids, exactly as sampled (never re-tokenised)."""
    logprobs: list[float]
    """Log-probability of each sampled token under the sampling distribution (temperature, top-k, top-p applied)."""
    finish_reason: Literal["stop", "length", "eos"]
    """Why the turn ended: a stop string, the token budget, or the end-of-sequence token."""
    kept: list[list[int]] | None = None
    """For each sampled token, the vocabulary ids it was drawn from when sampling truncated the distribution
    (top-k, top-p; an empty list where the set was too large to record); None when it did not, or when the engine
    cannot say (vLLM). The update scores each token over its set (``--model.ppo.replay_sampling_mask``)."""


class RolloutEngine(ABC):
    """Base class of rollout engines; the module docstring states the contract."""

    holds_weights: bool = False
    """Whether the engine samples from its own copy of the weights (then ``load_weights`` keeps it current)."""
    model: Any = None
    """The policy, as last given to :meth:`bind`."""
    tokenizer: Any = None
    """The policy's tokenizer, as last given to :meth:`bind`."""

    def bind(self, model: Any, tokenizer: Any) -> None:
        """Take the policy and its tokenizer (again, if the strategy wrapped the policy)."""
        self.model, self.tokenizer = model, tokenizer

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one continuation per prompt (at least one token each)."""

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Replace the engine's copy of the weights (called only when ``holds_weights``)."""
        raise NotImplementedError(f"{type(self).__name__} holds its own weights (holds_weights) but does not "
                                  f"implement load_weights: it would sample stale weights")

    def end_rollout(self) -> None:  # noqa: B027 - optional hook
        """A rollout's turns are over: drop what was kept between them (the ``hf`` engine's KV prefixes)."""

    def next_call_extends(self, extends: bool) -> None:  # noqa: B027 - optional hook
        """Whether the prompts of the call after the next ``generate`` extend that call's prompts and answers, for
        that one call. The collector knows: not on a rollout's last turn, nor once a ``context_window`` drops turns
        from the prompt. An engine that keeps state between calls for them (the ``hf`` engine's KV prefixes) keeps
        none when told False (in a window of 1, no turn reads what the previous one fed)."""

    def sleep(self) -> None:  # noqa: B027 - optional hook
        """Free memory between rollouts, where the engine supports it."""

    def wake_up(self) -> None:  # noqa: B027 - optional hook
        """Reclaim what :meth:`sleep` freed."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free what the engine started (a worker process); called when a fit ends. It may be bound again."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so a resumed run samples the same (default: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore :meth:`state_dict`'s output."""
