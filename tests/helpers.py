"""Builders for small trajectory batches and multi-turn engine calls used across the tests."""

from __future__ import annotations

import torch

from ragen_pl.rollout.engine import SamplingParams
from ragen_pl.types import TrajectoryBatch


def make_batch(
    loss_mask: list[list[int]],
    rewards: list[list[float]] | None = None,
    turn_ids: list[list[int]] | None = None,
    group_ids: list[int] | None = None,
    values: list[list[float]] | None = None,
    old_logprobs: list[list[float]] | None = None,
    env_tags: list[str] | None = None,
) -> TrajectoryBatch:
    mask = torch.tensor(loss_mask, dtype=torch.bool)
    B, T = mask.shape
    if turn_ids is None:
        turn_ids = torch.where(mask, 0, -1).tolist()
    return TrajectoryBatch(
        input_ids=torch.arange(B * T).reshape(B, T),
        attention_mask=torch.ones(B, T, dtype=torch.bool),
        loss_mask=mask,
        rewards=torch.tensor(rewards, dtype=torch.float32) if rewards is not None else torch.zeros(B, T),
        turn_ids=torch.tensor(turn_ids),
        group_ids=torch.tensor(group_ids if group_ids is not None else list(range(B))),
        env_tags=env_tags or ["env"] * B,
        values=torch.tensor(values, dtype=torch.float32) if values is not None else None,
        old_logprobs=torch.tensor(old_logprobs, dtype=torch.float32) if old_logprobs is not None else None,
    )


def random_batch(
    B: int, T: int, *, groups: int | None = None, turns: int = 3, seed: int = 0, p_mask: float = 0.6
) -> TrajectoryBatch:
    """A random multi-turn batch: turns of sampled tokens separated by env tokens, rewards on turn ends."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < p_mask
    mask[:, 0] = False
    # Turn ids: split each row into `turns` contiguous chunks; only sampled tokens carry an id.
    chunk = torch.arange(T).div(max(1, -(-T // turns)), rounding_mode="floor").expand(B, T)
    turn_ids = torch.where(mask, chunk, -1)
    batch = TrajectoryBatch(
        input_ids=torch.randint(0, 100, (B, T), generator=g),
        attention_mask=torch.ones(B, T, dtype=torch.bool),
        loss_mask=mask,
        rewards=torch.zeros(B, T),
        turn_ids=turn_ids,
        group_ids=torch.arange(B) % (groups or B),
        env_tags=["a" if i % 2 else "b" for i in range(B)],
        values=torch.randn(B, T, generator=g),
        old_logprobs=-torch.rand(B, T, generator=g) * 3,
    )
    ends = batch.turn_ends
    batch.rewards = torch.where(ends, torch.randn(B, T, generator=g), 0.0)
    # Each turn starts in one of 3 states (GiGPO's anchors), so turns of a group share states.
    per_turn = torch.randint(0, 3, (B, turns), generator=g)
    batch.turn_states = torch.where(mask, per_turn.gather(1, turn_ids.clamp(min=0)), 0)
    return batch


def split_into_turn_rows(b: TrajectoryBatch) -> TrajectoryBatch:
    """The same trajectories with each turn as its own row (the context-window layout)."""
    rows, traj = [], []
    for i in range(len(b)):
        for k in b.turn_ids[i][b.turn_ids[i] >= 0].unique().tolist():
            rows.append((i, k))
            traj.append(i)
    idx = torch.tensor([i for i, _ in rows])
    part = b.select(idx)
    turn_of = torch.tensor([k for _, k in rows])[:, None]
    keep = part.turn_ids == turn_of
    return TrajectoryBatch(
        input_ids=part.input_ids, attention_mask=part.attention_mask, loss_mask=part.loss_mask & keep,
        rewards=torch.where(keep, part.rewards, 0.0), turn_ids=torch.where(keep, part.turn_ids, -1),
        group_ids=part.group_ids, env_tags=part.env_tags, values=part.values, old_logprobs=part.old_logprobs,
        traj_ids=torch.tensor(traj), turn_states=part.turn_states,
    )


def play_turns(engine, tok, first: list[list[int]], replies: list[str], static: bool = False) -> list[tuple]:
    """Play len(replies) + 1 greedy turns of ``engine``: each next prompt is the last prompt, its answer and a reply
    (rows get replies of different lengths; the last row restarts with a fresh prompt). ``static`` runs the engine's
    static-cache loop uncaptured (the CPU check of the CUDA-graph path). Returns each turn's (prompts, generations)."""
    params = SamplingParams(temperature=0, max_new_tokens=5, stop=[])
    prompts, turns = first, []
    for turn in range(len(replies) + 1):
        if static:
            with torch.no_grad():
                gens = engine._generate_static(engine.model, tok, prompts, params, engine.model.device, capture=False)
        else:
            gens = engine.generate(prompts, params)
        turns.append((prompts, gens))
        if turn < len(replies):
            prompts = [p + g.token_ids + tok(replies[turn] * (1 + i % 3))["input_ids"] for i, (p, g) in
                       enumerate(zip(prompts, gens))]
            prompts[-1] = tok(f"Turn {turn}: a fresh prompt")["input_ids"]
    return turns


def import_benchmark(monkeypatch, name: str):
    """``benchmarks/<name>.py`` as the module ``benchmarks.<name>``."""
    import importlib

    return importlib.import_module(f"benchmarks.{name}")
