#!/usr/bin/env bash
# The default model's expert lenses (J++ / R++), their ablation, and the winners shipped (docs/results.md):
#   bash scripts/ship_expert_lenses.sh
# Run scripts/ship_relevance_lens.sh first: its fit holds the R experts (runs/rexp). Then:
#  1. fit (or resume) the J experts with the shipped lenses' corpus and settings (runs/jexp; 100 prompts,
#     8 experts clustered on the first 64 prompts; about 70 s a prompt on a 2-core CPU);
#  2. learn each stack's weights with `jlens weigh` on the training half of the nine shipped sets (the
#     default seeded split), writing the weighted stack and its one-matrix fp16 combination;
#  3. write each stack's uniform-weight combination (the ablation's "experts, uniform" rows);
#  4. compare every lens (scripts/compare_lenses.sh with the four combinations as ADD_LENSES: read, then added
#     to the shipped comparison; the ablation table scores them on the held-out half only);
#  5. ship (assets/lenses/smollm2-135m.{jpp,rpp}.safetensors, fp16, one matrix per layer) each learned
#     lens whose held-out macro pass@10 beats the J lens's outside the paired 95 % interval.
# The per-expert stacks stay in runs/, out of the wheel.
set -euo pipefail
source "$(dirname "$0")/_common.sh" runs/jexp
REXP="${JLENS_REXP_DIR:-runs/rexp}"
[[ -e "$REXP/smollm2-135m.rexp.safetensors" ]] || { echo "no R experts in $REXP: run scripts/ship_relevance_lens.sh first" >&2; exit 2; }
"$PY" -m jlens_core fit --model smollm2-135m --corpus stdlib-docs --split fit --min-chars 600 \
    --n-prompts 100 --max-seq-len 128 --skip-first 16 --dim-batch 8 --experts 8 --cluster-prompts 64 \
    --out "$RUN/smollm2-135m.jexp.safetensors"
for pair in "jpp:$RUN/smollm2-135m.jexp" "rpp:$REXP/smollm2-135m.rexp"; do
    variant="${pair%%:*}"; stem="${pair#*:}"
    [[ -e "$stem.$variant.combined.safetensors" ]] || "$PY" -m jlens_core weigh "$stem.safetensors" \
        --model smollm2-135m --basis-memory 12GiB --out "$stem.$variant.safetensors" \
        --combined "$stem.$variant.combined.safetensors" \
        --save-dtype float16
done
"$PY" - "$RUN/smollm2-135m.jexp" "$REXP/smollm2-135m.rexp" <<'PYEOF'
import sys
from jlens_core.lenses.experts import ExpertLens
for stem in sys.argv[1:]:
    lens = ExpertLens.load(f"{stem}.safetensors")
    lens.to_jacobian_lens().save(f"{stem}.uniform.safetensors", dtype="float16")
    print(f"uniform combination of {lens} -> {stem}.uniform.safetensors")
PYEOF
ADD_LENSES="$RUN/smollm2-135m.jexp.jpp.combined.safetensors $REXP/smollm2-135m.rexp.rpp.combined.safetensors \
$RUN/smollm2-135m.jexp.uniform.safetensors $REXP/smollm2-135m.rexp.uniform.safetensors" \
    bash scripts/compare_lenses.sh
"$PY" - "$RUN/smollm2-135m.jexp.jpp" "$REXP/smollm2-135m.rexp.rpp" <<'PYEOF'
import json
import shutil
import sys

import pandas as pd

from jlens_core.evaluation.lens_comparison import heldout_items, macro_comparison

root = "assets/lenses/smollm2-135m.eval"
detail = pd.read_csv(f"{root}/pass_at_k_detail.csv")
for stem, kind, variant in zip(sys.argv[1:], ("jacobian++", "relevance++"), ("jpp", "rpp")):
    # the items these weights never saw: the split jlens weigh recorded beside them
    record = json.loads(open(f"{stem}.weigh.json", encoding="utf-8").read())
    held = heldout_items(record["sets"], record["heldout_fraction"], seed=record["seed"])
    row = macro_comparison(detail, 10, keep=held).set_index("lens").loc[kind]
    verdict = row["verdict"]
    print(f"{kind}: held-out macro pass@10 {row['macro']:.3f}, vs J {row['diff']:+.3f} "
          f"({row['diff_low']:+.3f} to {row['diff_high']:+.3f}): {verdict}")
    if verdict == "win":
        shutil.copyfile(f"{stem}.combined.safetensors", f"assets/lenses/smollm2-135m.{variant}.safetensors")
        print(f"shipped assets/lenses/smollm2-135m.{variant}.safetensors")
PYEOF
