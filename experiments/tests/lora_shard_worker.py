"""One process of experiments/tests/test_distributed.py::test_sharded_readout_fits_and_merges_like_one_process (gloo,
CPU)."""

import json

import torch
import torch.distributed as dist


def turn_rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows (n, 8) and their turns: turns 0 and 1 on rank 0, turns 0 and 2 on rank 1."""
    rows = torch.randn(5 + rank, 8, generator=torch.Generator().manual_seed(20 + rank), dtype=torch.float64)
    return rows, torch.tensor([[0, 0, 1, 1, 1], [0, 2, 2, 2, 0, 2]][rank])


def main(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    from ragen_pl_experiments.readout import FEATURE_SCALE, SHARED_DIRECTIONS, ReadoutHead, turn_directions
    from ragen_pl_experiments.update import ReadoutUpdate

    from ragen_pl.advantages import GRPO
    from ragen_pl.config import PPOConfig
    from ragen_pl.policy import Models, policy_state_dict
    from ragen_pl.scoring import scored_positions
    from ragen_pl.types import TrajectoryBatch
    from tests.lora_shard_worker import merged_slice, sharded_lora_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    hook = ReadoutHead(center=2, whiten=True)
    policy = sharded_lora_policy(model_path, [hook]).train()
    ids = torch.randint(3, 100, (2, 6 + 3 * rank), generator=torch.Generator().manual_seed(10 + rank))
    attn = torch.ones_like(ids, dtype=torch.bool)
    mask = attn.clone()
    mask[:, :2] = False  # the first two tokens are the prompt
    seen = []  # the head's input at the scored positions (a plain hook, before the centring)
    head_a = policy.get_base_model().get_output_embeddings().lora_A["default"]
    head_a.register_forward_pre_hook(
        lambda m, a: seen.append(a[0][scored_positions(mask)[1]].detach().double()), prepend=True)
    batch = TrajectoryBatch(input_ids=ids, attention_mask=attn, loss_mask=mask, rewards=torch.zeros(ids.shape),
                            turn_ids=torch.where(mask, 0, -1), group_ids=torch.tensor([0, 0]), env_tags=("x", "x"))
    ReadoutUpdate(GRPO(), PPOConfig(share_prefix=False, mini_batch_size=2, micro_batch_size=2)).prepare(
        batch, Models(policy, lora=True))  # the first update's prepare fixes the directions over both ranks
    policy.reshard()  # as after an update's backward, when an engine gets the weights (the root stays unsharded here)
    h = seen[-1]
    merged = policy_state_dict(policy, lora=True, hooks=[hook])
    rows, turns = turn_rows(rank)  # turn directions (center_turns) from both ranks' rows: turn 2 only on rank 1
    by_turn = turn_directions(rows, turns, 2)
    with open(out, "w") as f:
        json.dump({"directions": getattr(head_a, SHARED_DIRECTIONS).tolist(), "moment": (h.T @ h).tolist(),
                   "rows": h.shape[0], "scale": getattr(head_a, FEATURE_SCALE).tolist(), "by_turn": by_turn.tolist(),
                   "merged": merged_slice(merged)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from tests.lora_shard_worker import run

    run(main)
