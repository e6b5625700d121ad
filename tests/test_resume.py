"""A run killed after 2 steps and resumed from its checkpoint continues exactly like an uninterrupted run."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ragen_pl.advantages import GAE
from ragen_pl.config import OptimConfig, PPOConfig, RolloutConfig
from ragen_pl.data import RolloutDataModule
from ragen_pl.envs.sokoban import Sokoban
from ragen_pl.filters import VarianceTopP
from ragen_pl.module import RagenModule

KEYS = ("loss/policy", "loss/value", "loss/entropy", "rollout/return_mean", "actor/grad_norm")


class Record(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append([float(trainer.callback_metrics[k]) for k in KEYS])


def run(model_path, root, steps, ckpt_path=None):
    pl.seed_everything(0)
    module = RagenModule(str(model_path), advantage=GAE(), ppo=PPOConfig(mini_batch_size=4, micro_batch_size=2),
                         optim=OptimConfig(actor_lr=1e-3, critic_lr=1e-3, warmup_steps=2))
    dm = RolloutDataModule(Sokoban(), n_groups=4, group_size=2, filter=VarianceTopP(top_p=0.5),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=6), seed=7)
    record = Record()
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_last=True, save_top_k=0)
    trainer = pl.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[record, ckpt], default_root_dir=root)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return record.rows, dm


def test_resume_is_identical(tiny_model_path, tmp_path):
    straight, _ = run(tiny_model_path, tmp_path / "a", 4)
    first, _ = run(tiny_model_path, tmp_path / "b", 2)  # ... and the process is gone
    second, dm = run(tiny_model_path, tmp_path / "b2", 4, ckpt_path=str(tmp_path / "b" / "last.ckpt"))
    assert len(straight) == 4 and len(first) == 2 and len(second) == 2
    assert dm.iteration == 4  # the env seed counter continued
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight), rtol=0, atol=0)
