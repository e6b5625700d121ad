"""The rollout-engine interface (entry-point group ``ragen_pl.rollout_engines``).

An engine samples continuations for a batch of token-id prompts and reports, for every sampled token, its id and
its log-probability under the sampling distribution. It knows nothing of envs or chats: the collector builds the
prompts and reads the answers. Engines that keep their own copy of the weights (vLLM) reload them from the trained
policy after each update; engines that can free memory between rollouts (vLLM's sleep mode) do so; engines that keep
state between the turns of a rollout (the ``hf`` engine's KV prefixes) drop it when the collector calls ``end_rollout``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist
from torch import Tensor


def process_rank() -> int:
    """This process's rank under torch.distributed, 0 without it. Engines offset their sampling seed by it, so that
    ranks sampling the same prompt (a Bandit's every group) draw different answers."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def process_count() -> int:
    """The number of processes under torch.distributed, 1 without it."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
        if self.temperature < 0:
            raise ValueError(f"`temperature` must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"`top_k` must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {self.max_new_tokens}")


@dataclass
class Generation:
    token_ids: list[int]
    """The sampled token ids, exactly as sampled (never re-tokenised)."""
    logprobs: list[float]
    """Log-probability of each sampled token under the sampling distribution."""
    finish_reason: Literal["stop", "length", "eos"]
    """Why the turn ended: a stop string, the token budget, or the end-of-sequence token."""


class RolloutEngine(ABC):
    """Base class of rollout engines."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one continuation per prompt."""

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:  # noqa: B027 - optional hook
        """Take new policy weights. Engines that share the policy's parameters need nothing."""

    def end_rollout(self) -> None:  # noqa: B027 - optional hook
        """A rollout's turns are over: drop what was kept between them (the ``hf`` engine's KV prefixes)."""

    def sleep(self) -> None:  # noqa: B027 - optional hook
        """Free memory between rollouts, where the engine supports it."""

    def wake_up(self) -> None:  # noqa: B027 - optional hook
        """Reclaim what :meth:`sleep` freed."""
