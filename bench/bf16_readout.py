"""How much faster is a reading's head ranked in bf16 and kept exact? fp32 head against the exact bf16 top k, ONE run.

On the default model, its shipped lens and a held-out 64-token text: every layer's residual carried by the lens
(29 layers x 64 positions = 1856 rows), unembedded in chunks of the size a reading uses
(``--chunk-rows``, default 64; 0: ``logit_stats.chunk_size``, 341 here), each chunk read two ways, interleaved over ``--reps`` repetitions:

* ``fp32``: ``x @ W.T`` in fp32, its top k and the rank of each position's next token (what a reading ranks);
* ``bf16-exact``: :func:`jlens_core.reading.exact_topk.exact_top_k` (bf16 ranking, the bound, the fp32
  re-score of the candidates), top k only, and top k with the next tokens' ranks.

Prints seconds (medians), the ratio, the share of columns re-scored and of chunks that fell back to fp32, the
matmul peaks in each dtype, and checks the results are the same bits. A reading's probabilities, entropy and KL
need every fp32 logit (the log-normaliser), so they keep the fp32 head: this bench measures what ranks only
(pass@k, studies' onsets, the say search's ranking) can gain.

    python bench/bf16_readout.py            # writes bench/bf16_readout.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bf16_fit import cpu_flags, host_load
from fit_speed import matmul_peak_gflops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--chunk-rows", type=int, default=64, help="rows per head product, both arms (0: a reading's "
                    "chunk_size); a smaller chunk has a smaller union of candidates to re-score")
    ap.add_argument("--json", default=str(ROOT / "bench" / "bf16_readout.json"))
    args = ap.parse_args()
    start_load = os.getloadavg()[0]

    from jlens_core import default_lens, load_model
    from jlens_core.corpus import load_corpus
    from jlens_core.reading.exact_topk import exact_top_k, head_parts
    from jlens_core.reading.logit_stats import chunk_size

    model = load_model()
    lens = default_lens(model)
    text = load_corpus(split="eval", n=1)[0]
    ids = model.encode(text, max_length=args.seq)
    with torch.no_grad():
        hs = model.hf_model(input_ids=ids, output_hidden_states=True).hidden_states
        carried = torch.cat([lens.transport(hs[layer + 1][0].float(), layer) for layer in lens.source_layers])
        x = model.final_norm(carried).float()  # [rows, d] the head's input
    parts = head_parts(model)
    assert parts is not None, "the default model's head is one matrix"
    weight, weight_bf16, norms = parts
    nxt = torch.cat([ids[0, 1:], ids[0, :1]]).repeat(len(lens.source_layers))  # each row's next token (any, last)
    rows = args.chunk_rows or chunk_size(weight.shape[0])
    chunks = [(i, min(i + rows, x.shape[0])) for i in range(0, x.shape[0], rows)]

    def fp32(with_ranks: bool):
        out = []
        for a, b in chunks:
            z = x[a:b] @ weight.t()
            values, top = z.topk(args.k, dim=-1)
            ranks = (z > z.gather(-1, nxt[a:b, None])).sum(-1) + 1 if with_ranks else None
            out.append((top, values, ranks))
        return out

    def bf16(with_ranks: bool):
        return [exact_top_k(x[a:b], weight, args.k, weight_bf16=weight_bf16, norms=norms,
                            rank_ids=nxt[a:b] if with_ranks else None) for a, b in chunks]

    peaks = {"float32": [], "bfloat16": []}
    times: dict[str, list[float]] = {"fp32 top-k": [], "bf16-exact top-k": [], "fp32 top-k+ranks": [],
                                     "bf16-exact top-k+ranks": []}
    same = True
    stats = {}
    for rep in range(args.reps):
        for name in ("float32", "bfloat16"):
            peaks[name].append(matmul_peak_gflops(seconds=1.0, dtype=getattr(torch, name)))
        order = [(False, "fp32"), (False, "bf16"), (True, "fp32"), (True, "bf16")]
        if rep % 2:
            order = [(r, "bf16" if a == "fp32" else "fp32") for r, a in order]
        results = {}
        for with_ranks, arm in order:
            t0 = time.perf_counter()
            results[(with_ranks, arm)] = (fp32 if arm == "fp32" else bf16)(with_ranks)
            label = f"{'fp32' if arm == 'fp32' else 'bf16-exact'} top-k{'+ranks' if with_ranks else ''}"
            times[label].append(time.perf_counter() - t0)
        for with_ranks in (False, True):
            for (top, values, ranks), got in zip(results[(with_ranks, "fp32")], results[(with_ranks, "bf16")]):
                same &= torch.equal(top, got.ids) and torch.equal(values, got.logits)
                if with_ranks:
                    same &= torch.equal(ranks, got.ranks)
            got = results[(with_ranks, "bf16")]
            stats["ranks" if with_ranks else "top-k"] = {
                "rescored_fraction": round(statistics.mean(g.n_rescored for g in got) / weight.shape[0], 4),
                "fallback_chunks": sum(g.fallback for g in got), "chunks": len(got)}
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"cpu": cpu_flags(), "conditions": host_load(start_load),
           "rows": int(x.shape[0]), "chunk_rows": rows, "k": args.k, "vocab": int(weight.shape[0]),
           "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
           "median_s": {k: round(v, 3) for k, v in med.items()},
           "speedup_top_k": round(med["fp32 top-k"] / med["bf16-exact top-k"], 2),
           "speedup_top_k_and_ranks": round(med["fp32 top-k+ranks"] / med["bf16-exact top-k+ranks"], 2),
           "rescoring": stats, "bit_identical": bool(same),
           "matmul_peak_gflops": {k: round(max(v), 1) for k, v in peaks.items()}}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("median_s", "speedup_top_k", "speedup_top_k_and_ranks", "rescoring",
                                          "bit_identical", "matmul_peak_gflops")}, indent=1))


if __name__ == "__main__":
    main()
