#!/usr/bin/env bash
# Regenerate the shipped lens of the default model, its evaluation and its figures:
#   bash scripts/ship_default_lens.sh [N_PROMPTS]
# Fits (or resumes: rerun after an interruption) the default model on the built-in corpus's "fit"
# split, all source layers, target = last layer, max_seq_len 128, up to N_PROMPTS prompts (default
# all 428 texts of >= 600 characters); then stores it in fp16 under assets/lenses/ and evaluates it
# against the logit lens on held-out texts (the "eval" split) and on the shipped pass@k sets.
# JLENS_SHIP_EXTEND=1: where no checkpoint exists, go on from the shipped lens's prompts instead of
# refitting them (scripts/checkpoint_from_lens.py; those prompts keep the lens's fp16 rounding).
set -euo pipefail
N="${1:-428}"
source "$(dirname "$0")/_common.sh" runs/shipped
mkdir -p assets/lenses
if [[ "${JLENS_SHIP_EXTEND:-0}" == 1 && ! -e "$RUN/smollm2-135m.ckpt" ]]; then
    "$PY" scripts/checkpoint_from_lens.py assets/lenses/smollm2-135m.safetensors "$RUN/smollm2-135m.ckpt" \
        --corpus stdlib-docs --split fit --min-chars 600
fi
"$PY" -m jlens_core fit --model smollm2-135m --corpus stdlib-docs --split fit --min-chars 600 \
    --n-prompts "$N" --max-seq-len 128 --skip-first 16 --dim-batch 8 --out "$RUN/smollm2-135m.safetensors"
"$PY" - "$RUN" <<'PYEOF'
import sys
from jlens_core import JacobianLens
from jlens_core.figures.png_plots import plot_convergence
lens = JacobianLens.load(f"{sys.argv[1]}/smollm2-135m.safetensors")
lens.save("assets/lenses/smollm2-135m.safetensors", dtype="float16")
plot_convergence(lens.diagnostics, "assets/lenses/smollm2-135m.convergence.png",
                 f"SmolLM2-135M-Instruct: fit convergence over {lens.n_prompts} prompts")
print(f"shipped {lens}")
PYEOF
"$PY" -m jlens_core eval --model smollm2-135m --lens logit --lens assets/lenses/smollm2-135m.safetensors \
    --shrinkage 0.25 --shrinkage 0.5 --corpus stdlib-docs --split eval --n-texts "$EVAL_TEXTS" --max-seq-len 128 \
    --pass-at-k two_hop --pass-at-k arithmetic_chain --pass-at-k antonym_chain --pass-at-k translation_pivot \
    --out assets/lenses/smollm2-135m.eval
