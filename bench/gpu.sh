#!/usr/bin/env bash
# The prepared GPU check, one script for a session lent a GPU (about 5 minutes on one H200):
#   1. fit speed against the reference algorithm (default model, bf16, dim_batch auto, 2 reps);
#   2. the 1B-class random model: lens file load, 64-token readings, one whole fit prompt;
#   3. the same model over several devices (bench/large_model.py --device-map): layers 0-7 on the CPU and
#      8-15 on cuda:0 (fp32; the fit prompt backpropagates into the CPU's last layer), then accelerate's
#      device_map="auto" over all visible GPUs (bf16, the whole fit prompt).
# Writes bench/fit_speed_gpu.json, bench/large_model_gpu.json, bench/large_model_split_gpu.json and
# bench/large_model_auto_gpu.json (next to the CPU figures, bench/*.json); prints the tables.
# PY names the interpreter (default: .venv/bin/python if present, else python3); it needs a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
"$PY" -m pip install -q -e . >/dev/null 2>&1 || true
timeout 300 "$PY" bench/fit_speed.py --device cuda --dim-batch auto --seqs 128 --reps 2 --json bench/fit_speed_gpu.json
timeout 240 "$PY" bench/large_model.py --device cuda --json bench/large_model_gpu.json
timeout 240 "$PY" bench/large_model.py --device cuda --device-map cpu,cuda:0 --dtype float32 --budget-seq 64 \
    --json bench/large_model_split_gpu.json
timeout 180 "$PY" bench/large_model.py --device cuda --device-map auto --budget-layers 15 \
    --json bench/large_model_auto_gpu.json
