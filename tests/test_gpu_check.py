"""benchmarks/gpu_check.py counts FLOPs honestly (issue 24): the trunk without embeddings and LM head, the head once
(tied or not) and only on scored tokens, the critic without a head; and its plumbing runs on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import PEAKS, parameter_counts, peak_flops, update_flops

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_hand_derived(tmp_path, tied):
    from transformers import Qwen2Config

    # vocab 100, hidden 8, one layer: q (8x8 + 8), k and v (8x4 + 4 each: 2 kv heads of 2... head dim 4 x 1 kv head),
    # o (8x8), mlp 3 x (8x16), two layer norms (8 each), final norm 8.
    cfg = Qwen2Config(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=tied)
    cfg.save_pretrained(tmp_path)
    attention = (8 * 8 + 8) + 2 * (8 * 4 + 4) + 8 * 8
    trunk = attention + 3 * 8 * 16 + 2 * 8 + 8
    assert parameter_counts(tmp_path) == {"trunk": trunk, "head": 100 * 8}


def test_update_flops_count_trunk_and_head_on_the_positions_each_computed():
    """Hardware FLOPs: the trunk on its positions (padding included), the head on the positions it computed logits at
    (6 here, though 4 tokens were scored: the head runs on every row of a column some row scores)."""
    counts = {"trunk": 1000, "head": 50}
    row = {"throughput/update_positions": "10", "throughput/update_scored_tokens": "4",
           "throughput/update_head_positions": "6"}
    assert update_flops(row, counts, critic=False) == 6 * 1000 * 10 + 6 * 50 * 6
    assert update_flops(row, counts, critic=True) == 6 * 1000 * 10 * 2 + 6 * 50 * 6


def test_head_positions_are_what_the_head_computed():
    """Two rows padded to 6: row 0 scores tokens 3-4, row 1 tokens 2-5. The head runs at columns 1-4 (the logits at
    t-1 score token t) for both rows: 8 positions, 6 tokens scored; packed, only the 6."""
    import torch
    from transformers import AutoModelForCausalLM

    from ragen_pl.models.tiny import build_tiny_model
    from ragen_pl.scoring import score

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model())
    ids = torch.arange(3, 15).view(2, 6)
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        padded, packed = score(model, ids, attn, mask), score(model, ids, attn, mask, pack=True)
    assert (padded.scored, padded.head_positions) == (6, 8)
    assert (packed.scored, packed.head_positions) == (6, 6)


def test_the_peak_is_found_by_the_exact_device_name():
    """An H100 PCIe or NVL is not the SXM part, an RTX A1000 is no A100: exact names, else --peak-tflops."""
    assert peak_flops("NVIDIA H100 80GB HBM3", None) == 989e12
    assert peak_flops("NVIDIA H100 PCIe", None) == 756e12 and peak_flops("NVIDIA H100 NVL", None) == 835e12
    assert peak_flops("NVIDIA RTX A1000", None) is None and peak_flops("NVIDIA A100X", None) is None
    assert peak_flops("NVIDIA RTX A1000", 30.0) == 30e12
    assert all(name.startswith("NVIDIA ") for name in PEAKS)


@pytest.mark.slow
def test_gpu_check_plumbing_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--shape", "tiny", "--steps", "2",
                          "--paper", "--work", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "paper shape" in out.stdout and "1 GPU, no kept prefix" in out.stdout
