"""The time of a study (docs/method.md §8.1) on the default model: 109 items (two_hop, antonym_chain,
arithmetic_chain, translation_pivot) x 3 shipped lenses (logit, J, tuned), with and without the capability
filter, against the forward passes alone (one per item: the floor a study cannot go under).

Usage: ``python bench/study_speed.py [--out bench/study_speed.json]``. Prints seconds, items/s and the ratio
study / forwards, measured in one run.
"""

from __future__ import annotations

import argparse
import json
import time

SETS = ("two_hop", "antonym_chain", "arithmetic_chain", "translation_pivot")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()
    import torch

    from jlens_core import LogitLens, default_lens, load_model
    from jlens_core.evaluation.study import study, study_sets
    from jlens_core.lenses.loading import default_tuned_lens
    from jlens_core.reading.inputs import record_residuals

    model = load_model()
    lenses = {"logit": LogitLens.for_model(model), "jacobian": default_lens(model), "tuned": default_tuned_lens(model)}
    sets = study_sets({name: name for name in SETS})
    n_items = sum(len(v) for v in sets.values())
    study(model, lenses, {"two_hop": sets["two_hop"][:2]}, answered_only=False)  # warm-up
    started = time.perf_counter()
    with torch.no_grad():
        for items in sets.values():
            for item in items:
                record_residuals(model, model.encode(item["prompt"]), range(model.n_layers))
    forwards = time.perf_counter() - started
    out = {"items": n_items, "lenses": list(lenses), "forwards_s": round(forwards, 2)}
    for label, answered_only in (("filter", None), ("no_filter", False)):
        result = study(model, lenses, sets, answered_only=answered_only)
        out[f"{label}_s"] = result.info["seconds"]
        out[f"{label}_items_per_s"] = round(n_items / result.info["seconds"], 2)
        out[f"{label}_ratio_to_forwards"] = round(result.info["seconds"] / forwards, 2)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
