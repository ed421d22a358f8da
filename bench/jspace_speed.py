"""How fast the J-space decomposes (docs/method.md §11.2): one cell, and every cell of a 64-token prompt over all layers.

In ONE run on the default model and its shipped J lens (centred gauge, k = 25, gradient pursuit, full vocabulary):

* the machine's fp32 matmul peak, measured on the shape a decomposition multiplies (``[rows, d] x [d, vocab]``,
  rows 64) and on a square 1024 matmul (best of ``--reps``);
* one cell (the last position of the prompt at the middle layer): the dictionary's first build at that layer
  (the atom norms, one pass over the vocabulary), then the decomposition alone (median of ``--reps``); with and
  without the controls;
* every cell of a 64-token prompt (positions 1..63) at every source layer, controls off (and on with ``--controls``):
  wall time, the FLOPs of the correlation products (``rows x 2 d vocab`` per greedy step, counted as they run) and
  the achieved FLOP/s against the peak;
* peak resident memory (RSS high-water mark, the model and Python included) after each part.

    python bench/jspace_speed.py
    python bench/jspace_speed.py --reps 3 --controls --json bench/jspace_speed.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_peak(shape: tuple[int, int, int], reps: int) -> float:
    """Best GFLOP/s of ``[m, k] x [k, n]`` fp32 over ``reps`` runs."""
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * m * k * n / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--controls", action="store_true", help="also time every cell with the controls")
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args()

    from jlens_core import default_lens, load_corpus, load_model
    from jlens_core.jspace import decompose
    from jlens_core.jspace.dictionary import JSpace
    from jlens_core.reading.inputs import record_residuals

    model = load_model()
    lens = default_lens(model)
    d, vocab = int(model.d_model), int(model.vocab_size)
    out: dict = {"model": model.name, "threads": torch.get_num_threads(), "d_model": d, "vocab": vocab,
                 "rss_after_load_mb": peak_rss_mb()}
    out["peak_gflops_decompose_shape"] = matmul_peak((64, d, vocab), args.reps)
    out["peak_gflops_square_1024"] = matmul_peak((1024, 1024, 1024), args.reps)

    text = load_corpus("stdlib-docs", n=1, min_chars=400, split="eval")[0]
    ids = model.encode(text, max_length=64)
    layers = list(lens.source_layers)
    recorded = record_residuals(model, ids, layers)
    middle = layers[len(layers) // 2]
    cell = recorded[middle][-1].float()

    t0 = time.perf_counter()
    decompose(model, lens, cell, middle, k=25, controls=False)
    out["one_cell_first_at_layer_s"] = time.perf_counter() - t0  # includes the atom norms of that layer
    out["one_cell_s"] = statistics.median(_timed(lambda: decompose(model, lens, cell, middle, k=25, controls=False))
                                          for _ in range(args.reps))
    out["one_cell_with_controls_s"] = statistics.median(_timed(lambda: decompose(model, lens, cell, middle, k=25))
                                                        for _ in range(args.reps))
    out["rss_after_one_cell_mb"] = peak_rss_mb()

    flops = {"n": 0.0}
    original = JSpace._products

    def counted(self, x, scale):
        rows = x.reshape(-1, self.d_model).shape[0]
        flops["n"] += 2.0 * rows * self.d_model * self.n_atoms
        return original(self, x, scale)

    JSpace._products = counted  # type: ignore[method-assign]
    try:
        for label, controls in (("all_cells", False),) + ((("all_cells_with_controls", True),) if args.controls
                                                          else ()):
            flops["n"] = 0.0
            t0 = time.perf_counter()
            for layer in layers:
                decompose(model, lens, recorded[layer][1:].float(), layer, k=25, controls=controls)
            seconds = time.perf_counter() - t0
            out[f"{label}_s"] = seconds
            out[f"{label}_cells"] = int((ids.shape[-1] - 1) * len(layers))
            out[f"{label}_jspace_gflop"] = flops["n"] / 1e9
            out[f"{label}_jspace_gflops"] = flops["n"] / seconds / 1e9
    finally:
        JSpace._products = original  # type: ignore[method-assign]
    out["rss_peak_mb"] = peak_rss_mb()
    out["achieved_over_peak"] = out["all_cells_jspace_gflops"] / out["peak_gflops_decompose_shape"]
    for key, value in out.items():
        print(f"{key:>34}: {value:.3f}" if isinstance(value, float) else f"{key:>34}: {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
