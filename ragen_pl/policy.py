"""The models an update trains and reads: the policy, its critic (a separate value model or a value head on the
policy's own trunk), the frozen reference; loading them (LoRA, gradient checkpointing, dtype), sharding them under
FSDP / FSDP2, their full weights for rollout engines and their gradient clipping.

:class:`ragen_pl.module.RagenModule` owns these modules (so checkpoints name them ``policy.*``, ``critic.*``,
``value_head.*``, ``reference.*``); :class:`Models` is the view of them the update works with.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ragen_pl.config import LoraSettings
from ragen_pl.hooks import ModelHook
from ragen_pl.lora import add_lora
from ragen_pl.scoring import forward_packed, forward_shared, prefix_to_share, shift_values, unpack_rows

__all__ = ["Models", "ValueModel", "clip_grad_norm", "full_tensor", "load_models", "merging", "policy_state_dict", "shard",
           "zero_head"]


class ValueModel(nn.Module):
    """A critic: a transformer trunk and a linear value head.

    ``values[:, t]`` is the value of the state *before* token t, read from the hidden state at t - 1 (the same
    alignment as ``logprobs``); position 0 is 0.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = zero_head(hidden_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, prefix: int = 0, pack: bool = False) -> Tensor:
        """(B, T) values; with ``prefix`` the rows' shared first tokens run once (their values are not needed: 0);
        with ``pack`` the rows run packed, without padding (:func:`ragen_pl.scoring.forward_packed`)."""
        if pack:
            hidden = unpack_rows(forward_packed(self.backbone, input_ids, attention_mask).last_hidden_state,
                                 attention_mask)
        elif prefix:
            hidden = forward_shared(self.backbone, input_ids, attention_mask, prefix).last_hidden_state
            hidden = torch.cat([hidden.new_zeros(hidden.shape[0], prefix, hidden.shape[2]), hidden], 1)
        else:
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return shift_values(self.head(hidden).squeeze(-1))


def zero_head(hidden_size: int) -> nn.Linear:
    """A value head that starts at 0 everywhere (a critic knows nothing yet)."""
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


@dataclass
class Models:
    """What the update trains and reads. ``critic`` and ``value_head`` are never both set."""

    policy: nn.Module
    critic: nn.Module | None = None
    """A separate value model (:class:`ValueModel`), trained by its own optimiser."""
    value_head: nn.Module | None = None
    """A value head on the policy's last hidden states, trained with the policy's optimiser."""
    reference: nn.Module | None = None
    """The frozen reference policy of a KL term; None with LoRA, whose reference is the policy with adapters off."""
    lora: bool = False

    @property
    def has_critic(self) -> bool:
        return self.critic is not None or self.value_head is not None

    def critic_values(self, ids: Tensor, attn: Tensor, mask: Tensor, share_prefix: bool, pack: bool = False
                      ) -> Tensor:
        """(B, T) values of the separate critic (the rows' shared prefix run once if ``share_prefix``, the rows
        packed without padding if ``pack``)."""
        assert self.critic is not None
        if pack:
            return self.critic(ids, attn, pack=True)
        backbone = getattr(self.critic, "backbone", None)
        prefix = prefix_to_share(backbone, ids, mask) if share_prefix and backbone is not None else 0
        return self.critic(ids, attn, prefix) if prefix else self.critic(ids, attn)

    def shared_values(self, hidden: Tensor) -> Tensor:
        """(B, T) values of the value head on the policy's (B, T, H) hidden states."""
        assert self.value_head is not None
        return shift_values(self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1))


def _load_causal_lm(path: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def load_models(path: str, *, critic: Literal["separate", "shared"] | None, kl: bool, lora: LoraSettings | None,
                gradient_checkpointing: bool, dtype: torch.dtype, hooks: Sequence[ModelHook] = ()
                ) -> tuple[Any, Models]:
    """The tokenizer and the models of a run from one checkpoint folder (the critic starts from it too, as in the
    paper). ``critic`` None builds no critic; ``kl`` builds the frozen reference (not needed with LoRA); ``hooks``
    change the policy after LoRA is added and may build the shared value head (:class:`ragen_pl.hooks.ModelHook`)."""
    from transformers import AutoModel, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"`--model.model`: cannot load {path!r} (a hub id, a local folder saved with save_pretrained, "
            f"ragen-pl/tiny or ragen-pl/smollm2-135m): {str(err).splitlines()[0]}"
        ) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    policy = _load_causal_lm(path, dtype)
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    if lora is not None:
        policy = add_lora(policy, lora)
    for hook in hooks:
        policy = hook.after_load(policy, tokenizer)
    if critic != "shared":
        for hook in hooks:
            if type(hook).value_head is not ModelHook.value_head:
                raise ValueError(f"`--model.hooks`: {type(hook).__name__} builds the value head on the policy's trunk, "
                                 f"which needs `--model.critic=shared` and an advantage with a critic (such as GAE); "
                                 f"this run builds {'no critic' if critic is None else 'a separate critic'}")
    models = Models(policy.train(), lora=lora is not None)  # transformers loads models in eval mode
    if critic == "separate":
        backbone = AutoModel.from_pretrained(path, dtype=dtype)
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable()
        models.critic = ValueModel(backbone, backbone.config.hidden_size).train()
    elif critic == "shared":
        size = policy.config.hidden_size
        heads = [h for hook in hooks if (h := hook.value_head(size)) is not None]
        if len(heads) > 1:
            raise ValueError(f"`--model.hooks`: {len(heads)} hooks build the value head; at most one may")
        models.value_head = heads[0] if heads else zero_head(size)
    if kl and lora is None:  # with LoRA the reference is the base model, adapters off
        models.reference = _load_causal_lm(path, dtype).eval().requires_grad_(False)
    return tokenizer, models


def policy_state_dict(policy: nn.Module, lora: bool, hooks: Sequence[ModelHook] = ()) -> dict[str, Tensor]:
    """Full policy weights under transformers' names, for engines that keep their own copy (vLLM).

    With LoRA the adapters are merged into a copy of the weights (merge, copy, unmerge), so the engine samples from
    exactly the trained policy; each hook's :meth:`~ragen_pl.hooks.ModelHook.merging` context holds around the merge.
    """
    with policy_weights(policy, lora, hooks) as weights:
        return {k: v.clone() if lora else v for k, v in weights}


@contextmanager
def policy_weights(policy: nn.Module, lora: bool, hooks: Sequence[ModelHook] = ()) -> Iterator[Iterator[tuple[str, Tensor]]]:
    """Within: the full policy weights under transformers' names, one (name, tensor) at a time, for an engine that
    copies each where it keeps its own (no copy of the whole state dict; a sharded tensor is gathered when reached).
    With LoRA the adapters stay merged until the block ends."""
    if not lora:
        yield ((k, full_tensor(v)) for k, v in policy.state_dict().items())
        return
    with merging(policy, hooks):
        policy.merge_adapter()
        try:
            yield ((k.replace("base_model.model.", "", 1).replace(".base_layer", ""), full_tensor(v.detach()))
                   for k, v in policy.state_dict().items() if "lora_" not in k)
        finally:
            policy.unmerge_adapter()


@contextmanager
def merging(policy: nn.Module, hooks: Sequence[ModelHook]) -> Iterator[None]:
    """Within: every hook's :meth:`~ragen_pl.hooks.ModelHook.merging` context (engines, exports merge inside)."""
    with ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook.merging(policy))
        yield


MODEL_NAMES = ("policy", "critic", "reference", "value_head")
"""The attributes of :class:`ragen_pl.module.RagenModule` that hold models, each its own FSDP root."""


def shard(owner: nn.Module, strategy, device_mesh=None) -> None:
    """Shard each model of ``owner`` (its attributes :data:`MODEL_NAMES`) as its own FSDP root.

    Under Lightning's ``FSDPStrategy`` (FSDP1) the LightningModule itself must not be the one FSDP root: a StarPO
    iteration runs many backward passes (mini- and micro-batches, actor and critic) inside one ``training_step``,
    and FSDP1 checks that every backward follows a forward of its root. Wrapped here, inside the strategy's
    ``enable_wrap`` context (its sharding, mixed precision and ``auto_wrap_policy``), each backward pairs with the
    forward of the model it differentiates. Under ``ModelParallelStrategy`` (FSDP2) every decoder layer and then
    each model's root are ``fully_shard``-ed over the mesh's ``data_parallel`` dimension.
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import wrap

        for name in MODEL_NAMES:
            model = getattr(owner, name)
            if model is not None and not isinstance(model, FullyShardedDataParallel):
                setattr(owner, name, wrap(model))
        # The auto-wrap policy was applied inside each root; Lightning would only warn that it is unused.
        strategy.kwargs.pop("auto_wrap_policy", None)
        return
    if not isinstance(strategy, ModelParallelStrategy):
        return
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for name in MODEL_NAMES:
        model = getattr(owner, name)
        if model is None:
            continue
        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)


def clip_grad_norm(models: list[nn.Module | None], params: list[Tensor], max_norm: float) -> Tensor:
    """Clip the gradients of ``params`` (those of ``models``) to ``max_norm`` by their global norm; return that norm.

    FSDP1 roots hold sharded gradients whose local norm is not the global one, so each root computes its own (an
    all-reduce) and the norms combine; FSDP2 gradients are DTensors, whose norm torch already makes global.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    roots = [m for m in models if isinstance(m, FullyShardedDataParallel)]
    if not roots:
        return full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norms = torch.stack([m.clip_grad_norm_(float("inf")).float() for m in roots])
    total = norms.norm()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for q in params:
        if q.grad is not None:
            q.grad.mul_(coef.to(q.grad.device, q.grad.dtype))
    return total


def full_tensor(x: Tensor) -> Tensor:
    """A DTensor's full value (FSDP2 gradient norms and weights), else the tensor itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x
