"""One process of tests/test_distributed.py::test_sharded_lora_merges_like_one_process (gloo, CPU)."""

import json
import os
import sys

import torch
import torch.distributed as dist

LORA = dict(r=4, alpha=8, target_modules=["lm_head", "q_proj", "down_proj"])


def sharded_lora_policy(model_path: str, hooks=()):
    """The tiny model with LoRA on the head and two layers (after ``hooks``), trained-looking adapters the same on
    every rank, each decoder layer and the root FSDP2-sharded."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from ragen_pl.config import LoraSettings
    from ragen_pl.lora import add_lora

    policy = add_lora(AutoModelForCausalLM.from_pretrained(model_path), LoraSettings(**LORA))
    for hook in hooks:
        policy = hook.after_load(policy, None)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    for layer in policy.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(policy)
    return policy


def merged_slice(merged: dict) -> dict:
    """The merged weights the tests compare: the head's and the two adapted layers', as lists."""
    return {k: v.tolist() for k, v in merged.items()
            if "lm_head" in k or "layers.0.self_attn.q" in k or "layers.1.mlp.down" in k}


def run(main) -> None:
    """A worker's ``__main__``: ``main(rank, world, port, model_path, out)`` from the command line, then exit at once
    (as tests/sharded_sampling_worker.py: the gloo group's threads can outlive finalization)."""
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    sys.stderr.flush()
    os._exit(0)


def main(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    from ragen_pl.policy import policy_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    policy = sharded_lora_policy(model_path)
    merged = policy_state_dict(policy, lora=True)
    with open(out, "w") as f:
        json.dump({"merged": merged_slice(merged)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
