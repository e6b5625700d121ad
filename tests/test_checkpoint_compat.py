"""Checkpoints of ragen-pl 0.1 (before the update moved out of RagenModule) still load: their hyperparameters are
plain values that rebuild the module, and its state dict has the same names and shapes.

``tests/data/checkpoint_v0_1.json`` holds the ``hyper_parameters`` and state-dict shapes of three checkpoints saved
by that version (GAE with a separate critic; GRPO with a shared head and LoRA; GAE with a shared head, a KL term and
reward normalisation); the model path is a placeholder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragen_pl.module import RagenModule

RECORDED = json.loads((Path(__file__).parent / "data" / "checkpoint_v0_1.json").read_text())


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_a_0_1_checkpoint_rebuilds_the_same_module(tiny_model_path, name):
    saved = RECORDED[name]
    hparams = saved["hyper_parameters"]
    assert "temperature" in hparams["ppo"]  # the old, now removed setting is in there
    module = RagenModule.from_hparams(hparams, model=str(tiny_model_path))
    assert type(module.advantage).__module__ + "." + type(module.advantage).__qualname__ == hparams["advantage"]
    for key, value in (hparams["advantage_args"] or {}).items():
        assert getattr(module.advantage, key) == value
    shapes = {k: list(v.shape) for k, v in module.state_dict().items()}
    assert shapes == saved["state_dict"]
    # The hyperparameters it saves now describe the same run (the resume check compares these).
    from ragen_pl.checkpoint import model_differences

    assert model_differences(hparams, {**dict(module.hparams), "model": hparams["model"]}) == []
