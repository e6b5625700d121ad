"""`ragen-pl export` of a readout: the checkpoint records its hooks, and the export rebuilds them, so the exported
folder gives the trained policy's log-probs (the centring folded into the adapter before the merge)."""

import pytest
import torch
from ragen_pl_experiments.readout import ReadoutHead
from ragen_pl_experiments.update import ReadoutUpdate

from ragen_pl.config import LoraSettings

pytest.importorskip("peft", reason="LoRA needs peft (pip install 'ragen-pl[peft]')")


@pytest.mark.parametrize("hook", [ReadoutHead(center=2), ReadoutHead(center=2, whiten=True, tokens=["Right", "Up"])],
                         ids=["centred-head", "whitened-readout-head"])
def test_export_of_a_readout_reloads_with_the_checkpoints_logprobs(tiny_model_path, tmp_path, hook):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_export import logprobs, train_and_export

    module, out = train_and_export(tiny_model_path, tmp_path, LoraSettings(r=4, alpha=8, target_modules=["lm_head"]),
                                   hooks=[hook], updater=ReadoutUpdate)
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(out)("Turn 1:\nState:\n#_P_#")["input_ids"]])
    torch.testing.assert_close(logprobs(exported, ids), logprobs(module.policy, ids), atol=1e-5, rtol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    assert not torch.allclose(logprobs(base, ids), logprobs(exported, ids))  # the training is in the export
