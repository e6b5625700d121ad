"""One process of tests/test_distributed.py::test_sharded_policy_samples_through_an_unsharded_copy (gloo, CPU)."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.policy import full_tensor
    from ragen_pl.rollout.engine import SamplingParams
    from ragen_pl.rollout.hf import HFEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    # Ranks sample different numbers of prompts of different lengths: with the copy, none waits for another.
    prompts = [tok("Turn 1:\nState:\n" + "#_" * (k + 3 * rank))["input_ids"] for k in range(1 + 2 * (1 - rank))]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop=[])
    plain = HFEngine(seed=rank, sync_ranks=False)
    plain.bind(model, tok)
    expected = [g.token_ids for g in plain.generate(prompts, params)]

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = HFEngine(seed=rank)
    engine.bind(model, tok)
    assert engine.holds_weights
    engine.load_weights({k: full_tensor(v) for k, v in model.state_dict().items()})
    gathers = []
    original = dist.all_gather_into_tensor

    def counting(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    dist.all_gather_into_tensor = counting
    try:
        copied = [g.token_ids for g in engine.generate(prompts, params)]
    finally:
        dist.all_gather_into_tensor = original
    # Under mixed precision the copy turns to the compute dtype (not cast at every step), and new weights keep it.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = engine.generate(prompts, params)
    engine.load_weights({k: full_tensor(v) for k, v in model.state_dict().items()})
    copy_dtype = str(next(engine._copy.parameters()).dtype)
    sharded = HFEngine(seed=rank, gather_sharded=False)  # the sharded model itself, ranks in lockstep
    sharded.bind(model, tok)
    assert not sharded.holds_weights
    itself = [g.token_ids for g in sharded.generate(prompts, params)]
    with open(out, "w") as f:
        json.dump({"expected": expected, "copied": copied, "itself": itself, "gathers_while_sampling": len(gathers),
                   "mixed_lengths": [len(g.token_ids) for g in mixed], "copy_dtype": copy_dtype}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    # Leave without interpreter finalization. The sharded model keeps the gloo group (and its worker threads) alive
    # past destroy_process_group; a worker thread that releases the last all-reduce's tensor after the interpreter
    # began to shut down cannot take the GIL and aborts the process ("terminate called without an active
    # exception", about 1 run in 15 here). The results are written and closed above.
    sys.stderr.flush()
    os._exit(0)
