#!/usr/bin/env bash
# Fit (or resume: rerun after an interruption) the default model's R-lens and its R-expert stack, and ship
# the R-lens: bash scripts/ship_relevance_lens.sh [N_PROMPTS]
# The same corpus, split and settings as the shipped Jacobian lens (scripts/ship_default_lens.sh: the
# built-in corpus's "fit" split, texts of >= 600 characters, the first N_PROMPTS (default 100), all source
# layers, target = last layer, max_seq_len 128, skip_first 16), with the relevance rules
# (docs/method.md §9.1) and 8 experts clustered on the first 64 prompts: the experts cost no extra
# backward pass, and the pooled matrix of the same fit is the R-lens. Ships the R-lens in fp16
# (assets/lenses/smollm2-135m.relevance.safetensors) with its convergence plot; the per-expert stack
# stays in the run folder (runs/rexp), out of the wheel. About 80 s a prompt on a 2-core CPU.
set -euo pipefail
N="${1:-100}"
source "$(dirname "$0")/_common.sh" runs/rexp
"$PY" -m jlens_core fit --model smollm2-135m --corpus stdlib-docs --split fit --min-chars 600 \
    --n-prompts "$N" --max-seq-len 128 --skip-first 16 --dim-batch 8 --rules relevance --experts 8 \
    --cluster-prompts 64 --out "$RUN/smollm2-135m.rexp.safetensors"
"$PY" - "$RUN" <<'PYEOF'
import sys
from jlens_core.lenses.experts import ExpertLens
from jlens_core.figures.png_plots import plot_convergence
experts = ExpertLens.load(f"{sys.argv[1]}/smollm2-135m.rexp.safetensors")
lens = experts.pooled_lens()
lens.save("assets/lenses/smollm2-135m.relevance.safetensors", dtype="float16")
plot_convergence(lens.diagnostics, "assets/lenses/smollm2-135m.relevance.convergence.png",
                 f"SmolLM2-135M-Instruct: R-lens fit convergence over {lens.n_prompts} prompts")
print(f"shipped {lens} (kind {lens.kind}); experts: {experts}")
PYEOF
