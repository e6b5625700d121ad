"""What the research scripts share: the SmolLM2 configs, their envs, the random policy's success, the runs' metrics, and
the actions an optimal policy may take."""

from __future__ import annotations

import copy
import csv
import math
import random
from pathlib import Path

import yaml

EXPERIMENTS = Path(__file__).resolve().parents[2]
"""The experiments folder of a ragen-pl checkout (the package is installed from it: ``pip install -e experiments``)."""
ENVS = {"bandit": "Bandit", "frozenlake": "FrozenLake", "sokoban": "Sokoban",
        "coordfrozenlake": "CoordFrozenLake", "coordsokoban": "CoordSokoban"}
#: Issue 59's goals on RAGEN-2's main-table envs: the final evaluation at least the random policy's success plus this.
COORD_GOALS = {"coordfrozenlake": 0.15, "coordsokoban": 0.10}


def config_path(env: str) -> Path:
    """``smollm2-<env>.yaml``: Bandit's is the library's (``configs/``), the readout runs' are the experiments'."""
    return (EXPERIMENTS.parent / "configs" if env == "bandit" else EXPERIMENTS / "configs") / f"smollm2-{env}.yaml"


def load_config(env: str) -> dict:
    with open(config_path(env)) as f:
        return yaml.safe_load(f)


def make_env(spec: dict):
    from ragen_pl import registry

    return registry.resolve("envs", spec["class_path"], **(spec.get("init_args") or {}))


def random_success(cfg: dict, repeats: int, budget: int | None = None, effective: bool = False) -> float:
    """Success of uniformly random actions over the config's evaluation seeds, ``repeats`` plays per seed, with its
    per-episode action budget (or ``budget`` actions: as many as the model used); ``effective``: random among the
    moves that change the state (the play of the ``effective`` warm start)."""
    data = cfg["data"]
    env = make_env(data["env"])
    budget = budget or data["rollout"].get("max_actions_per_episode", 10)
    seeds = range(data.get("val_seed", 1_000_000), data.get("val_seed", 1_000_000) + data["val_episodes"])
    rng, wins, plays = random.Random(0), 0, 0
    for seed in seeds:
        for _ in range(repeats):
            env.reset(seed)
            success = False
            for _ in range(budget):
                _, _, done, info = env.step(rng.choice(env.effective_actions() if effective else env.actions))
                success = success or bool(info.get("success"))
                if done:
                    break
            wins, plays = wins + success, plays + 1
    return wins / plays


def read_runs(save: Path) -> list[list[dict[str, str]]]:
    """The metrics.csv rows of each run logged under ``save``, oldest first (the fit, then the validate)."""
    runs = []
    for path in sorted(save.glob("*/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with open(path) as f:
            runs.append(list(csv.DictReader(f)))
    return runs


def fit_rows(runs: list[list[dict[str, str]]]) -> list[dict[str, str]]:
    """One fit's rows from its runs, oldest first (a run and its resumptions): each resumption replaces what an earlier
    one logged from its first step on (a run killed after logging an iteration it had not checkpointed)."""
    rows: list[dict[str, str]] = []
    for run in runs:
        steps = [int(r["step"]) for r in run if r.get("time/iteration")]
        if steps and rows:
            rows = [r for r in rows if int(r["step"]) < min(steps)]
        rows += run
    return rows


def curve(rows: list[dict[str, str]], tag: str) -> list[dict[str, float]]:
    """Per evaluation: iterations so far, their training seconds and the success."""
    points, elapsed, it = [], 0.0, 0
    for r in rows:
        if r.get("time/iteration"):
            elapsed += float(r["time/iteration"])
            it = int(r["step"]) + 1
        if r.get(f"val/{tag}/success"):
            points.append({"iteration": it, "train_s": elapsed, "success": float(r[f"val/{tag}/success"])})
    return points


def mean_of(rows: list[dict[str, str]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key)]
    return sum(values) / len(values) if values else float("nan")


def two_se(p0: float, n0: int, p1: float, n1: int) -> float:
    """Two standard errors of the difference of two success rates measured on n0 and n1 episodes."""
    return 2 * math.sqrt(max(p0 * (1 - p0), 1e-12) / n0 + max(p1 * (1 - p1), 1e-12) / n1)




def optimal_first_actions(env) -> set[str]:
    """The actions an optimal policy may take in ``env``'s current state (FrozenLake: the best within the episode's
    10 actions, by finite-horizon value iteration; Sokoban: those that start a shortest solution)."""
    from ragen_pl.envs.frozen_lake import FrozenLake, action_values

    if isinstance(env, FrozenLake):
        qs = action_values(env, budget=10)
        best = max(qs.values())
        return {a for a, v in qs.items() if v >= best - 1e-9}
    from ragen_pl.envs.sokoban import solve

    length = len(solve(env) or [])
    best = set()
    for a in env.actions:
        after = copy.deepcopy(env)
        _, _, done, info = after.step(a)
        rest = 0 if info.get("success") else len(solve(after) or [None] * 999)
        if 1 + rest == length:
            best.add(a)
    return best


def readout(cfg: dict) -> dict:
    """The init_args of the config's ReadoutHead hook (``center``, ``whiten``, ``tokens``)."""
    for hook in cfg["model"].get("hooks") or []:
        if hook["class_path"].endswith("ReadoutHead"):
            return hook.get("init_args") or {}
    raise ValueError("the config has no ReadoutHead hook")
