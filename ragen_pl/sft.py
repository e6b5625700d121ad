"""Supervised fine-tuning on multi-turn trajectories (``ragen-pl sft``), and demonstrations to make them.

A JSONL line is one trajectory in the exact layout the rollout uses::

    {"system": "...", "think": true, "turns": [{"user": "...", "assistant": "I go Up.</think><answer>Up</answer>"}]}

``assistant`` is the text after the opening tag the prompt supplies (``<think>`` or ``<answer>``). Sequences are
built with the rollout's own :class:`~ragen_pl.rollout.collector.ChatTokens`, so training sees token for token what
a rollout feeds, and the loss covers exactly the assistant tokens.

``demonstrations`` plays envs with *random legal* actions: enough for a model to learn the answer format and the
action names without being taught any solution (the warm start of the tiny model, see issue 7); or random
*effective* ones (the moves that change the state), or the solver's (a diagnostic only).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from ragen_pl.config import RolloutConfig
from ragen_pl.envs.base import Env
from ragen_pl.rollout.chat import ChatTokens, WindowChat
from ragen_pl.rollout.prompt import first_user_message, format_instruction, next_user_message
from ragen_pl.scoring import scored_logits

PLAYS = ("random", "effective", "expert")


def demonstrations(envs: Sequence[Env], episodes: int, config: RolloutConfig, seed: int = 0,
                   play: str = "random") -> list[dict]:
    """Trajectories in the SFT JSONL layout, ``episodes`` per env, of one of three ways to play:

    * ``random``: uniformly random actions, one to three a turn (the format warm start);
    * ``effective``: uniformly random among :meth:`~ragen_pl.envs.base.Env.effective_actions`, the moves that change
      the state (no walk into a wall or off the map). Still no goal and no reward, but the action depends on the
      board, so the model starts RL with a pathway that reads it (a warm start on ``random`` is board-blind);
    * ``expert``: the env's solver, one action per turn (``benchmarks/probe_solver_sft.py``: a diagnostic of what a
      model can learn to read, never a warm start for RL results)."""
    if play not in PLAYS:
        raise ValueError(f"`play` must be one of {', '.join(PLAYS)}, got {play!r}")
    rng = random.Random(seed)
    fmt = format_instruction(config.think, config.max_actions_per_turn, config.max_new_tokens)
    records = []
    for env in envs:
        if env.actions is None:
            raise ValueError(f"demonstrations need discrete actions; {type(env).__name__} takes free text")
        for _ in range(episodes):
            obs = env.reset(rng.randrange(2**31))
            user = first_user_message(env.instructions, obs, config.max_actions_per_episode, fmt, config.turn_header)
            turns, used = [], 0
            for turn in range(config.max_turns):
                n = rng.randint(1, min(3, config.max_actions_per_turn, config.max_actions_per_episode - used))
                # random and expert choose the turn's actions up front; effective picks each in the state it acts on
                planned = ([env.expert_action()] if play == "expert" else
                           [rng.choice(env.actions) for _ in range(n)] if play == "random" else None)
                actions, reward, done = planned or [], 0.0, False  # (a random turn may name actions past the end)
                for i in range(len(planned) if planned else n):
                    if not planned:  # (a boxed-in player has no effective move: any action then)
                        actions.append(rng.choice(env.effective_actions() or env.actions))
                    obs, r, done, _ = env.step(actions[i])
                    reward += r
                    used += 1
                    if done:
                        break
                answer = " || ".join(actions)
                text = (f"I will try {' then '.join(actions)}.</think><answer>{answer}</answer>" if config.think
                        else f"{answer}</answer>")
                turns.append({"user": user, "assistant": text})
                if done or used >= config.max_actions_per_episode:
                    break
                user = next_user_message(turn + 2, reward, obs, config.max_actions_per_episode - used, fmt,
                                         config.turn_header)
            record = {"system": config.system_prompt, "think": config.think, "turns": turns}
            if config.context_window is not None:  # each turn trains as its own row, as the rollout plays it
                record.update(context_window=config.context_window, instructions=env.instructions)
            records.append(record)
    return records


def encode(record: dict, tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask (true on assistant tokens) of one JSONL record."""
    try:
        turns = record["turns"]
        chat = ChatTokens(tokenizer, record["system"], turns[0]["user"], bool(record.get("think", True)))
        for i, turn in enumerate(turns):
            chat.add_response(tokenizer(turn["assistant"], add_special_tokens=False)["input_ids"], i)
            if i + 1 < len(turns):
                nxt = turns[i + 1]["user"]
                chat.add_user(chat.user_suffix_ids(nxt, ended_with_eos=False), nxt)
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"bad SFT record (needs system, turns[].user, turns[].assistant): {err!r}") from err
    return chat.ids, chat.sampled


def encode_rows(record: dict, tokenizer) -> list[tuple[list[int], list[bool]]]:
    """The training rows of one JSONL record: the whole conversation as one row (:func:`encode`), or, for a record
    played with a context window (``context_window`` and ``instructions`` set), one row per turn: exactly the prompt
    that turn's rollout would feed (:class:`~ragen_pl.rollout.chat.WindowChat`) and its answer."""
    window = record.get("context_window")
    if window is None:
        return [encode(record, tokenizer)]
    try:
        turns = record["turns"]
        chat = WindowChat(tokenizer, record["system"], turns[0]["user"], bool(record.get("think", True)),
                          record["instructions"], int(window))
        for i, turn in enumerate(turns):
            chat.add_response(tokenizer(turn["assistant"], add_special_tokens=False)["input_ids"], i)
            if i + 1 < len(turns):
                chat.extend_user(turns[i + 1]["user"], ended_with_eos=False, max_prompt=10**9)
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise ValueError(f"bad SFT record (needs system, instructions, turns[].user, turns[].assistant): {err!r}") \
            from err
    return [(ids, sampled) for ids, sampled, *_ in chat.rows()]


def read_jsonl(path: str | Path) -> list[dict]:
    records = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{i}: not JSON: {err}") from err
    return records


def write_jsonl(records: Iterable[dict], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


class SFTModule(pl.LightningModule):
    """Masked next-token cross-entropy on assistant tokens."""

    def __init__(self, model, lr: float = 1e-3, warmup_steps: int = 20) -> None:
        super().__init__()
        self.model, self.lr, self.warmup_steps = model, lr, warmup_steps

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        _, logits, labels = scored_logits(self.model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        self.log("sft/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (self.warmup_steps + 1)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _collate(pad_id: int):
    def collate(items: list[tuple[list[int], list[bool]]]) -> dict[str, Tensor]:
        T = max(len(ids) for ids, _ in items)
        ids = torch.full((len(items), T), pad_id, dtype=torch.long)
        attn = torch.zeros((len(items), T), dtype=torch.bool)
        mask = torch.zeros((len(items), T), dtype=torch.bool)
        for i, (x, m) in enumerate(items):
            ids[i, :len(x)], attn[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), True, torch.tensor(m)
        return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}

    return collate


def sft(model_path: str | Path, records: list[dict], out: str | Path, steps: int = 300, lr: float = 1e-3,
        batch_size: int = 16, seed: int = 0, progress: bool = True, precision: str = "32-true",
        accumulate: int = 1) -> float:
    """Fine-tune ``model_path`` on ``records`` and save model and tokenizer to ``out``; return the final loss.

    Each of the ``steps`` optimiser steps sees ``batch_size`` rows (a record, or one turn of a record played with a
    context window), in ``accumulate`` passes (less memory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"--steps and --batch-size must be >= 1 and --lr > 0, got {steps}, {batch_size}, {lr}")
    if not records:
        raise ValueError("no SFT records to train on")
    pl.seed_everything(seed, verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    model.train()
    data = [row for r in records for row in encode_rows(r, tokenizer)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if batch_size % accumulate:
        raise ValueError(f"--batch-size ({batch_size}) must be a multiple of the accumulation ({accumulate})")
    loader = DataLoader(data, batch_size=batch_size // accumulate, shuffle=True, collate_fn=_collate(pad),
                        drop_last=False)
    module = SFTModule(model, lr=lr)
    from ragen_pl.notices import hide_lightning_tips

    hide_lightning_tips()
    trainer = pl.Trainer(max_steps=steps, max_epochs=-1, accumulate_grad_batches=accumulate,
                         logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=progress, accelerator="auto", devices=1,
                         precision=precision)
    trainer.fit(module, loader)
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return float(trainer.callback_metrics.get("sft/loss", float("nan")))
