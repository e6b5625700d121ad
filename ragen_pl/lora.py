"""Where LoRA adapters go (``--model.lora``): peft adapters on the decoder's linear layers (all, or the last N), or on
named modules, the output head among them (a readout of the last hidden state; the head is then untied from the
input embeddings first, so that merges and exports leave those alone).

Used by :func:`ragen_pl.policy.load_models` and ``ragen-pl export``, so a checkpoint's adapters find the same modules
in both. A plugin that changes the adapted modules further does so through a :class:`ragen_pl.hooks.ModelHook`.
"""

from __future__ import annotations

from torch import nn

from ragen_pl.config import LoraSettings

__all__ = ["add_lora", "untie_output_embeddings"]


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
    return get_peft_model(policy, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                             target_modules=targets, task_type="CAUSAL_LM",
                                             layers_to_transform=layers))


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
