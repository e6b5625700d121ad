"""The plain settings of a run: the update (``--model.ppo``), the optimisers (``--model.optim``), LoRA
(``--model.lora``) and how trajectories are played (``--data.rollout``).

Each dataclass checks its own fields once, in ``__post_init__``, and every error names the full command-line flag,
the value and what is allowed. Closed sets of choices are ``Literal`` aliases of :mod:`ragen_pl.types`; their allowed
values are read from the alias (:func:`check_choice`), so a choice is spelled out in one place only. LightningCLI
turns the attribute docstrings into ``--help``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from ragen_pl.errors import ConfigError
from ragen_pl.types import KLEstimator, LossAgg

SYSTEM_PROMPT = "You are a helpful assistant. You solve problems step by step."
"""The system message of every trajectory unless ``--data.rollout.system_prompt`` says otherwise (RAGEN's)."""

__all__ = ["SYSTEM_PROMPT", "LoraSettings", "OptimConfig", "PPOConfig", "RolloutConfig", "check_choice", "check_int",
           "check_number", "check_sampling", "from_saved", "lora_from_saved"]


def check_choice(flag: str, value: Any, choices: Any) -> None:
    """Refuse ``value`` unless it is one of ``choices`` (a ``Literal`` alias or a tuple of values)."""
    allowed = get_args(choices) or tuple(choices)
    if value not in allowed:
        raise ValueError(f"`{flag}` must be one of {', '.join(map(str, allowed))}, got {value!r}")


def check_bool(flag: str, value: Any) -> None:
    """Refuse anything but ``True`` or ``False`` (a string such as ``"no"`` is not false)."""
    if not isinstance(value, bool):
        raise ValueError(f"`{flag}` must be true or false, got {value!r}")


def check_int(flag: str, value: Any, low: int = 1, high: int | None = None) -> None:
    """Refuse anything but an integer in ``[low, high]`` (``True`` is not an integer here). The one integer check of
    the library: settings, envs (``ragen_pl.envs.base`` re-exports it for env plugins) and plugins."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"`{flag}` must be an integer {bound}, got {value!r}")


def check_number(flag: str, value: Any, low: float, high: float = math.inf, low_open: bool = False) -> None:
    """Refuse anything but a finite number in the bounds (``low_open``: above ``low``, not at it)."""
    bound = f"> {low:g}" if low_open else f">= {low:g}"
    if high < math.inf:
        bound = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not math.isfinite(value):
        raise ValueError(f"`{flag}` must be a finite number {bound}, got {value!r}")
    if not (number and (value > low if low_open else value >= low) and value <= high):
        raise ValueError(f"`{flag}` must be {bound}, got {value!r}")


def check_sampling(temperature: float, top_p: float, top_k: int, max_new_tokens: int, prefix: str = "") -> None:
    """The sampling settings' rules, shared by :class:`RolloutConfig` (flags ``--data.rollout.*``) and the engine
    API's ``SamplingParams`` (``prefix=""``)."""
    check_number(f"{prefix}temperature", temperature, 0.0)
    check_number(f"{prefix}top_p", top_p, 0.0, 1.0, low_open=True)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k == 0 or top_k < -1:
        raise ValueError(f"`{prefix}top_k` must be -1 (off) or an integer >= 1, got {top_k!r}")
    check_int(f"{prefix}max_new_tokens", max_new_tokens)


@dataclass
class PPOConfig:
    """The update. Defaults are StarPO-S's (paper: clip 0.2/0.28, no KL, entropy 0.001, mini-batch 32).

    Log-probs are scored at the temperature the batch was sampled with (``--data.rollout.temperature``), so there
    is no second temperature here.
    """

    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int = 32
    """Rows per optimiser step (per process): trajectories, or turns where ``--data.rollout.context_window`` makes
    each turn a row of its own."""
    micro_batch_size: int = 4
    """Rows per forward/backward (gradient accumulation inside a mini-batch)."""
    clip_low: float = 0.2
    """PPO ratio clip below 1 (epsilon_low)."""
    clip_high: float = 0.28
    """PPO ratio clip above 1 (epsilon_high, "clip-higher"); set equal to clip_low for symmetric PPO."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for negative advantages; None turns it off."""
    entropy_coeff: float = 0.001
    """Weight of the entropy bonus."""
    kl_coeff: float = 0.0
    """Weight of KL(policy || reference); 0 (StarPO-S) loads no reference model. Vanilla StarPO uses 0.001."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator: k1, k2 or k3 (low variance)."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """Add the KL as a loss term, or subtract it from token rewards before advantages."""
    value_clip: float | None = 0.5
    """Clip range of the critic's value update; None turns clipping off."""
    vf_coeff: float = 0.5
    """Weight of the value loss when the critic shares the policy's trunk."""
    loss_agg: LossAgg = "token-mean"
    """How token losses are reduced: token-mean, seq-mean-token-sum, seq-mean-token-mean, or
    seq-mean-token-sum-norm (Dr. GRPO: each sequence's token sum divided by ``loss_agg_norm``)."""
    loss_agg_norm: float | None = None
    """The constant of ``seq-mean-token-sum-norm``: the generation budget per trajectory (Dr. GRPO), e.g.
    ``max_turns x max_new_tokens``. Only with that mode."""
    grad_clip: float = 1.0
    """Max gradient norm per optimiser step."""
    tis_cap: float | None = None
    """Off-policy correction for the sampler/trainer mismatch (truncated importance sampling): each token's
    policy-gradient term is weighted by ``min(p_old / p_sampler, tis_cap)`` (the trainer's old log-prob over the
    engine's; detached). None (default) turns it off."""
    mis_bound: float | None = None
    """Off-policy correction by masking: a trajectory whose geometric-mean sampler/trainer ratio
    ``exp(mean_t log(p_old / p_sampler))`` lies outside [1/bound, bound] is left out of the policy-gradient term.
    None (default) turns it off."""
    mis_rejected: Literal["excluded", "zero_advantage"] = "excluded"
    """What ``mis_bound`` does to a rejected trajectory: ``excluded`` takes its tokens out of the loss and of the loss's
    denominator (verl's rollout correction since 2025-10: rejection through the response mask); ``zero_advantage``
    gives them advantage 0 and keeps them in the denominator (and under the entropy and value terms)."""
    replay_sampling_mask: bool = True
    """When rollouts were sampled with top-k or top-p, score each token over the set of ids its sampler kept (old,
    new and entropy alike), so the importance ratio compares like with like; false scores the whole vocabulary."""
    share_prefix: bool = True
    """Run the prompt prefix that all rows of a micro-batch share once, not once per row (the same losses and
    gradients; off with gradient checkpointing or a sharded model, which cannot take a KV cache)."""
    pack: bool = False
    """Run each micro-batch's rows packed into one sequence, without padding (position ids restart at every row;
    the same losses and gradients). Pays off with flash attention's variable-length kernels on a GPU; under SDPA the
    packed sequence's mask is quadratic in its length. Needs ``share_prefix=false`` (one or the other)."""

    def __post_init__(self) -> None:
        for name in ("ppo_epochs", "mini_batch_size", "micro_batch_size"):
            check_int(f"--model.ppo.{name}", getattr(self, name))
        if self.micro_batch_size > self.mini_batch_size:
            raise ValueError(f"`--model.ppo.micro_batch_size` ({self.micro_batch_size}) must be <= "
                             f"`--model.ppo.mini_batch_size` ({self.mini_batch_size})")
        if not (isinstance(self.clip_low, (int, float)) and 0 <= self.clip_low < 1):
            raise ValueError(f"`--model.ppo.clip_low` must be in [0, 1), got {self.clip_low!r}")
        check_number("--model.ppo.clip_high", self.clip_high, 0.0)
        if self.dual_clip is not None:
            check_number("--model.ppo.dual_clip", self.dual_clip, 1.0, low_open=True)
        for name in ("entropy_coeff", "kl_coeff", "vf_coeff"):
            check_number(f"--model.ppo.{name}", getattr(self, name), 0.0)
        if self.value_clip is not None:
            check_number("--model.ppo.value_clip", self.value_clip, 0.0, low_open=True)
        check_choice("--model.ppo.kl_mode", self.kl_mode, Literal["loss", "reward"])
        check_choice("--model.ppo.kl_estimator", self.kl_estimator, KLEstimator)
        check_choice("--model.ppo.loss_agg", self.loss_agg, LossAgg)
        if (self.loss_agg == "seq-mean-token-sum-norm") != (self.loss_agg_norm is not None):
            raise ValueError(f"`--model.ppo.loss_agg_norm` is set exactly when `--model.ppo.loss_agg` is "
                             f"seq-mean-token-sum-norm (a number > 0, the generation budget); got loss_agg "
                             f"{self.loss_agg!r}, loss_agg_norm {self.loss_agg_norm!r}")
        if self.loss_agg_norm is not None:
            check_number("--model.ppo.loss_agg_norm", self.loss_agg_norm, 0.0, low_open=True)
        check_number("--model.ppo.grad_clip", self.grad_clip, 0.0, low_open=True)
        if self.pack and self.share_prefix:
            raise ValueError("`--model.ppo.pack=true` runs every row whole without padding, `--model.ppo.share_prefix` "
                             "runs the rows' common prompt once: choose one (add --model.ppo.share_prefix=false)")
        if self.tis_cap is not None:
            check_number("--model.ppo.tis_cap", self.tis_cap, 1.0)
        if self.mis_bound is not None:
            check_number("--model.ppo.mis_bound", self.mis_bound, 1.0, low_open=True)
        check_choice("--model.ppo.mis_rejected", self.mis_rejected, Literal["excluded", "zero_advantage"])


@dataclass
class OptimConfig:
    """Optimisers: AdamW for actor and critic, linear warmup, then constant or a cosine decay."""

    actor_lr: float = 1e-6
    """Actor learning rate (paper: 1e-6)."""
    critic_lr: float = 1e-5
    """Critic learning rate (paper: 1e-5): the separate critic's, or the shared value head's (the trunk under it
    trains at ``actor_lr``)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Iterations of linear learning-rate warmup."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After the warmup: ``constant``, or ``cosine``, a half cosine from the rate down to ``min_lr_ratio`` times it
    at ``--trainer.max_steps`` (which must then be set). A run stopped early by a time budget stops mid-decay."""
    min_lr_ratio: float = 0.0
    """``cosine``: the final rate as a share of the initial one."""

    def lr_factor(self, iteration: int, total: int | None = None) -> float:
        """The learning rate of ``iteration`` (0-based) as a share of the configured one, in a run of ``total``
        iterations (``cosine`` only)."""
        if self.schedule == "cosine" and (not total or total <= 0):
            raise ConfigError(f"`--model.optim.schedule=cosine` decays over `--trainer.max_steps`: set it to the run's "
                             f"iterations, got {total}")
        if iteration < self.warmup_steps:
            return (iteration + 1) / (self.warmup_steps + 1)
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (iteration - self.warmup_steps) / max(1, total - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def __post_init__(self) -> None:
        check_number("--model.optim.actor_lr", self.actor_lr, 0.0, low_open=True)
        check_number("--model.optim.critic_lr", self.critic_lr, 0.0, low_open=True)
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        if len(self.betas) != 2:
            raise ValueError(f"`--model.optim.betas` must be two numbers in [0, 1), got {list(self.betas)}")
        for beta in self.betas:
            check_number("--model.optim.betas", beta, 0.0, 1.0)
        check_number("--model.optim.weight_decay", self.weight_decay, 0.0)
        check_int("--model.optim.warmup_steps", self.warmup_steps, 0)
        check_choice("--model.optim.schedule", self.schedule, Literal["constant", "cosine"])
        check_number("--model.optim.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)


@dataclass
class LoraSettings:
    """LoRA through peft (paper variant: rank 64, alpha 64, all linear layers)."""

    r: int = 64
    """Rank."""
    alpha: int = 64
    """Scaling alpha."""
    dropout: float = 0.0
    """Dropout on the LoRA path."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get adapters: ``all-linear``, or a list of module names (``[lm_head]`` adapts the output head
    alone, untied from the input embeddings first)."""
    last_layers: int | None = None
    """Adapters only in the last N decoder layers (peft's ``layers_to_transform``). The layers below stay frozen and
    run without autograd, so backward stops at the first adapted layer: with 10 of SmolLM2's 30 layers the update
    computes a third of the backward. None: every layer."""

    def __post_init__(self) -> None:
        check_int("--model.lora.r", self.r)
        if self.last_layers is not None:
            check_int("--model.lora.last_layers", self.last_layers)
        check_number("--model.lora.alpha", self.alpha, 0.0, low_open=True)
        check_number("--model.lora.dropout", self.dropout, 0.0, 1.0)


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
    """Sampling temperature in training; the update scores log-probs at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 turns it off."""
    reward_placement: Literal["turn", "last_turn"] = "turn"
    """Put each turn's reward on that turn's last sampled token, or the whole return on the last turn's."""
    context_window: int | None = None
    """Keep only the last K turns in the prompt (the instructions always stay); each turn then trains as its own
    row. None keeps the whole conversation in one sequence."""
    turn_header: bool = True
    """Write each turn's header in its prompt: ``Turn t``, the actions left and the last turn's reward (RAGEN's
    prompt). False writes the state alone, so that with ``context_window`` 1 a prompt is a function of the state:
    the same board gives the same prompt on every turn."""
    max_seq_len: int | None = None
    """Tokens a prompt and its answer may fill (null: the model's context, ``max_position_embeddings``). A turn whose
    prompt would not leave ``max_new_tokens`` under it is not played: the trajectory ends, truncated."""
    step_timeout_s: float = 5.0
    """An env step or reset that runs longer fails its trajectory (a SIGALRM on the main thread; off it, the rollout
    stops waiting for the call and abandons its env)."""
    system_prompt: str = SYSTEM_PROMPT
    """The system message of every trajectory."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_actions_per_turn", "max_actions_per_episode"):
            check_int(f"--data.rollout.{name}", getattr(self, name))
        check_bool("--data.rollout.turn_header", self.turn_header)
        check_choice("--data.rollout.reward_placement", self.reward_placement, Literal["turn", "last_turn"])
        if self.context_window is not None and (isinstance(self.context_window, bool) or
                                                not isinstance(self.context_window, int) or self.context_window < 1):
            raise ValueError(f"`--data.rollout.context_window` must be an integer >= 1 or null, got "
                             f"{self.context_window!r}")
        if self.max_seq_len is not None:
            check_int("--data.rollout.max_seq_len", self.max_seq_len)
            if self.max_seq_len <= self.max_new_tokens:
                raise ValueError(f"`--data.rollout.max_seq_len` ({self.max_seq_len}) must be larger than "
                                 f"`--data.rollout.max_new_tokens` ({self.max_new_tokens})")
        check_number("--data.rollout.step_timeout_s", self.step_timeout_s, 0.0, low_open=True)
        check_number("--data.rollout.format_penalty", self.format_penalty, -math.inf)
        check_sampling(self.temperature, self.top_p, self.top_k, self.max_new_tokens, prefix="--data.rollout.")


def from_saved(cls, value: Any, legacy: tuple[str, ...] = ()):
    """``value`` as a ``cls`` instance: itself, None (the defaults), or a checkpoint's plain dict of its fields.

    ``legacy`` names fields older versions saved that no longer exist (dropped: a checkpoint stays loadable).
    """
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls(**{k: v for k, v in value.items() if k not in legacy})
    return value


#: Fields of LoraSettings that older checkpoints saved, with their off values: the readout head moved to the
#: experiments package (``ragen_pl_experiments.readout.ReadoutHead``, a model hook).
_LEGACY_LORA = {"center_head": 0, "center_turns": 0, "whiten_head": False, "head_tokens": None}


def lora_from_saved(lora: LoraSettings | dict | None) -> LoraSettings | None:
    """``--model.lora`` or a checkpoint's saved dict of it. A checkpoint of the readout head (before it moved to
    the experiments package) is refused in one line, not loaded without its head's transform."""
    if lora is None:
        return None
    if isinstance(lora, dict):
        moved = {k: v for k, v in lora.items() if k in _LEGACY_LORA and v != _LEGACY_LORA[k]}
        if moved:
            raise ConfigError(f"this checkpoint's `--model.lora` has {moved}: the readout head moved to the experiments "
                              f"package; rebuild it with `--model.hooks=ragen_pl_experiments.readout.ReadoutHead`")
    return from_saved(LoraSettings, lora, legacy=tuple(_LEGACY_LORA))
