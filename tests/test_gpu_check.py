"""benchmarks/gpu_check.py counts FLOPs honestly (issue 24): the trunk without embeddings and LM head, the head once
(tied or not) and only on scored tokens, the critic without a head; and its plumbing runs on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check import parameter_counts, update_flops  # noqa: E402


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


def test_update_flops_count_positions_scored_tokens_and_the_critic():
    counts = {"trunk": 1000, "head": 50}
    row = {"throughput/update_positions": "10", "throughput/update_scored_tokens": "4"}
    assert update_flops(row, counts, critic=False) == 6 * 1000 * 10 + 6 * 50 * 4
    assert update_flops(row, counts, critic=True) == 6 * 1000 * 10 * 2 + 6 * 50 * 4


@pytest.mark.slow
def test_gpu_check_plumbing_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--shape", "tiny", "--steps", "2",
                          "--paper", "--work", str(tmp_path)], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "paper shape" in out.stdout and "1 GPU, no kept prefix" in out.stdout
