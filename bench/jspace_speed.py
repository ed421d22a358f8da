"""How fast the J-space decomposes (docs/method.md §11.2): one cell, and every cell of a 64-token prompt over all layers.

In ONE run on the default model and its shipped J lens (centred gauge, k = 25, gradient pursuit, full vocabulary),
the two selection paths side by side (``jlens_core.jspace.dictionary.BF16_SELECTION``): fp32 correlations with the
whole dictionary at every greedy step, and bf16 products re-scored in fp32 under a proven bound (the same atoms):

* the machine's matmul peak in fp32 and bf16 on the decomposition's own shape (``[rows, d+1] x [d+1, vocab]``,
  rows 256, 64 and 1) and on a square 1024 matmul (best of ``--reps``); the CPU's name and bf16 flags;
* one cell (the last position of the prompt at the middle layer), median of ``--reps``, both paths (the JSON's
  ``one_cell_bf16_s`` is the low-precision path: fp16 for one row);
* every cell of a 64-token prompt (positions 1..63) at every source layer, controls off: **cold** (atom norms
  computed, an empty norms cache) and **warm** (norms read back) with bf16 selection and the layers stacked
  (``decompose_layers``), warm with bf16 selection one layer at a time (``decompose`` per layer: what stacking
  gains), warm with fp32 selection;
  wall time, the FLOPs of the selection products (``rows x 2 (d+1) vocab`` per greedy step) and the achieved
  FLOP/s against the peak of that dtype; the atom norms' own FLOPs (``vocab x 2 d^2`` a layer) for the cold run;
* peak resident memory (RSS high-water mark, the model and Python included).

    python bench/jspace_speed.py --json bench/jspace_speed.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def matmul_peak(shape: tuple[int, int, int], reps: int, dtype: torch.dtype) -> float:
    """Best GFLOP/s of ``[m, k] x [n, k]^T`` (``F.linear``, the selection's layout) in ``dtype`` over ``reps`` runs."""
    m, k, n = shape
    a, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    torch.nn.functional.linear(a, b)
    best = min(_timed(lambda: torch.nn.functional.linear(a, b)) for _ in range(reps))
    return 2 * m * k * n / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args()

    from bf16_fit import cpu_flags

    from jlens_core import default_lens, load_corpus, load_model
    from jlens_core.jspace import decompose
    from jlens_core.jspace import dictionary as D
    from jlens_core.jspace.decompose import decompose_layers
    from jlens_core.reading.inputs import record_residuals

    P = importlib.import_module("jlens_core.jspace.pursuit")
    model = load_model()
    lens = default_lens(model)
    d, vocab = int(model.d_model), int(model.vocab_size)
    out: dict = {"model": model.name, "cpu": cpu_flags(), "threads": torch.get_num_threads(), "d_model": d,
                 "vocab": vocab, "rss_after_load_mb": peak_rss_mb()}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[f"peak_gflops_{name}_64_rows"] = matmul_peak((64, d + 1, vocab), args.reps, dtype)
        out[f"peak_gflops_{name}_256_rows"] = matmul_peak((256, d + 1, vocab), args.reps, dtype)
        out[f"peak_gflops_{name}_1_row"] = matmul_peak((1, d + 1, vocab), args.reps, dtype)
        out[f"peak_gflops_{name}_square_1024"] = matmul_peak((1024, 1024, 1024), args.reps, dtype)

    text = load_corpus("stdlib-docs", n=1, min_chars=400, split="eval")[0]
    ids = model.encode(text, max_length=64)
    layers = list(lens.source_layers)
    recorded = record_residuals(model, ids, layers)
    middle = layers[len(layers) // 2]
    cell = recorded[middle][-1].float()

    flops = {"n": 0.0}
    counted_best, counted_blocks, counted_corr = P.bounded_best, P.bounded_best_blocks, D.JSpace.correlations

    def best_counted(z, *rest):
        flops["n"] += 2.0 * z.shape[0] * (d + 1) * vocab
        return counted_best(z, *rest)

    def blocks_counted(z, *rest):
        flops["n"] += 2.0 * z.shape[0] * (d + 1) * vocab
        return counted_blocks(z, *rest)

    def corr_counted(self, x):
        flops["n"] += 2.0 * x.reshape(-1, d).shape[0] * (d + 1) * vocab
        return counted_corr(self, x)

    D.bounded_best = best_counted  # the names the dictionary calls
    D.bounded_best_blocks = blocks_counted
    D.JSpace.correlations = corr_counted  # type: ignore[method-assign]
    cache = tempfile.mkdtemp(prefix="jspace-norms-")
    import os

    os.environ["JLENS_CACHE_DIR"] = cache
    same = True
    try:
        for name, flag in (("fp32", False), ("bf16", True)):
            D.BF16_SELECTION = flag
            decompose(model, lens, cell, middle, k=25, controls=False)  # the layer's norms, the bf16 head
            out[f"one_cell_{name}_s"] = statistics.median(
                _timed(lambda: decompose(model, lens, cell, middle, k=25, controls=False)) for _ in range(args.reps))
        runs = (("all_cells_bf16_cold", True, True), ("all_cells_bf16_warm", True, False),
                ("all_cells_bf16_warm_per_layer", True, False), ("all_cells_fp32_warm", False, False))
        found = {}
        xs = {layer: recorded[layer][1:].float() for layer in layers}
        for label, flag, cold in runs:
            D.BF16_SELECTION = flag
            D.clear_cache()
            if cold:
                for f in Path(cache).glob("jspace-norms/*.npy"):
                    f.unlink()
            flops["n"] = 0.0
            t0 = time.perf_counter()
            if label.startswith("all_cells_bf16") and not label.endswith("per_layer"):
                found[label] = [dec.token_ids for dec in decompose_layers(model, lens, xs, k=25,
                                                                          controls=False).values()]
            else:
                found[label] = [decompose(model, lens, xs[layer], layer, k=25, controls=False).token_ids
                                for layer in layers]
            seconds = time.perf_counter() - t0
            dtype = "bf16" if flag else "fp32"
            out[f"{label}_s"] = seconds
            out[f"{label}_selection_gflop"] = flops["n"] / 1e9
            out[f"{label}_selection_gflops"] = flops["n"] / seconds / 1e9
            out[f"{label}_over_peak"] = out[f"{label}_selection_gflops"] / out[f"peak_gflops_{dtype}_64_rows"]
            if cold:
                out[f"{label}_norms_gflop"] = len(layers) * 2.0 * vocab * d * d / 1e9
        out["all_cells_cells"] = int((ids.shape[-1] - 1) * len(layers))
        same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(
            found["all_cells_bf16_warm"], found["all_cells_fp32_warm"], found["all_cells_bf16_warm_per_layer"]))
    finally:
        D.bounded_best = counted_best
        D.bounded_best_blocks = counted_blocks
        D.JSpace.correlations = counted_corr  # type: ignore[method-assign]
        D.BF16_SELECTION = None
    out["bf16_selects_the_same_atoms"] = same
    out["ratio_all_cells_fp32_over_bf16_warm"] = out["all_cells_fp32_warm_s"] / out["all_cells_bf16_warm_s"]
    out["ratio_all_cells_per_layer_over_stacked"] = (out["all_cells_bf16_warm_per_layer_s"]
                                                     / out["all_cells_bf16_warm_s"])
    out["ratio_one_cell_fp32_over_bf16"] = out["one_cell_fp32_s"] / out["one_cell_bf16_s"]
    out["rss_peak_mb"] = peak_rss_mb()
    for key, value in out.items():
        print(f"{key:>40}: {value:.3f}" if isinstance(value, float) else f"{key:>40}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
