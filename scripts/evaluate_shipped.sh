#!/usr/bin/env bash
# Train (or resume) the default model's shipped tuned lens, then evaluate the three lenses (logit,
# Jacobian, tuned) on held-out texts, pass@k on every shipped set and swap success:
#   bash scripts/evaluate_shipped.sh
# The tuned lens: 160 steps x 128 tokens (20,480 tokens) of the built-in corpus's "fit" split (the
# texts the Jacobian lens was fitted on), Adam lr 1e-3, stored in fp16. Results go to
# assets/lenses/smollm2-135m.eval/; scripts/readme_tables.py writes their tables into docs/results.md.
set -euo pipefail
source "$(dirname "$0")/_common.sh" runs/tuned
"$PY" -m jlens_core tune --model smollm2-135m --corpus stdlib-docs --split fit --min-chars 600 --n-texts 200 \
    --steps 160 --tokens-per-step 128 --lr 1e-3 --heldout-texts 8 --heldout-every 40 \
    --out "$RUN/smollm2-135m.tuned.safetensors"
"$PY" - "$RUN" <<'PYEOF'
import sys
from jlens_core.lenses.tuned import TunedLens
lens = TunedLens.load(f"{sys.argv[1]}/smollm2-135m.tuned.safetensors")
lens.save("assets/lenses/smollm2-135m.tuned.safetensors", dtype="float16")
print(f"shipped {lens}")
PYEOF
SETS=()
for f in assets/evaluations/*.json; do SETS+=(--pass-at-k "$(basename "$f" .json)"); done
"$PY" -m jlens_core eval --model smollm2-135m --lens logit --lens default --lens tuned \
    --shrinkage 0.25 --shrinkage 0.5 --corpus stdlib-docs --split eval --n-texts "$EVAL_TEXTS" --max-seq-len 128 \
    "${SETS[@]}" --swap swaps --out assets/lenses/smollm2-135m.eval
"$PY" scripts/readme_tables.py
