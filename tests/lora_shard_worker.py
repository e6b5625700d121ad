"""One process of tests/test_distributed.py::test_sharded_lora_merges_like_one_process (gloo, CPU)."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from ragen_pl.config import LoraSettings
    from ragen_pl.lora import add_lora
    from ragen_pl.policy import policy_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    lora = LoraSettings(r=4, alpha=8, target_modules=["lm_head", "q_proj", "down_proj"])
    policy = add_lora(AutoModelForCausalLM.from_pretrained(model_path), lora)
    with torch.no_grad():  # trained-looking adapters, the same on every rank
        gen = torch.Generator().manual_seed(0)
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    for layer in policy.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(policy)
    merged = policy_state_dict(policy, lora=True)
    with open(out, "w") as f:
        json.dump({"merged": {k: v.tolist() for k, v in merged.items() if "lm_head" in k or "layers.0.self_attn.q"
                              in k or "layers.1.mlp.down" in k}}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    sys.stderr.flush()
    os._exit(0)  # as tests/sharded_sampling_worker.py: the gloo group's threads can outlive finalization
