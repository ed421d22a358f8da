#!/usr/bin/env bash
# Compare the default model's shipped lenses under one protocol (docs/results.md, "Which lens"):
#   bash scripts/compare_lenses.sh
# Lenses: logit, tuned, J and every shipped variant present (R-lens, J++, R++), plus any lens files in
# $EXTRA_LENSES (space-separated; e.g. an expert stack with uniform weights from runs/). Writes, under
# assets/lenses/smollm2-135m.eval/:
#   .            per-layer KL/CE on the corpus's held-out "eval" split ($EVAL_TEXTS texts) and pass@k on every
#                shipped set, readout vocab=all (SHRINK="--shrinkage 0.25 --shrinkage 0.5" adds shrunk J lenses)
#   word/        pass@k with the word-token readout (vocab=word)
#   decoy/       pass@k of each item on another item's intermediates (the decoy control, docs/method.md §8)
#   swap/        swap success of the J-type lenses (and logit), raw read directions, a norm-matched control
#                per lens and a random-direction control
#   swap_centred/ the same along centred read directions
# then writes the tables into docs/results.md (scripts/readme_tables.py).
# ADD_LENSES (space-separated lens files) grows an existing comparison instead: only these lenses are read
# (per-layer, pass@k all and word, swaps raw and centred, in $RUN/added/) and their rows appended to $OUT's
# tables (scripts/merge_eval.py; each lens's numbers depend on that lens alone); the decoy run reads every lens.
# For a quick check of the pipeline: OUT=/tmp/x PASS_SETS="two_hop" SWAP_SET=small.jsonl EVAL_TEXTS=2 \
#   TABLES_ARGS=--print bash scripts/compare_lenses.sh
set -euo pipefail
source "$(dirname "$0")/_common.sh" runs/compare
OUT="${OUT:-assets/lenses/smollm2-135m.eval}"
SWAP_SET="${SWAP_SET:-swaps}"
SETS=()
if [[ -n "${PASS_SETS:-}" ]]; then
    for s in $PASS_SETS; do SETS+=(--pass-at-k "$s"); done
else
    for f in assets/evaluations/*.json; do SETS+=(--pass-at-k "$(basename "$f" .json)"); done
fi
VARIANTS=()
for v in relevance jpp rpp; do
    if [[ -e "assets/lenses/smollm2-135m.$v.safetensors" ]]; then VARIANTS+=(--lens "smollm2-135m:$v"); fi
done
for f in ${EXTRA_LENSES:-}; do VARIANTS+=(--lens "$f"); done
LENSES=(--lens logit --lens default --lens tuned "${VARIANTS[@]}")
COMMON=(--model smollm2-135m --max-seq-len 128)
rm -f "$OUT/swap_success.csv" "$OUT/swap_items.csv"  # swaps now live in swap/ and swap_centred/
# one comparison: the per-layer and pass@k runs, then swaps, of LENSES (swaps: SWAP_LENSES) into folder $1
compare() {
    local dest="$1"
    "$PY" -m jlens_core eval "${COMMON[@]}" "${LENSES[@]}" ${SHRINK:-} --corpus stdlib-docs \
        --split eval --n-texts "$EVAL_TEXTS" "${SETS[@]}" --out "$dest"
    "$PY" -m jlens_core eval "${COMMON[@]}" "${LENSES[@]}" --n-texts 0 "${SETS[@]}" --vocab word --out "$dest/word"
    for mode in raw centred; do
        flag=(); dir="$dest/swap"
        if [[ $mode == centred ]]; then flag=(--centred); dir="$dest/swap_centred"; fi
        "$PY" -m jlens_core eval "${COMMON[@]}" "${SWAP_LENSES[@]}" --n-texts 0 --swap "$SWAP_SET" \
            --swap-controls each "${flag[@]}" --out "$dir"
    done
}
if [[ -n "${ADD_LENSES:-}" ]]; then
    # the decoy run reads every lens once: a shipped variant that an added file repeats byte for byte (a rerun
    # after shipping) is read as the added file, under the name the merged tables give it
    ALL=(--lens logit --lens default --lens tuned)
    for v in relevance jpp rpp; do
        shipped="assets/lenses/smollm2-135m.$v.safetensors"
        [[ -e "$shipped" ]] || continue
        repeated=0; for f in $ADD_LENSES; do if cmp -s "$shipped" "$f"; then repeated=1; fi; done
        if [[ $repeated == 0 ]]; then ALL+=(--lens "smollm2-135m:$v"); fi
    done
    for f in ${EXTRA_LENSES:-}; do ALL+=(--lens "$f"); done
    LENSES=(); for f in $ADD_LENSES; do LENSES+=(--lens "$f"); done
    SWAP_LENSES=("${LENSES[@]}")
    rm -rf "$RUN/added"
    compare "$RUN/added"
    "$PY" scripts/merge_eval.py "$OUT" "$RUN/added"
    LENSES=("${ALL[@]}" "${LENSES[@]}")
else
    SWAP_LENSES=(--lens default "${VARIANTS[@]}")
    compare "$OUT"
fi
"$PY" -m jlens_core eval "${COMMON[@]}" "${LENSES[@]}" --n-texts 0 "${SETS[@]}" --decoys --out "$OUT/decoy"
"$PY" scripts/readme_tables.py "$OUT" ${TABLES_ARGS:-}
