"""Rollout metrics: pure functions from played episodes to ``dict[str, Tensor]`` with stable slash-separated keys.

Keys are ``rollout/<name>`` for the whole batch and ``rollout/<tag>/<name>`` per env tag (validation uses
``val/<tag>/<name>``). Group metrics (pass@k, in-group reward std) use the trajectories that share an initial state.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from ragen_pl.rollout.collector import Episode

SUCCESS = "success"
PASS_AT_K = "pass_at_k"
RETURN_MEAN = "return_mean"
RETURN_STD = "return_std"
GROUP_REWARD_STD = "group_reward_std"
TURNS = "turns"
ACTIONS = "actions"
VALID_ACTION_RATE = "valid_action_rate"
EFFECTIVE_ACTION_RATE = "effective_action_rate"
FORMAT_ERROR_RATE = "format_error_rate"
RESPONSE_TOKENS_PER_TURN = "response_tokens_per_turn"
RESPONSE_TOKENS = "response_tokens"
FAILED = "failed_envs"
TRUNCATED = "truncated"
REPETITION = "repetition"
THINK_ANSWER_AGREEMENT = "think_answer_agreement"
THINK_WORDS = "think_words"
EPISODES = "episodes"
EFFECTIVE_EPISODES = "effective_episodes"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def think_answer_agreement(think: str, answered: Sequence[str]) -> bool:
    """Whether the thinking names every action the turn then answers (whole words, any case).

    The paper's "shallow or hallucinated reasoning" is thinking that no longer matches the answer after RL
    ("I will try Down." then ``<answer>Right</answer>``); this is the cheap check for envs with named actions.
    """
    words = set(re.findall(r"[a-z0-9]+", think.lower()))
    return all(set(re.findall(r"[a-z0-9]+", a.lower())) <= words for a in answered)


def _reasoning(ok: Sequence[Episode]) -> dict[str, float]:
    """Agreement (envs with named actions) and thinking length in words, over turns that parsed."""
    agree, words = [], []
    for ep in ok:
        named = ep.env.actions is not None
        for t in ep.transcript:
            if t.get("role") != "model" or not t.get("format_ok"):
                continue
            think = t.get("think", "")
            words.append(len(think.split()))
            if named and t.get("answered"):
                agree.append(float(think_answer_agreement(think, t["answered"])))
    out = {THINK_WORDS: _mean(words)}
    if agree:
        out[THINK_ANSWER_AGREEMENT] = _mean(agree)
    return out


def effective_episodes(groups: Sequence[Sequence[float]]) -> float:
    """How many independent episodes the success share of these groups (0/1 successes, one list per group of
    trajectories that share an initial state) is worth: ``p (1 - p)`` over the share's cluster-robust variance,
    between 1 and the episodes. Where a board is easy or hard for all its trajectories (RAGEN's random FrozenLake and
    Sokoban boards), the share varies more than a binomial of the episodes says; where outcomes do not cluster, this
    is about the episode count."""
    n = sum(len(g) for g in groups)
    share = sum(sum(g) for g in groups) / n if n else 0.0
    if len(groups) < 2 or not 0.0 < share < 1.0:
        return float(n)
    k = len(groups)
    variance = k / (k - 1) * sum((len(g) / n) ** 2 * (sum(g) / len(g) - share) ** 2 for g in groups)
    return float(n) if variance <= 0 else min(float(n), max(1.0, share * (1 - share) / variance))


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Metrics of one set of episodes (all of one env tag, or all)."""
    ok = [ep for ep in episodes if ep.failed is None]
    out: dict[str, float] = {FAILED: float(len(episodes) - len(ok))}
    if not ok:
        return out
    returns = torch.tensor([ep.env_return for ep in ok], dtype=torch.float64)
    groups: dict[int, list[Episode]] = defaultdict(list)
    for ep in ok:
        groups[ep.spec.group_id].append(ep)
    group_std = [torch.tensor([e.env_return for e in g], dtype=torch.float64).std().item()
                 for g in groups.values() if len(g) > 1]
    tokens = [ep.response_tokens for ep in ok]
    # The Echo Trap's repetition: the share of a group's first answers that repeat another answer in the group.
    repetition = []
    for g in groups.values():
        texts = [next((t["text"] for t in e.transcript if t["role"] == "model"), "") for e in g]
        if len(texts) > 1:
            repetition.append(1 - (len(set(texts)) - 1) / (len(texts) - 1))
    out.update({
        EPISODES: float(len(ok)),  # what the success share averages over (the Echo Trap alarm's test needs it)
        EFFECTIVE_EPISODES: effective_episodes([[float(e.success) for e in g] for g in groups.values()]),
        SUCCESS: _mean([float(ep.success) for ep in ok]),
        PASS_AT_K: _mean([float(any(e.success for e in g)) for g in groups.values()]),
        RETURN_MEAN: returns.mean().item(),
        RETURN_STD: returns.std().item() if len(ok) > 1 else 0.0,
        GROUP_REWARD_STD: _mean(group_std),
        TURNS: _mean([ep.turns for ep in ok]),
        ACTIONS: _mean([ep.actions for ep in ok]),
        VALID_ACTION_RATE: sum(ep.valid_actions for ep in ok) / max(1, sum(ep.actions for ep in ok)),
        EFFECTIVE_ACTION_RATE: sum(ep.effective_actions for ep in ok) / max(1, sum(ep.actions for ep in ok)),
        FORMAT_ERROR_RATE: sum(ep.format_errors for ep in ok) / max(1, sum(ep.turns for ep in ok)),
        RESPONSE_TOKENS: _mean(tokens),
        RESPONSE_TOKENS_PER_TURN: sum(tokens) / max(1, sum(ep.turns for ep in ok)),
        TRUNCATED: _mean([float(ep.truncated) for ep in ok]),
        REPETITION: _mean(repetition),
    })
    out.update(_reasoning(ok))
    return out


def rollout_metrics(episodes: Sequence[Episode], prefix: str = "rollout", by_tag: bool | None = None
                    ) -> dict[str, Tensor]:
    """Batch-wide metrics under ``prefix/``, and per env tag under ``prefix/<tag>/`` when there are several tags
    (``by_tag=None``), always (``True``: a run of several envs, some of whose processes may play only one) or
    never (``False``)."""
    out = {f"{prefix}/{k}": torch.tensor(v) for k, v in episode_metrics(episodes).items()}
    of_tag: dict[str, list[Episode]] = defaultdict(list)
    for ep in episodes:
        of_tag[ep.env.tag].append(ep)
    if by_tag is None:
        by_tag = len(of_tag) > 1
    if by_tag:
        for tag, eps in of_tag.items():
            out.update({f"{prefix}/{tag}/{k}": torch.tensor(v) for k, v in episode_metrics(eps).items()})
    return out
