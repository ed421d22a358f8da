"""Where the fused estimator's time goes: a torch.profiler breakdown of its backward passes.

Runs the fused backward of the default model (seq 128, all 29 source layers, ``dim_batch`` 8) for a
few chunks of rows under the profiler and prints, per kind of kernel, the share of the time, and
the rate achieved (the benchmark's analytic FLOP count) next to the fp32 matmul peak measured in
the same run. From them:
the best time per prompt these FLOPs allow (every FLOP at the peak, nothing else costing time),
and the ratio to the reference algorithm's measured time (``bench/fit_speed.json``) that it caps.

    python bench/fused_profile.py [--chunks 4] [--reference-json bench/fit_speed.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

KINDS = {"matmul (projections)": ("aten::mm", "aten::addmm", "aten::addmm_"),
         "batched matmul (attention)": ("aten::bmm", "aten::baddbmm"),
         "elementwise": ("aten::mul", "aten::mul_", "aten::add_", "aten::sub_", "aten::addcmul_", "aten::sum",
                         "aten::cat", "aten::neg", "aten::fill_"),
         "copies and layout": ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::index",
                               "aten::index_put_", "aten::zeros", "aten::empty", "aten::empty_like")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=4, help="chunks of dim_batch rows profiled (default 4)")
    p.add_argument("--dim-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reference-json", default=str(ROOT / "bench" / "fit_speed.json"))
    args = p.parse_args()
    from fit_speed import PROMPT, backward_flops, matmul_peak_gflops

    from jlens_core import load_model
    from jlens_core.fitting import fused

    model = load_model(device="cpu")
    ids = model.encode(PROMPT, max_length=args.seq)
    target, d = model.n_layers - 1, model.d_model
    prep = fused.prepare_layers(model, ids, 0, target, 16)

    def chunk(start: int) -> None:
        rows = range(start, start + args.dim_batch)
        grad = None
        for j in range(target, 0, -1):
            grad = fused.backward_layer(prep, j, grad, rows)
            grad.float().sum(dim=1).cpu()

    peak = matmul_peak_gflops()
    with torch.no_grad():
        chunk(0)  # warm
        t = time.perf_counter()
        for i in range(args.chunks):
            chunk(i * args.dim_batch)
        per_row = (time.perf_counter() - t) / (args.chunks * args.dim_batch)
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            for i in range(args.chunks):
                chunk(i * args.dim_batch)
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    # FLOPs: the analytic count of the benchmark (the profiler does not count in-place addmm_)
    flops_prompt = backward_flops(model, int(ids.shape[1]), 16, list(range(target)), target, fused=True)
    print(f"fp32 matmul peak {peak:.0f} GFLOP/s; {torch.get_num_threads()} threads; seq {int(ids.shape[1])}, "
          f"{target} source layers, dim_batch {args.dim_batch}; {per_row * d:.1f} s per prompt unprofiled "
          f"({total_us * 1e-6 / (args.chunks * args.dim_batch) * d:.1f} s profiled); "
          f"{flops_prompt / 1e12:.2f} TFLOP per prompt: {flops_prompt / (per_row * d) / 1e9:.0f} GFLOP/s")
    print(f"{'kind':30s} {'time %':>7s}")
    seen = set()
    out = []
    for kind, names in list(KINDS.items()) + [("other", None)]:
        sel = [e for e in events if (e.key in names if names else e.key not in seen)]
        seen.update(e.key for e in sel)
        us = sum(e.self_cpu_time_total for e in sel)
        out.append({"kind": kind, "time_share": us / total_us})
        print(f"{kind:30s} {100 * us / total_us:6.1f}%")
    best = flops_prompt / (peak * 1e9)
    print(f"FLOPs per prompt {flops_prompt / 1e12:.2f} TFLOP: at the peak, with nothing else costing time, "
          f"{best:.1f} s per prompt (now {per_row * d:.1f} s: {100 * best / (per_row * d):.0f} % of that bound)")
    result = {"matmul_peak_gflops": peak, "seconds_per_prompt": per_row * d, "bound_seconds": best, "kinds": out}
    ref = Path(args.reference_json)
    if ref.is_file():
        data = json.loads(ref.read_text())
        refs = [r for r in data.get("rows", []) if r.get("method") == "reference" and r.get("seq") == args.seq]
        if refs:
            ref_s = refs[0]["seconds_median"] * peak / data["matmul_peak_gflops"]  # scaled to this run's peak
            print(f"the reference algorithm's time (from {ref.name}, scaled to this peak) {ref_s:.1f} s: "
                  f"now {ref_s / (per_row * d):.2f}x, at most {ref_s / best:.2f}x with these FLOPs")
            result["reference_seconds_scaled"] = ref_s
    print(json.dumps(result))


if __name__ == "__main__":
    main()
