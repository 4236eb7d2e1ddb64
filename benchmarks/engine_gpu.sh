#!/usr/bin/env bash
# The engines benchmark on a CUDA machine, for a user's model: tokens/s of `--engine hf` against `--engine vllm`
# (benchmarks/engines.py) and one full `speccache precompute` per engine, whose summary lines give the wall time.
#
#   benchmarks/engine_gpu.sh MODEL_DIR [DATA] [LIMIT]
#
# MODEL_DIR: a local Hugging Face model directory (safetensors). DATA: chat data (default: the demo data).
# LIMIT: samples (default 2000). TP (environment): vLLM's --tensor-parallel-size for the precompute run (default 1).
# Needs an environment with speccache[vllm] (GPU vLLM) installed; VENV names it if it is not the active one.
# Writes bench-out/engine-gpu/{report.md,hf,vllm}; the report is what to paste into docs/benchmarks.md.
set -euo pipefail
MODEL=${1:?usage: benchmarks/engine_gpu.sh MODEL_DIR [DATA] [LIMIT]}
PY=${VENV:+$VENV/bin/}python
DATA=${2:-$("$PY" -c 'from speccache.demo import demo_data_path; print(demo_data_path("sharegpt"))')}
LIMIT=${3:-2000}
TP=${TP:-1}
OUT=bench-out/engine-gpu
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" benchmarks/engines.py --model "$MODEL" --limit "$LIMIT" --batch-size 8 --model-dtype bf16 \
    --out "$OUT/report.md"
for ENGINE in hf vllm; do
    rm -rf "${OUT:?}/$ENGINE"
    # vLLM is given large batches: it schedules them itself, without padding.
    BATCH=$([ "$ENGINE" = vllm ] && echo 256 || echo 8)
    PARALLEL=$([ "$ENGINE" = vllm ] && echo "--tensor-parallel-size $TP" || true)
    "$PY" -m speccache precompute --model "$MODEL" --data "$DATA" --out "$OUT/$ENGINE" --limit "$LIMIT" \
        --engine "$ENGINE" --batch-size "$BATCH" --shard-size 256 --model-dtype bf16 $PARALLEL >"$OUT/$ENGINE.log" 2>&1
    echo "$ENGINE (--batch-size $BATCH): $(grep '^speccache:' "$OUT/$ENGINE.log")" | tee -a "$OUT/report.md"
done
