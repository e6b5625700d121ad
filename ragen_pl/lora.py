"""Where LoRA adapters go (``--model.lora``): peft adapters on the decoder's linear layers (all, or the last N), or on
the output head, a readout of the last hidden state; and the centred head.

Why a centred head (``--model.lora.center_head``, issue 20): SmolLM2's last hidden state is mostly what every
prompt shares. Over FrozenLake boards each of its 576 dimensions varies by 0.064 of its size
(``benchmarks/readout_rl.py --features llm``). An adapter reading that state moves the answer every board gets (the action prior)
through the shared part, 15x as fast as the part that depends on the board, and policy-gradient noise on the prior
wins: in the readout simulation the same board features that reach the FrozenLake goal in 1,280 trajectories learn
nothing at any learning rate once given that geometry, as the SmolLM2 runs sharpened a board-blind prior. The centred
head's adapter reads the hidden state less its component along the mean direction ``u``, fixed at the first update
from the policy's own hidden states at the positions it scores (the adapter is 0 until that step, so nothing sampled
before depends on ``u``). ``A (h - (h.u) u) = A' h`` with ``A' = A (I - u u^T)``, so the adapter folds into plain LoRA
weights for merges and exports (:func:`fold_centering`).

Used by :func:`ragen_pl.policy.load_models` and ``ragen-pl export``, so a checkpoint's adapters (and ``u``, a buffer
saved with them) find the same modules in both.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ragen_pl.config import LoraSettings

__all__ = ["add_lora", "fold_centering", "untie_output_embeddings"]

MEAN_DIRECTION = "mean_direction"
"""The buffer of a centred head's ``lora_A`` module: the unit mean direction ``u`` (zeros until the first update)."""


def add_lora(policy: nn.Module, lora: LoraSettings) -> nn.Module:
    """``policy`` with peft LoRA adapters as ``lora`` places them."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("`--model.lora` needs peft: pip install 'ragen-pl[peft]'") from err
    targets, layers = lora.target_modules, None
    if not isinstance(targets, str) and "lm_head" in targets:
        untie_output_embeddings(policy)
    if lora.last_layers is not None:
        n = policy.config.num_hidden_layers
        if lora.last_layers > n:
            raise ValueError(f"`--model.lora.last_layers` must be at most the model's {n} layers, got "
                             f"{lora.last_layers}")
        layers = list(range(n - lora.last_layers, n))
        if targets == "all-linear":  # peft takes layer indices only with module names: the layers' linears
            targets = sorted({name.rsplit(".", 1)[-1] for name, m in policy.named_modules()
                              if isinstance(m, nn.Linear) and ".layers." in name})
        elif isinstance(targets, str):
            raise ValueError(f"`--model.lora.last_layers` needs `--model.lora.target_modules` all-linear or a "
                             f"list of module names, got {targets!r}")
    policy = get_peft_model(policy, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                               target_modules=targets, task_type="CAUSAL_LM",
                                               layers_to_transform=layers))
    if lora.center_head:
        _center(policy.get_base_model().get_output_embeddings().lora_A["default"])
    return policy


def untie_output_embeddings(model: nn.Module) -> None:
    """Give a causal LM's output head its own copy of the weights it shares with the input embeddings (SmolLM2,
    Qwen2.5-0.5B tie them), so that an adapter on the head never reaches the input embeddings, not even when it is
    merged for an engine or an export. The config then says untied, so a saved model keeps both."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embed.weight:
        return
    head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
    model.config.tie_word_embeddings = False
    text = getattr(model.config, "get_text_config", lambda: None)()
    if text is not None:
        text.tie_word_embeddings = False


def _center(lora_a: nn.Linear) -> None:
    lora_a.register_buffer(MEAN_DIRECTION, torch.zeros(lora_a.in_features, dtype=lora_a.weight.dtype))
    lora_a.register_forward_pre_hook(_project_out_mean)


def _project_out_mean(module: nn.Linear, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    (h,) = args  # (..., H): the hidden states the head reads
    u = getattr(module, MEAN_DIRECTION)
    if not bool(u.any()):
        if not (torch.is_grad_enabled() and module.training):
            return args  # before the first update the adapter is 0: nothing depends on u yet
        mean = h.detach().reshape(-1, h.shape[-1]).float().mean(0)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(mean)  # every process reads the same direction
        u.copy_(mean / mean.norm())
    u = u.to(h.dtype)
    return (h - (h @ u).unsqueeze(-1) * u,)


def fold_centering(policy: nn.Module) -> None:
    """Fold a centred head's projection into its ``lora_A`` weight (``A <- A (I - u u^T)``): the adapter computes the
    same, and merging it into the head (engines, exports) is then exact. A no-op without a centred head."""
    for module in policy.modules():
        u = getattr(module, MEAN_DIRECTION, None)
        if isinstance(module, nn.Linear) and u is not None and bool(u.any()):
            with torch.no_grad():
                w, u = module.weight, u.to(module.weight.dtype)
                w -= (w @ u).unsqueeze(-1) * u
