"""Speed of ``make_it_say`` on the default model at 64 tokens: candidates ranked and replayed, each stage's time.

One search (SmolLM2-135M, fp32 on the CPU, the shipped Jacobian lens, layers 10..28, steer / swap / ablate at the
readout and from position 1, the default grids and replay budget, both controls, a 12-token continuation) on a
64-token prompt that ends in a question whose answer the search must change: "... The capital city of Japan is"
-> " Paris". Printed: per arm the candidates ranked, the replays and the seconds; per stage the seconds (clean
run, ranking, replays, bisection, continuations, total); and, measured in the same run, the seconds of one plain
64-token forward pass, so that the total also reads as a number of forward passes (comparable between a quiet
and a busy machine). The target: under 30 s on the development host (2 CPU cores).

    python bench/say_speed.py                        # one search, torch's thread count
    python bench/say_speed.py --threads 1 --json bench/say_speed.json

The model is loaded with ``jlens_core.load_model("smollm2-135m")`` (offline: the embedded GGUF). A script, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jlens_core import default_lens, load_model
from jlens_core.interventions.say import DEFAULT_MAX_REPLAYS, make_it_say

CONTEXT = ("Travel notes. We spent a week moving between cities by train, writing down what we saw each day: the "
           "markets in the morning, the museums after lunch, long dinners and late walks along the rivers. Every "
           "city had its own rhythm, its own food and its own way of greeting strangers. ")
QUESTION = "The capital city of Japan is"
TARGET = "Paris"


def prompt_of(model, n_tokens: int = 64) -> str:
    """A prompt of exactly ``n_tokens`` tokens (special tokens included): the end of :data:`CONTEXT`, repeated as
    needed, then :data:`QUESTION`."""
    question = model.encode(QUESTION).shape[1]
    words = (CONTEXT * 8).split(" ")
    for start in range(len(words)):
        for lead in ("", "- ", "-- ", "--- "):  # one more token or two, where dropping a word skips the length
            text = lead + " ".join(words[start:]) + QUESTION
            if int(model.encode(text).shape[1]) == n_tokens:
                return text
    raise SystemExit(f"Could not build a {n_tokens}-token prompt (the question alone is {question} tokens).")


def forward_seconds(model, ids: torch.Tensor, repeats: int = 3) -> float:
    """The median seconds of one plain forward pass over ``ids``."""
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model.hf_model(input_ids=ids)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="prompt length in tokens (default 64)")
    parser.add_argument("--max-replays", type=int, default=DEFAULT_MAX_REPLAYS, help="replays per arm")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m")
    lens = default_lens(model)
    if lens is None:
        raise SystemExit("No shipped lens for the default model.")
    prompt = prompt_of(model, args.tokens)
    ids = model.encode(prompt)
    forward = forward_seconds(model, ids)
    result = make_it_say(model, lens, prompt, TARGET, max_replays=args.max_replays)
    total = result.timings["total"]
    print(f"prompt: {ids.shape[1]} tokens, ...{prompt[-60:]!r} -> {TARGET!r}; torch threads {torch.get_num_threads()}")
    print(f"{'arm':<10} {'ranked':>7} {'replayed':>9} {'verified':>9} {'seconds':>8}")
    for name, arm in result.arms.items():
        print(f"{name:<10} {arm.n_ranked:>7} {arm.n_replayed:>9} {len(arm.recipes):>9} {arm.seconds:>8.1f}")
    print("stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items()))
    print(f"one plain {ids.shape[1]}-token forward: {forward:.3f} s; the search: {total:.1f} s = "
          f"{total / forward:.0f} forward passes; target < 30 s: {'met' if total < 30 else 'NOT met'}")
    print(result.message)
    if args.json:
        figures = {"tokens": int(ids.shape[1]), "threads": torch.get_num_threads(), "forward_s": forward,
                   "timings": result.timings, "forwards": total / forward,
                   "arms": {name: {"ranked": a.n_ranked, "replayed": a.n_replayed, "verified": len(a.recipes),
                                   "seconds": a.seconds} for name, a in result.arms.items()},
                   "message": result.message}
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
