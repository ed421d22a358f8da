"""What keeping the split halves costs a fit (docs/method.md §3.3): time and peak memory per prompt, with and without.

In ONE run, the default model fits the same prompt (the built-in corpus's first fit text, ``max_seq_len`` 64, all
29 source layers) with ``halves=True`` and ``halves=False``, alternating, each in its own subprocess so its peak
memory (RSS high-water mark, weights and Python included) is its own. Prints seconds per prompt (median), peak RSS,
the ratio with/without, and the extra fp64 sums the halves predict (``4 d^2 x 8`` bytes per source layer).

    python bench/halves_cost.py              # 2 runs of each
    python bench/halves_cost.py --reps 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(halves: bool, seq: int) -> None:
    from jlens_core import FitPlan, fit, load_corpus, load_model

    model = load_model()
    prompt = load_corpus("stdlib-docs", n=1, min_chars=400, split="fit")
    t0 = time.perf_counter()
    lens = fit(model, prompt, plan=FitPlan(halves=halves), max_seq_len=seq)
    seconds = time.perf_counter() - t0
    assert (lens.raw_halves is not None) == halves
    print(json.dumps({"halves": halves, "seconds": seconds, "peak_rss_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "d_model": model.d_model, "n_sources": len(lens.source_layers)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=["on", "off"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker == "on", args.seq)
        return
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.reps):
        for halves in (False, True):
            out = subprocess.run([sys.executable, __file__, "--worker", "on" if halves else "off", "--seq",
                                  str(args.seq)], check=True, capture_output=True, text=True, cwd=ROOT)
            runs[halves].append(json.loads(out.stdout.strip().splitlines()[-1]))
    d, n = runs[True][0]["d_model"], runs[True][0]["n_sources"]
    summary = {}
    for halves in (False, True):
        summary["with" if halves else "without"] = {
            "seconds_per_prompt": statistics.median(r["seconds"] for r in runs[halves]),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs[halves])}
    summary["time_ratio"] = summary["with"]["seconds_per_prompt"] / summary["without"]["seconds_per_prompt"]
    summary["extra_rss_mb"] = summary["with"]["peak_rss_mb"] - summary["without"]["peak_rss_mb"]
    summary["predicted_extra_mb"] = 4 * d * d * 8 * n / 2**20
    summary["reps"], summary["seq"] = args.reps, args.seq
    for key in ("without", "with"):
        print(f"{key:8s} halves: {summary[key]['seconds_per_prompt']:7.1f} s/prompt, "
              f"peak RSS {summary[key]['peak_rss_mb']:7.0f} MB")
    print(f"time with/without {summary['time_ratio']:.3f}; extra peak RSS {summary['extra_rss_mb']:.0f} MB "
          f"(predicted: 4 d^2 fp64 per layer = {summary['predicted_extra_mb']:.0f} MB)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
