"""Engines that keep their own copy of the weights (vLLM) sample the current policy: after every update, and from
the first rollout of a resumed run or a validation from a checkpoint, whose weights are not the model path's."""

import copy

import lightning.pytorch as pl
import pytest
import torch

from ragen_pl.callbacks import WeightSync
from ragen_pl.config import OptimConfig, PPOConfig, RolloutConfig
from ragen_pl.data import RolloutDataModule
from ragen_pl.envs.bandit import Bandit
from ragen_pl.filters import NoFilter
from ragen_pl.module import RagenModule
from ragen_pl.rollout.engine import RolloutEngine
from ragen_pl.rollout.hf import HFEngine


class CopyEngine(RolloutEngine):
    """Samples with its own copy of the policy, built at bind (as vLLM loads the model path) and refreshed only
    through ``load_weights``. Before every generate it records how far its copy is from the module's policy."""

    holds_weights = True

    def __init__(self, module: RagenModule) -> None:
        self.module, self.gaps, self.loads = module, [], 0
        self.inner = HFEngine(seed=0)

    def bind(self, model, tokenizer) -> None:
        self.copy = copy.deepcopy(model)
        self.inner.bind(self.copy, tokenizer)

    def load_weights(self, state_dict) -> None:
        self.loads += 1
        self.copy.load_state_dict(state_dict)

    def generate(self, prompts, params):
        policy = dict(self.module.policy.named_parameters())
        with torch.no_grad():
            self.gaps.append(max(float((p - policy[n]).abs().max()) for n, p in self.copy.named_parameters()))
        return self.inner.generate(prompts, params)

    def end_rollout(self) -> None:
        self.inner.end_rollout()


def make(model_path):
    module = RagenModule(str(model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4),
                         optim=OptimConfig(actor_lr=1e-2, critic_lr=1e-2))
    engine = CopyEngine(module)
    dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(), engine=engine,
                           rollout=RolloutConfig(max_turns=1, max_new_tokens=6, think=False), val_episodes=2)
    return module, dm, engine


def trainer(steps, root, **kw):
    return pl.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, val_check_interval=1, callbacks=[WeightSync()],
                      default_root_dir=root, accelerator="cpu", **kw)


def test_every_rollout_samples_the_current_policy(tiny_model_path, tmp_path):
    module, dm, engine = make(tiny_model_path)
    trainer(2, tmp_path, enable_checkpointing=False).fit(module, dm)
    assert len(engine.gaps) >= 4  # training rollouts and validations
    assert max(engine.gaps) == 0.0


def test_a_resumed_run_and_a_validation_sample_the_checkpoint(tiny_model_path, tmp_path):
    module, dm, _ = make(tiny_model_path)
    t = trainer(1, tmp_path)
    t.fit(module, dm)
    ckpt = t.checkpoint_callback.best_model_path or next(tmp_path.rglob("*.ckpt"))
    trained = {n: p.detach().clone() for n, p in module.policy.named_parameters()}

    resumed, dm2, engine = make(tiny_model_path)  # built from the model path, as a new process would be
    assert any(not torch.equal(p, trained[n]) for n, p in resumed.policy.named_parameters())
    trainer(2, tmp_path / "resume").fit(resumed, dm2, ckpt_path=str(ckpt))
    assert engine.gaps and max(engine.gaps) == 0.0

    checked, dm3, engine = make(tiny_model_path)
    trainer(1, tmp_path / "validate").validate(checked, dm3, ckpt_path=str(ckpt))
    assert engine.loads >= 1 and engine.gaps and max(engine.gaps) == 0.0


@pytest.mark.slow
def test_a_third_party_engine_with_its_own_weights_samples_every_update(tiny_model_path, tmp_path, monkeypatch):
    """The example plugin's CopyEngine, pip-installed and found by its entry name, is written against the base class
    and the README only (``holds_weights = True``, ``load_weights``): every rollout samples the current policy, and a
    run resumed from a checkpoint samples the checkpoint's weights."""
    import subprocess
    import sys
    from pathlib import Path

    from ragen_pl import registry

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(Path(__file__).resolve().parents[1] / "plugins" / "ragen-pl-example")],
                   check=True, capture_output=True)
    monkeypatch.syspath_prepend(str(target))
    try:
        engine_cls = registry.load_plugins(reload=True)["ragen_pl.rollout_engines"]["copy_engine"].cls
    finally:
        registry._cache = None

    def run(steps, root, ckpt=None):
        module = RagenModule(str(tiny_model_path), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=4),
                             optim=OptimConfig(actor_lr=1e-2, critic_lr=1e-2))
        engine = engine_cls(seed=0)
        gaps = []
        original = engine.generate

        def checked(prompts, params):  # how far the engine's copy is from the policy, at every call
            policy = dict(module.policy.named_parameters())
            with torch.no_grad():
                gaps.append(max(float((p - policy[n]).abs().max()) for n, p in engine.copy.named_parameters()))
            return original(prompts, params)

        engine.generate = checked
        dm = RolloutDataModule(Bandit(), n_groups=2, group_size=2, filter=NoFilter(), engine=engine,
                               rollout=RolloutConfig(max_turns=1, max_new_tokens=4, think=False), val_episodes=2)
        t = trainer(steps, root, limit_val_batches=0)
        t.fit(module, dm, ckpt_path=ckpt)
        return t, module, gaps

    t, module, gaps = run(3, tmp_path / "a")
    assert len(gaps) == 3 and max(gaps) == 0.0  # three rollouts, each with the weights of the updates before it
    ckpt = str(next((tmp_path / "a").rglob("*.ckpt")))
    _, _, gaps = run(4, tmp_path / "b", ckpt=ckpt)
    assert len(gaps) == 1 and max(gaps) == 0.0  # the resumed run's first rollout: the checkpoint's weights
