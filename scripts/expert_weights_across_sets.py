"""Do an expert lens's learned weights carry over to labelled sets they never saw? (docs/results.md)

    python scripts/expert_weights_across_sets.py STACK [--folds 3] [--out DIR] [--basis-memory 14GiB]

``jlens weigh`` learns on half of every set's items and is scored on the other half: the held-out items
are new, their sets are not. Here the shipped sets are dealt into ``--folds`` groups (sorted by name,
round robin); for each group the weights are learned (``learn_expert_weights``, the default protocol)
on every item of the *other* sets, and the group's sets are read with them. Every set is so read by
weights that never saw it. Beside them, on the same items: the J lens (the shipped one, the baseline),
the stack's pooled lens and its uniform-weight combination. Writes under ``--out``:

* ``fold<i>.safetensors``: each group's combined one-matrix lens (fp16), its sets in its settings, and
  ``fold<i>.detail.csv`` its sets' detail (a rerun after a crash reads the groups already done);
* ``pass_at_k_detail.csv``: per word and lens, as ``jlens eval`` writes it (the learned lens of each set's
  group under one name, ``<kind> (other sets)``);
* ``comparison.csv``: :func:`~jlens_core.evaluation.lens_comparison.macro_comparison` of that detail (macro
  pass@1/5/10, paired bootstrap intervals against the J lens) and prints it;
* ``decoy/pass_at_k_detail.csv``: the same lenses on the decoy control (each item scored on another item's
  intermediates at its own prompt, docs/method.md §8; ``fold<i>.decoy.csv`` per group), and prints
  :func:`~jlens_core.evaluation.lens_comparison.gap_comparison`: whether weights that never saw a set read its
  particular steps better than the J lens, or only favour the kind of answer it asks for.

A script, not a test: about ``--folds`` times a ``jlens weigh`` run (the basis of all the other sets'
items must fit ``--basis-memory``). A rerun with every group done only scores what is missing.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jlens_core import load_model
from jlens_core.evaluation.labelled_items import read_labelled_items
from jlens_core.evaluation.lens_comparison import gap_comparison, macro_comparison
from jlens_core.evaluation.passk import decoy_items, load_eval_set, pass_at_k_detail, shipped_sets
from jlens_core.fitting.expert_weights import STEPS, learn_expert_weights
from jlens_core.lenses.experts import ExpertLens
from jlens_core.lenses.loading import default_lens, load_lens_file
from jlens_core.models.device_maps import parse_size


def deal(sets: list[str], folds: int) -> list[list[str]]:
    """``sets`` sorted and dealt round robin into ``folds`` groups (each non-empty).

    Raises:
        ValueError: fewer than 2 groups, or more groups than sets.
    """
    if not 2 <= folds <= len(sets):
        raise ValueError(f"--folds {folds} must lie between 2 and the {len(sets)} sets: each group needs a set, "
                         "and the weights need other sets to learn on.")
    ordered = sorted(sets)
    return [ordered[i::folds] for i in range(folds)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stack", help="an expert lens file (jlens fit --experts E)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sets", default=",".join(sorted(shipped_sets())), help="labelled sets (default: all shipped)")
    parser.add_argument("--folds", type=int, default=3)
    parser.add_argument("--basis-memory", default="14GiB", metavar="SIZE")
    parser.add_argument("--steps", type=int, default=STEPS, help="Adam steps per start (the protocol's 200)")
    parser.add_argument("--out", default=None, help="default: runs/across_sets/<stack's stem>")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    try:
        groups = deal(sets, args.folds)
        budget = parse_size(args.basis_memory, what="--basis-memory")
    except ValueError as exc:
        parser.error(str(exc))
    out = Path(args.out or ROOT / "runs" / "across_sets" / Path(args.stack).stem)
    out.mkdir(parents=True, exist_ok=True)

    model = load_model(args.model, device="cpu")
    stack = ExpertLens.load(args.stack, model=model).with_weights(None)  # a weighted file's weights unused
    baseline = default_lens(model)
    if baseline is None:
        parser.error(f"No shipped J lens for {model.name!r}: the baseline of this comparison.")
    rules = stack.rules
    # the lenses every group reads beside its own learned one
    fixed = {"jacobian": baseline, f"{rules} (pooled)": stack.pooled_lens(),
             f"{rules}-experts (uniform)": stack.to_jacobian_lens()}
    items = None  # read once, and only when a group's weights must be learned
    details, decoys = [], []
    for i, group in enumerate(groups):
        done = out / f"fold{i}.detail.csv"
        if done.is_file() and (out / f"fold{i}.safetensors").is_file():  # a rerun after a crash: groups done stay done
            kept = pd.read_csv(done)
            if sorted(kept["set"].unique()) == sorted(group):
                print(f"group {i} ({','.join(group)}): done before, read from {done}", flush=True)
                details.append(kept)
                continue
        if items is None:
            items = read_labelled_items(model, sets, stack.source_layers)
        train = [item for item in items if item.set_name not in group]
        began = time.perf_counter()
        with tqdm(total=0, desc=f"group {i} weights", unit="step", file=sys.stderr) as bar:
            def advance(p, bar=bar) -> None:
                bar.total = p.n_starts * (p.n_steps + 1)
                bar.n = p.start_index * (p.n_steps + 1) + p.step + 1
                bar.set_postfix({"start": p.start, "pass@10": f"{p.macro:.3f}"}, refresh=True)

            fit = learn_expert_weights(model, stack, train, steps=args.steps, basis_budget=budget, progress=advance)
        learned = stack.with_weights(fit.weights, fit.items).to_jacobian_lens()
        learned = learned.replace(provenance={**learned.record.provenance, "weights_learned_without": group})
        learned.save(out / f"fold{i}.safetensors", dtype="float16")
        print(f"group {i} ({','.join(group)}): learned on {len(train)} items of the other sets in "
              f"{time.perf_counter() - began:.0f} s (start {fit.start}, step {fit.step})", flush=True)
        lenses = {**fixed, f"{rules}++ (other sets)": learned}
        group_detail = pd.concat([pass_at_k_detail(model, lenses, name).assign(set=name) for name in group],
                                 ignore_index=True)
        group_detail.to_csv(done, index=False)
        details.append(group_detail)
    for i, group in enumerate(groups):
        done = out / f"fold{i}.decoy.csv"
        kept = pd.read_csv(done) if done.is_file() else None
        if kept is None or sorted(kept["set"].unique()) != sorted(group):
            learned = load_lens_file(out / f"fold{i}.safetensors", model=model)
            lenses = {**fixed, f"{rules}++ (other sets)": learned}
            kept = pd.concat([pass_at_k_detail(model, lenses, decoy_items(load_eval_set(name))).assign(set=name)
                              for name in group], ignore_index=True)
            kept.to_csv(done, index=False)
        decoys.append(kept)
    detail = pd.concat(details, ignore_index=True)
    detail.to_csv(out / "pass_at_k_detail.csv", index=False)
    table = macro_comparison(detail, (1, 5, 10))
    table.to_csv(out / "comparison.csv", index=False)
    at10 = table[table["k"] == 10]
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(at10[["lens", "macro", "ci_low", "ci_high", "diff", "diff_low", "diff_high", "ratio", "verdict"]]
              .to_string(index=False))
    decoy = pd.concat(decoys, ignore_index=True)
    (out / "decoy").mkdir(exist_ok=True)
    decoy.to_csv(out / "decoy" / "pass_at_k_detail.csv", index=False)
    gaps = gap_comparison(detail, decoy, 10)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(gaps[["lens", "real", "decoy", "gap", "gap_low", "gap_high", "gap_diff", "gap_diff_low", "gap_diff_high",
                    "verdict"]].to_string(index=False))
    print(f"wrote {out}/pass_at_k_detail.csv, comparison.csv, decoy/pass_at_k_detail.csv and the groups' lenses")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
