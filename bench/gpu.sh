#!/usr/bin/env bash
# The prepared GPU check, one script for a session lent a GPU (about 5 minutes on one H200):
#   1. fit speed against the reference algorithm (default model, bf16, dim_batch auto, 2 reps);
#   2. the 1B-class random model: lens file load, 64-token readings, one whole fit prompt.
# Writes bench/fit_speed_gpu.json and bench/large_model_gpu.json; prints both tables.
# PY names the interpreter (default: .venv/bin/python if present, else python3); it needs a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
"$PY" -m pip install -q -e . >/dev/null 2>&1 || true
timeout 300 "$PY" bench/fit_speed.py --device cuda --dim-batch auto --seqs 128 --reps 2 --json bench/fit_speed_gpu.json
timeout 240 "$PY" bench/large_model.py --device cuda --json bench/large_model_gpu.json
