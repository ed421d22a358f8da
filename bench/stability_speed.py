"""What do stability marks cost a reading? A plain reading against one with marks, and the marks alone. ONE run.

On the default model, its shipped lens (with split halves) and a held-out 64-token text, interleaved over ``--reps``
repetitions (each with its own text, so nothing is cached): ``read_prompt(model, lens, text)`` (plain),
``read_prompt(..., stability=True)`` (marks: the lens's two halves' heads on top of the reading's own), and the marks
added to the plain reading already made (``read_prompts(..., reuse=...)``, what the app does after its first paint).
Issue 52 asks for a reading with marks no slower than a plain one; a reading's head is fp32 (its probabilities need
the fp32 normaliser) and each half adds a head of the same size, so the ratio says how far that is.

    python bench/stability_speed.py [--reps 5]      # writes bench/stability_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bf16_fit import cpu_flags, host_load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--json", default=str(ROOT / "bench" / "stability_speed.json"))
    args = ap.parse_args()
    start_load = os.getloadavg()[0]

    from jlens_core import default_lens, load_model, read_prompt, read_prompts
    from jlens_core.corpus import load_corpus

    model = load_model()
    lens = default_lens(model)
    texts = load_corpus("stdlib-docs", n=args.reps + 1, min_chars=600, split="eval")
    read_prompt(model, lens, texts[-1], max_seq_len=args.seq, stability=True)  # one-time costs out of the timings
    times: dict[str, list[float]] = {"plain": [], "with marks": [], "marks added to a plain reading": []}
    for rep, text in enumerate(texts[:args.reps]):
        order = ["plain", "with marks"] if rep % 2 == 0 else ["with marks", "plain"]
        for arm in order:
            t = time.perf_counter()
            reading = read_prompt(model, lens, text, max_seq_len=args.seq, stability=arm == "with marks")
            times[arm].append(time.perf_counter() - t)
            if arm == "plain":
                plain = reading
        t = time.perf_counter()
        read_prompts(model, {"lens": lens}, text, max_seq_len=args.seq, stability=True, reuse={"lens": plain})
        times["marks added to a plain reading"].append(time.perf_counter() - t)
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"cpu": cpu_flags(), "conditions": host_load(start_load), "seq": args.seq, "reps": args.reps,
           "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
           "median_s": {k: round(v, 3) for k, v in med.items()},
           "with_marks_over_plain": round(med["with marks"] / med["plain"], 2)}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("median_s", "with_marks_over_plain")}, indent=1))


if __name__ == "__main__":
    main()
