#!/usr/bin/env bash
# The GPU path once, end to end: a model with the Qwen2.5-0.5B shape and random weights (no hub needed), the
# sokoban config with bf16, FSDP when several GPUs are visible, and the vLLM engine where vLLM is installed.
# Prints iteration time, rollout tokens/s and peak GPU memory. Run it whenever a GPU is available and record the
# figures in the README with the date and the GPU.
#   bash benchmarks/gpu_check.sh [STEPS]
# GPU_CHECK_SHAPE=tiny runs the same plumbing with a tiny model (a smoke test of this script on a CPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-3}
OUT=${OUT:-/tmp/ragen-pl-gpu-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
SHAPE=${GPU_CHECK_SHAPE:-qwen2.5-0.5b}
python - "$OUT/model-$SHAPE" "$SHAPE" <<'PY'
import sys
from pathlib import Path
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from ragen_pl.tiny import build_tiny_model

out = Path(sys.argv[1])
if not (out / "config.json").exists():
    tok = AutoTokenizer.from_pretrained(build_tiny_model())
    shape = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2)  # Qwen2.5-0.5B
    if sys.argv[2] == "tiny":
        shape = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1)
    cfg = Qwen2Config(**shape, max_position_embeddings=32768, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
print(f"model: {out}")
PY
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
EXTRA=()
if [ "$NGPU" -eq 0 ]; then EXTRA+=(--trainer.accelerator=cpu --data.n_groups=2 --data.group_size=2); fi
if [ "$NGPU" -gt 1 ]; then EXTRA+=(--config configs/variants/fsdp.yaml --trainer.devices="$NGPU"); fi
if python -c "import vllm" 2>/dev/null; then EXTRA+=(--data.engine=vllm); ENGINE=vllm; else ENGINE=hf; fi
echo "GPUs: $NGPU, engine: $ENGINE"
python -m ragen_pl.cli fit --config configs/sokoban.yaml "${EXTRA[@]}" --model.model="$OUT/model-$SHAPE" \
  --trainer.max_steps="$STEPS" --trainer.limit_val_batches=0 --trainer.enable_progress_bar=false \
  --trainer.logger.init_args.save_dir="$OUT/runs" --model.dtype=bfloat16 --data.rollout.max_new_tokens=128
python - "$OUT/runs" <<'PY'
import csv, statistics, sys
from pathlib import Path
import torch
f = sorted(Path(sys.argv[1]).glob("*/version_*/metrics.csv"))[-1]
rows = [r for r in csv.DictReader(open(f)) if r.get("time/update")]
def med(k): return statistics.median(float(r[k]) for r in rows if r.get(k))
it = med("time/rollout_generate") + med("time/rollout_env") + med("time/rollout_tokenize") + med("time/prepare") + med("time/update")
print(f"iteration {it:.2f}s (generate {med('time/rollout_generate'):.2f}s, update {med('time/update'):.2f}s), "
      f"rollout {med('throughput/rollout_tokens_per_s'):.0f} tokens/s, "
      f"peak GPU memory {max((float(r['gpu/peak_memory_gib']) for r in rows if r.get('gpu/peak_memory_gib')), default=0):.2f} GiB")
PY
