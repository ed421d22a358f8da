"""The speed of the workspace experiments (docs/experiments.md) on the default model: trials that share a prompt
run as one batched forward; this measures the batched forward against the same rows one at a time (one run, same
machine), and with ``--experiments`` times each experiment on its shipped example set.

Usage: ``python bench/experiment_speed.py [--rows 12] [--experiments probe-swap,verbal-report] [--out FILE]``.
Prints seconds and the ratio one-at-a-time / batched.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=12, help="edited rows sharing one prompt (default 12)")
    parser.add_argument("--experiments", default="", help="comma-separated experiments to time on their example sets")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()
    import torch

    from jlens_core import Swap, default_lens, load_model, run_experiment
    from jlens_core.experiments.core import edited_next_logits

    model = load_model()
    lens = default_lens(model)
    ids = model.encode("The capital of the country famous for the Colosseum is")
    words = [" France", " Spain", " Japan", " China", " Egypt", " Peru", " India", " Chile", " Kenya", " Nepal",
             " Cuba", " Iran"]
    rows = [[Swap(model, lens, " Italy", words[i % len(words)], 1.0 + i // len(words), layers=range(14, 24))]
            for i in range(args.rows)]
    edited_next_logits(model, ids, rows[:2])  # warm-up: directions cached, kernels ready
    started = time.perf_counter()
    batched = edited_next_logits(model, ids, rows)
    batched_s = time.perf_counter() - started
    started = time.perf_counter()
    single = torch.cat([edited_next_logits(model, ids, [row]) for row in rows])
    single_s = time.perf_counter() - started
    out: dict = {"rows": args.rows, "tokens": int(ids.shape[1]), "batched_s": round(batched_s, 2),
                 "one_at_a_time_s": round(single_s, 2), "ratio": round(single_s / batched_s, 2),
                 "max_abs_diff": float((batched - single).abs().max())}
    for name in [n for n in args.experiments.split(",") if n]:
        result = run_experiment(model, lens, name, name)
        out[name] = {"seconds": round(result.seconds, 1), "gated": result.n_gated, "items": len(result.gate),
                     "trials": len(result.trials)}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
