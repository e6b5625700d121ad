"""What benchmarks/real_llm.py and benchmarks/vs_trl.py share: SmolLM2 on RAGEN's Bandit.

The evaluation is the config's own (``configs/smollm2-bandit.yaml``): the same fixed seeds as ``ragen-pl fit``'s
validation, sampled at temperature 1 through the project's collector and ``hf`` engine, so a model trained by any
trainer is measured the same way.
"""

from __future__ import annotations

import csv
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2-bandit.yaml"
VAL_SEED = 1_000_000  # RolloutDataModule's default val_seed
GOAL = 0.9


def config() -> dict:
    with open(CONFIG) as f:
        return yaml.safe_load(f)


def rollout_config():
    from ragen_pl.config import RolloutConfig

    return RolloutConfig(**config()["data"]["rollout"])


def evaluate(model, tokenizer, episodes: int | None = None) -> dict[str, float]:
    """Bandit success and format-error rate of ``model`` over the config's evaluation episodes."""
    from ragen_pl.envs.bandit import Bandit
    from ragen_pl.metrics import episode_metrics
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine

    data = config()["data"]
    episodes = episodes or data["val_episodes"]
    engine = HFEngine(seed=0)
    engine.bind(model, tokenizer)
    specs = [EpisodeSpec(Bandit(), seed=VAL_SEED + i, group_id=i) for i in range(episodes)]
    result = Collector(engine, tokenizer, rollout_config()).collect(specs, temperature=data["val_temperature"])
    m = episode_metrics(result.episodes)
    return {"success": float(m["success"]), "format_error_rate": float(m["format_error_rate"])}


def read_metrics(run: Path) -> list[dict[str, str]]:
    """The rows of the metrics.csv that ``ragen-pl fit`` wrote under the logger folder ``run``."""
    with open(next(run.glob("*/version_*/metrics.csv"))) as f:
        return list(csv.DictReader(f))


def curve(rows: list[dict[str, str]]) -> list[dict[str, float]]:
    """Per evaluation: the iterations so far, their training seconds (rollout + update) and the success."""
    points, elapsed, it = [], 0.0, 0
    for r in rows:
        if r.get("time/iteration"):
            elapsed += float(r["time/iteration"])
            it = int(r["step"]) + 1
        if r.get("val/Bandit/success"):
            points.append({"iteration": it, "train_s": elapsed, "success": float(r["val/Bandit/success"])})
    return points


def first_at_goal(points: list[dict[str, float]]) -> dict[str, float] | None:
    return next((p for p in points if p["success"] >= GOAL), None)
