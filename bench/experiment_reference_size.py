"""Experiments 1-6 on the default model at the reference's set sizes (docs/experiments.md "Speed"): the issue's
target is under 10 minutes each on a 2-core CPU.

Sets: probe-swap 90 items, verbal-report 14 categories x 10 candidates, flexible-generalization 4 categories x 4
functions x 4 arguments (12 swaps per function), from ``assets/experiments/*-reference-size.json``; experiments 4-6
have no size in the issue and run on their shipped example sets (the JSON states each set's size); the ablation
battery runs on the shipped probe-swap set (26 two-hop items) at its default strengths.

Usage::

    python bench/experiment_reference_size.py [--only probe-swap,verbal-report] [--limit N] [--out FILE]

``--limit N`` cuts every set to its first N entries (items, categories, concepts, passages ...): a quick check that
the bench runs, not a measurement. Writes per experiment: seconds, the set's size, gated items, trials, the band;
and the CPU (model name, flags, threads) and the conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bf16_fit import cpu_flags

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "experiments"
SETS = {  # experiment: (set file, the size in words)
    "probe-swap": ("probe-swap-reference-size.json", "90 two-hop items"),
    "verbal-report": ("verbal-report-reference-size.json", "14 categories x 10 candidates"),
    "flexible-generalization": ("flexible-generalization-reference-size.json",
                                "4 categories x 4 functions x 4 arguments (12 swaps per function)"),
    "verbal-introspection": ("verbal-introspection.json", "the shipped set: 8 concepts x 2 prefills"),
    "directed-modulation": ("directed-modulation.json", "the shipped set: 5 phrasings x 2 carriers x 9 targets"),
    "selectivity-language": ("selectivity-language.json", "the shipped set: 8 passages in 4 languages"),
    "ablation-battery": ("probe-swap.json", "the shipped probe-swap set: 26 two-hop items"),
}
# the settings docs/results.md's runs used where a default leaves the gate empty on this model (each recorded)
SETTINGS = {
    "verbal-report": {"prefill": "I am thinking of a {category}:"},
    "selectivity-language": {"prefill": "The passage is written in"},
}
CUT = ("items", "categories", "concepts", "phrasings", "carrier_sentences", "passages", "topic_categories",
       "math_problems")


def cut(data: dict, limit: int | None) -> dict:
    """The set with each of its lists (and the verbal report's categories) cut to the first ``limit`` entries."""
    if not limit:
        return data
    out = dict(data)
    for key in CUT:
        if isinstance(out.get(key), list):
            out[key] = out[key][:limit]
    if isinstance(out.get("candidates"), dict):
        out["candidates"] = dict(list(out["candidates"].items())[:limit])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated experiments (default: all of 1-6)")
    parser.add_argument("--limit", type=int, default=None, help="cut every set to its first N entries (a check)")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()
    from jlens_core import default_lens, load_model, run_experiment

    names = [n for n in args.only.split(",") if n] or list(SETS)
    unknown = [n for n in names if n not in SETS]
    if unknown:
        parser.error(f"{', '.join(unknown)} is not one of {', '.join(SETS)}")
    started = time.perf_counter()
    model = load_model()
    lens = default_lens(model)
    out: dict = {"model": model.name, "lens": str(lens.kind), "cpu": cpu_flags(),
                 "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "limit": args.limit,
                 "load_s": round(time.perf_counter() - started, 1), "experiments": {}}
    for name in names:
        path, size = SETS[name]
        data = cut(json.loads((ASSETS / path).read_text(encoding="utf-8")), args.limit)
        begun = time.perf_counter()
        try:
            result = run_experiment(model, lens, name, data, **SETTINGS.get(name, {}))
        except ValueError as exc:  # an empty gate: the model answers none of the (cut) set's items
            out["experiments"][name] = {"set": path, "seconds": round(time.perf_counter() - begun, 1),
                                        "error": str(exc)}
            print(name, json.dumps(out["experiments"][name]), flush=True)
            continue
        out["experiments"][name] = {
            "set": path, "size": size if not args.limit else f"cut to {args.limit} (--limit)",
            "seconds": round(result.seconds, 1), "under_10_min": result.seconds < 600,
            "gate_entries": len(result.gate), "gated": result.n_gated, "trials": len(result.trials),
            "band": result.band.label, "settings": SETTINGS.get(name, {})}
        print(name, json.dumps(out["experiments"][name]), flush=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
