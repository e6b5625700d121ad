#!/usr/bin/env bash
# The GPU path once, end to end, as one table: rollout tokens/s per engine (hf, bare generate, vLLM where installed)
# and training under one GPU, FSDP1 and FSDP2 (iteration time, update tokens/s, MFU, peak memory), then one run at the
# paper's shape (8 x 16 trajectories, 5 turns, up to 400 tokens per turn). A model of the
# Qwen2.5-0.5B shape with random weights: no model hub needed. See benchmarks/gpu_check.py for what it needs.
#   bash benchmarks/gpu_check.sh [--steps 3]
# GPU_CHECK_SHAPE=tiny runs the same plumbing with a tiny model on the CPU (a smoke test of this script).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec python benchmarks/gpu_check.py --paper "$@"
