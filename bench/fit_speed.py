"""Side-by-side speed of the plain docs/method.md §2 estimator and ``jlens_core.jacobian_for_prompt``.

In ONE run, on the same prompts, interleaved over repetitions, for the default model at
``max_seq_len`` 64 and 128 (all source layers): seconds per prompt (median), the ratio, the
relative Frobenius difference of the results, the peak memory (RSS) of each, and the achieved
GFLOP/s of jlens against the fp32 matmul peak measured in the same run: the best of the peaks
measured at the start and after each repetition, and (because a shared host's speed drifts) the
peak measured in the worker right before and right after each timed section. The jlens rows
are its default method (``auto``: the fused analytic backward on this model), the autograd
method ``batched``, and ``jlens-relevance``: the R-lens's fit (``rules="relevance"``, docs/method.md §9.1,
fused here), whose ``rel.diff`` is against another quantity (the J-lens) and says only how far
they differ; its ratio to the ``jlens`` row is the relevance fit's cost. Each measurement runs in its own subprocess so its peak memory is its own.

    python bench/fit_speed.py                 # full: all 29 source layers, seq 64 and 128, 3 reps
    python bench/fit_speed.py --quick         # source layers 24..28 only, 2 reps
    python bench/fit_speed.py --json out.json
    python bench/fit_speed.py --device cuda --dim-batch auto --json bench/fit_speed_gpu.json
                                              # on a GPU: bf16 model, fp32 J, bf16 matmul peak
    python bench/fit_speed.py --families llama,gemma,gpt2 --d-model 256 --layers 8 --seqs 64
                                              # per family: fused against autograd ("batched") on a
                                              # random model of that family (bench/fit_speed_families.json)

Prints a table and writes the figures as JSON (default ``bench/fit_speed.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = ("The Jacobian lens carries an early residual into the last layer's basis with the average "
          "input-output Jacobian, then decodes it with the model's own unembedding. It needs no training, "
          "only d_model backward passes per prompt, averaged over a corpus of ordinary text such as this "
          "paragraph, which goes on long enough to fill one hundred and twenty-eight tokens of context "
          "without repeating itself: the quick brown fox jumps over the lazy dog, the capital of France is "
          "Paris, water boils at one hundred degrees Celsius at sea level, and so on. A second paragraph follows, "
          "because a tokenizer may pack ordinary English words into fewer tokens than one expects: it speaks of "
          "rivers and mountains, of libraries whose shelves hold every book ever printed, of small models that "
          "read each of their own layers one token at a time, and of the patient researcher who watches them.")


# -- (a) the reference jlens's own algorithm (a faithful port, written for this benchmark) ----------
def reference_jacobian_for_prompt(model, ids, sources, target, dim_batch, skip_first):
    """The reference library's estimator: ONE forward of the prompt replicated ``dim_batch`` times
    (the whole model, full sequence, no prefix cache, last token kept), its graph started at the
    lowest source layer (backward stops there) and retained, reused by every backward pass; the
    cotangents sit at the valid positions and the rows are averaged over them (docs/method.md §2's numbers)."""
    from jlens_core.models.recorder import ActivationRecorder

    d = model.d_model
    seq_len = ids.shape[1]
    valid = list(range(skip_first, seq_len - 1))
    batch = ids.expand(dim_batch, -1)
    with torch.enable_grad(), ActivationRecorder(model.layers, sources + [target], start_graph_at=sources[0]) as rec:
        model.hf_model(input_ids=batch)
    outs = rec.activations
    jac = {layer: torch.zeros(d, d) for layer in sources}
    for start in range(0, d, dim_batch):
        rows = list(range(start, min(start + dim_batch, d)))
        cot = torch.zeros_like(outs[target])  # [dim_batch, seq, d]
        for j, row in enumerate(rows):
            cot[j, valid, row] = 1.0
        grads = torch.autograd.grad(outs[target], [outs[layer] for layer in sources], grad_outputs=cot,
                                    retain_graph=True)
        for layer, g in zip(sources, grads):
            jac[layer][start: start + len(rows)] = g[: len(rows), valid].float().sum(dim=1) / len(valid)
    return jac


def reference_flops(model, seq_len: int, sources: list[int], target: int) -> float:
    """Input-gradient FLOPs of the reference's backward passes: every position of the full sequence,
    through every layer from the target down to the lowest source (no causal savings)."""
    cfg = model.config
    d = model.d_model
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    linear = d * heads * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * cfg.intermediate_size
    per_layer = 2 * seq_len * linear + 8 * seq_len * seq_len * heads * head_dim
    return float(d * (target - sources[0]) * per_layer)


# -- (b) the naive estimator, written straightforwardly as docs/method.md §2 defines it --------------------
def plain_jacobian_for_prompt(model, ids, sources, target, dim_batch, skip_first):
    """Prompt replicated ``dim_batch`` times, full sequence, full model forward (logits included)."""
    hf, d = model.hf_model, model.d_model
    seq_len = ids.shape[1]
    valid = list(range(skip_first, seq_len - 1))
    jac = {layer: torch.zeros(d, d) for layer in sources}
    for start in range(0, d, dim_batch):
        rows = list(range(start, min(start + dim_batch, d)))
        batch = ids.expand(len(rows), -1)
        acts = {}
        hooks = [model.layers[layer].register_forward_hook(
            lambda mod, args, out, layer=layer, acts=acts: acts.__setitem__(
                layer, out[0] if isinstance(out, tuple) else out))
            for layer in sources + [target]]
        try:
            with torch.enable_grad():
                embeds = model.embed(batch).detach().requires_grad_(True)
                hf(inputs_embeds=embeds)
                cot = torch.zeros_like(acts[target])
                for j, row in enumerate(rows):
                    cot[j, valid, row] = 1.0
                grads = torch.autograd.grad(acts[target], [acts[layer] for layer in sources], grad_outputs=cot)
        finally:
            for h in hooks:
                h.remove()
        for layer, g in zip(sources, grads):
            jac[layer][start: start + len(rows)] = g[:, valid].float().sum(dim=1) / len(valid)
    return jac


def backward_flops(model, seq_len: int, skip_first: int, sources: list[int], target: int,
                   fused: bool = False, layer_major: bool = False) -> float:
    """FLOPs of the d_model input-gradient backward passes that remain after the exact savings.

    Per cotangent and backpropagated layer: 2 * n * (linear weights) for the projections, plus
    8 * n * c * (heads * head_dim) for attention (dS, dV, dQ, dK), with n = |V| queries over c keys.
    ``fused``: less the target layer's down_proj product, which the fused backward reads as rows.
    ``layer_major`` (with ``fused``): the MLP half instead costs ``4 n d^2 ff + 2 n d^3`` per layer
    (its per-position matrices formed, then applied to all rows; no product at the target).
    """
    cfg = model.config
    d = model.d_model
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    ff = cfg.intermediate_size
    linear = d * heads * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * ff
    n = seq_len - 1 - skip_first
    c = seq_len - 1
    per_layer = 2 * n * linear + 8 * n * c * heads * head_dim
    layers = target - sources[0]
    if fused and layer_major:  # the MLP half: formed once per layer and position, applied to all d rows
        mlp = 2 * n * 3 * d * ff
        formed = 4 * n * d * d * ff + 2 * n * d ** 3
        return float(layers * (d * (per_layer - mlp) + formed) - 2 * n * d ** 3)  # no product at the target
    saved = 2 * n * d * ff if fused else 0
    return float(d * (layers * per_layer - saved))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_peak_gflops(seconds: float = 3.0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Matmul throughput of this machine in ``dtype`` (best of repeated [m, 1536] @ [1536, 1536] products;
    m = 4096 on the CPU, 32768 on a GPU)."""
    m = 4096 if device == "cpu" else 32768
    a = torch.randn(m, 1536, device=device, dtype=dtype)
    b = torch.randn(1536, 1536, device=device, dtype=dtype)
    best = 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        _sync(device)
        best = max(best, 5 * 2 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - t0) / 1e9)
    return best


def bench_dtype(device: str, dtype: str | None) -> torch.dtype:
    """The model dtype of the run: ``--dtype``, else fp32 on the CPU and bf16 on a GPU (as load_model)."""
    if dtype:
        return getattr(torch, dtype)
    return torch.float32 if device == "cpu" else torch.bfloat16


# -- random models of each family the fused backward covers (--families) ---------------------------
FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gemma2", "gpt2", "gpt_neox", "phi")


def random_family_model(family: str, d_model: int, n_layers: int, dtype: torch.dtype, device: str, seed: int = 0):
    """A randomly initialised model of ``family`` (4 heads of ``d_model / 4``; gated MLPs ``3 d`` wide, plain
    ones ``4 d``; Llama-like families 2 key/value heads; vocabulary 1024), as an ``HFLensModel`` without a
    tokenizer."""
    import transformers as tf

    from jlens_core import HFLensModel

    heads, vocab = 4, 1024
    hd = d_model // heads
    common = {"vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 1}
    gated = {"hidden_size": d_model, "intermediate_size": 3 * d_model, "num_hidden_layers": n_layers,
             "num_attention_heads": heads, "num_key_value_heads": 2, **common}
    plain = {"hidden_size": d_model, "intermediate_size": 4 * d_model, "num_hidden_layers": n_layers,
             "num_attention_heads": heads, **common}
    configs = {
        "llama": lambda: tf.LlamaConfig(**gated),
        "qwen2": lambda: tf.Qwen2Config(**gated),
        "mistral": lambda: tf.MistralConfig(**gated),
        "gemma": lambda: tf.GemmaConfig(**gated, head_dim=hd),
        "gemma2": lambda: tf.Gemma2Config(**gated, head_dim=hd, query_pre_attn_scalar=hd),
        "gpt2": lambda: tf.GPT2Config(n_embd=d_model, n_layer=n_layers, n_head=heads, n_positions=1024, **common),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**plain, max_position_embeddings=1024),
        "phi": lambda: tf.PhiConfig(**plain),
    }
    torch.manual_seed(seed)
    hf = tf.AutoModelForCausalLM.from_config(configs[family](), torch_dtype=dtype).to(device).eval()
    return HFLensModel(hf, None, name=f"random-{family}-d{d_model}-l{n_layers}")


# -- worker: one measurement in its own process -------------------------------------------------
def worker(args) -> None:
    from jlens_core.fitting.estimator import jacobian_for_prompt
    from jlens_core.fitting.fused import fused_unsupported_reason, use_layer_major
    from jlens_core.models.loading import load_model

    dtype = bench_dtype(args.device, args.dtype)
    if args.model.startswith("random:"):  # random:<family>:<d_model>:<layers>
        _, family, width, depth = args.model.split(":")
        model = random_family_model(family, int(width), int(depth), dtype, args.device)
        ids = torch.randint(2, model.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0))
        ids = ids.to(model.device)
    else:
        model = load_model(args.model, device=args.device, dtype=dtype)
        ids = model.encode(PROMPT, max_length=args.seq)
    if ids.shape[1] < args.seq:
        raise SystemExit(f"the benchmark prompt has only {ids.shape[1]} tokens, fewer than {args.seq}")
    first = args.first_layer if args.first_layer >= 0 else model.n_layers - 1 + args.first_layer
    sources = list(range(first, model.n_layers - 1))
    target = model.n_layers - 1
    dim_batch = args.dim_batch if args.dim_batch == "auto" else int(args.dim_batch)
    if args.method in ("plain", "naive", "reference") and dim_batch == "auto":
        dim_batch = 16
    # The matmul peak right before and right after the timed section: a shared host's speed drifts
    # (neighbours), so the achieved rate is also compared with the peak of the same minutes.
    peak_before = matmul_peak_gflops(seconds=1.5, device=args.device, dtype=dtype)
    _sync(args.device)
    t0 = time.perf_counter()
    if args.method in ("plain", "naive"):
        jac = plain_jacobian_for_prompt(model, ids, sources, target, dim_batch, args.skip_first)
    elif args.method == "reference":
        jac = reference_jacobian_for_prompt(model, ids, sources, target, dim_batch, args.skip_first)
    else:
        method = {"jlens": "auto", "jlens-batched": "batched", "jlens-replicated": "replicated",
                  "jlens-fused": "fused", "jlens-relevance": "auto"}[args.method]
        rules = "relevance" if args.method == "jlens-relevance" else "jacobian"
        jac = jacobian_for_prompt(model, ids, source_layers=sources, target_layer=target, dim_batch=dim_batch,
                                  max_seq_len=args.seq, skip_first=args.skip_first, method=method,
                                  rules=rules).jacobians
    _sync(args.device)
    seconds = time.perf_counter() - t0
    peak_after = matmul_peak_gflops(seconds=1.5, device=args.device, dtype=dtype)
    torch.save({k: v.float().cpu() for k, v in jac.items()}, args.out)
    if args.device.startswith("cuda"):
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    fused = args.method in ("jlens", "jlens-fused", "jlens-relevance") and not fused_unsupported_reason(model)
    layer_major = fused and use_layer_major(model, args.seq - 1 - args.skip_first)
    if args.model.startswith("random:"):  # the FLOP count is written for Llama layouts only
        flops = None
    elif args.method == "reference":
        flops = reference_flops(model, args.seq, sources, target)
    else:
        flops = backward_flops(model, args.seq, args.skip_first, sources, target, fused=fused, layer_major=layer_major)
    print(json.dumps({"seconds": seconds, "peak_rss_mb": peak_mb, "flops": flops, "fused": fused,
                      "layer_major": layer_major, "adjacent_peak_gflops": (peak_before + peak_after) / 2}))


def split_method(method: str, default: str | None) -> tuple[str, str | None]:
    """``"jlens@bfloat16"`` -> ``("jlens", "bfloat16")``; a method without ``@`` runs in ``default`` (``--dtype``)."""
    name, _, dtype = method.partition("@")
    return name, (dtype or default)


def run_one(method: str, seq: int, args, out: str) -> dict:
    method, dtype = split_method(method, args.dtype)
    cmd = [sys.executable, __file__, "--worker", "--method", method, "--seq", str(seq), "--out", out,
           "--first-layer", str(args.first_layer), "--dim-batch", str(args.dim_batch),
           "--skip-first", str(args.skip_first), "--model", args.model, "--device", args.device]
    if dtype:
        cmd += ["--dtype", dtype]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))
    if proc.returncode != 0:
        raise SystemExit(f"worker {method} seq={seq} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rel_fro(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).double().norm() ** 2) for k in a)
    den = sum(float(b[k].double().norm() ** 2) for k in a)
    return (num / den) ** 0.5


def families_main(args) -> None:
    """``--families``: per family, the fused backward (``jlens``, method ``auto``) against autograd
    (``jlens-batched``) on a random model of that family, interleaved (each repetition runs every family
    and both methods once, each in its own process); medians, the ratio and the relative Frobenius
    difference of the two results."""
    families = args.families.split(",")
    seq = int(args.seqs.split(",")[0])
    reps = args.reps or 2
    methods = ("jlens-batched", "jlens")
    times: dict = {(f, m): [] for f in families for m in methods}
    info: dict = {}
    results: dict = {}
    dtype_name = str(bench_dtype(args.device, args.dtype)).removeprefix("torch.")
    print(f"families {families}: random models d_model {args.d_model}, {args.layers} layers, seq {seq}, "
          f"skip_first {args.skip_first}, dim_batch {args.dim_batch}, {dtype_name} on {args.device}, "
          f"{torch.get_num_threads()} threads, {reps} repetitions (interleaved)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for family in families:
                args.model = f"random:{family}:{args.d_model}:{args.layers}"
                for method in methods:
                    out = os.path.join(tmp, f"{family}-{method}.pt")
                    r = run_one(method, seq, args, out)
                    times[family, method].append(r["seconds"])
                    info[family, method] = r
                    results[family, method] = torch.load(out)
                    print(f"  rep {rep + 1}/{reps} {family:9s} {method:14s} {r['seconds']:7.2f} s "
                          f"peak {r['peak_rss_mb']:6.0f} MB", flush=True)
    summary = {"device": args.device, "dtype": dtype_name, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "d_model": args.d_model, "layers": args.layers, "seq": seq,
               "skip_first": args.skip_first, "dim_batch": args.dim_batch, "reps": reps, "rows": []}
    print(f"\n{'family':9s} {'fused s':>8} {'autograd s':>10} {'speedup':>8} {'rel.diff':>9} {'order':>12}")
    for family in families:
        fused, batched = (statistics.median(times[family, m]) for m in ("jlens", "jlens-batched"))
        diff = rel_fro(results[family, "jlens"], results[family, "jlens-batched"])
        r = info[family, "jlens"]
        order = ("layer-major" if r["layer_major"] else "row-major") if r["fused"] else "not fused"
        summary["rows"].append({"family": family, "fused_seconds_median": fused, "fused_seconds_all": times[family, "jlens"],
                                "batched_seconds_median": batched,
                                "batched_seconds_all": times[family, "jlens-batched"], "speedup": batched / fused,
                                "rel_frobenius_diff": diff, "order": order,
                                "fused_peak_rss_mb": r["peak_rss_mb"],
                                "batched_peak_rss_mb": info[family, "jlens-batched"]["peak_rss_mb"]})
        print(f"{family:9s} {fused:8.2f} {batched:10.2f} {batched / fused:7.2f}x {diff:9.1e} {order:>12}")
    Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {args.json}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the 5 source layers below the last only (24..28 of "
                                                        "SmolLM2-135M), 2 repetitions")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 2 with --quick)")
    p.add_argument("--seqs", default="64,128", help="max_seq_len values (default 64,128)")
    p.add_argument("--methods", default="reference,naive,jlens-batched,jlens,jlens-relevance",
                   help="comma-separated; the first is the baseline of the ratios: reference (the reference jlens's "
                        "own algorithm), naive (docs/method.md §2 as written: a forward per chunk of rows, backward to the "
                        "embedding), jlens (the default method, 'auto': the fused backward here), jlens-batched "
                        "(autograd, cotangents batched), jlens-replicated, jlens-fused, jlens-relevance (the "
                        "R-lens's fit, rules='relevance') (default: reference,naive,jlens-batched,jlens,jlens-relevance)")
    p.add_argument("--dim-batch", default="8", help="rows per backward pass, or 'auto' (default 8)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default=None, help="model dtype: float32 / bfloat16 / float16 (default fp32 on the CPU, "
                                                 "bf16 on a GPU; J is accumulated in fp32 either way)")
    p.add_argument("--skip-first", type=int, default=16)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", default=None, help="where the JSON goes (default bench/fit_speed.json; with "
                                                "--families bench/fit_speed_families.json)")
    p.add_argument("--families", default=None, help="comma-separated families (" + ",".join(FAMILIES) + "): the "
                   "fused backward against autograd on a random model of each, instead of the methods table")
    p.add_argument("--d-model", type=int, default=256, help="--families: the random models' width (default 256)")
    p.add_argument("--layers", type=int, default=8, help="--families: their depth (default 8)")
    p.add_argument("--first-layer", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.first_layer is None:
        args.first_layer = -5 if args.quick else 0  # --quick: the 5 layers below the last
    if args.worker:
        return worker(args)
    if args.json is None:
        args.json = str(ROOT / "bench" / ("fit_speed_families.json" if args.families else "fit_speed.json"))
    if args.families:
        return families_main(args)
    reps = args.reps or (2 if args.quick else 3)
    seqs = [int(s) for s in args.seqs.split(",")]
    methods = args.methods.split(",")
    dtype = bench_dtype(args.device, args.dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    # a method may name its own dtype ("jlens@bfloat16"): each dtype's matmul peak is measured beside the default's
    method_dtype = {m: str(bench_dtype(args.device, split_method(m, args.dtype)[1])).removeprefix("torch.")
                    for m in methods}
    other_dtypes = sorted(set(method_dtype.values()) - {dtype_name})
    other_peaks: dict[str, list[float]] = {name: [] for name in other_dtypes}

    def measure_peak() -> float:
        for name in other_dtypes:
            other_peaks[name].append(matmul_peak_gflops(device=args.device, dtype=getattr(torch, name)))
        return matmul_peak_gflops(device=args.device, dtype=dtype)

    peaks = [measure_peak()]
    where = (f"{torch.get_num_threads()} threads" if args.device == "cpu"
             else torch.cuda.get_device_name(args.device))
    print(f"{dtype_name} matmul peak (measured): {peaks[0]:.1f} GFLOP/s; torch {torch.__version__}, "
          f"{where}; model {args.model}; source layers {args.first_layer}.. -> last", flush=True)
    times = {(m, s): [] for m in methods for s in seqs}
    rss = {(m, s): [] for m in methods for s in seqs}
    adjacent = {(m, s): [] for m in methods for s in seqs}  # achieved / the peak of the same minutes
    flops = {}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for seq in seqs:
                for method in methods:  # interleaved: each repetition runs every method once
                    out = os.path.join(tmp, f"{method}-{seq}.pt")
                    r = run_one(method, seq, args, out)
                    times[method, seq].append(r["seconds"])
                    rss[method, seq].append(r["peak_rss_mb"])
                    flops[method, seq] = r["flops"]
                    adjacent[method, seq].append(r["flops"] / r["seconds"] / 1e9 / r["adjacent_peak_gflops"])
                    results[method, seq] = torch.load(out)
                    print(f"  rep {rep + 1}/{reps} seq {seq:4d} {method:17s} {r['seconds']:8.2f} s "
                          f"peak {r['peak_rss_mb']:7.0f} MB; matmul peak around it "
                          f"{r['adjacent_peak_gflops']:.0f} GFLOP/s", flush=True)
            # The machine's speed may drift (shared hosts): the peak is re-measured after every repetition.
            peaks.append(measure_peak())
            print(f"  matmul peak after rep {rep + 1}: {peaks[-1]:.1f} GFLOP/s", flush=True)
    peak = max(peaks)
    summary = {"matmul_peak_gflops": peak, "matmul_peak_all": peaks, "device": args.device, "dtype": dtype_name,
               "model": args.model, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "first_source_layer": args.first_layer, "dim_batch": args.dim_batch, "reps": reps, "rows": []}
    dtype_peak = {dtype_name: peak, **{name: max(v) for name, v in other_peaks.items()}}
    if other_dtypes:
        summary["matmul_peak_gflops_by_dtype"] = dtype_peak
        summary["matmul_peak_all_by_dtype"] = {dtype_name: peaks, **other_peaks}
        from bf16_fit import cpu_flags

        summary["cpu"] = cpu_flags()
    print(f"\n{dtype_name} matmul peak: {peak:.1f} GFLOP/s (best of {len(peaks)} measurements: "
          + ", ".join(f"{x:.0f}" for x in peaks) + ")")
    print(f"{'seq':>4} {'method':17s} {'s/prompt':>9} {'ratio':>6} {'rel.diff':>9} {'peak MB':>8} "
          f"{'GFLOP/s':>8} {'% peak':>7} {'% adj.':>7}")
    for seq in seqs:
        base = statistics.median(times[methods[0], seq])
        for method in methods:
            med = statistics.median(times[method, seq])
            diff = rel_fro(results[method, seq], results[methods[0], seq])
            gflops = flops[method, seq] / med / 1e9 if split_method(method, None)[0] not in ("plain", "naive") else None
            row_peak = dtype_peak[method_dtype[method]]
            row = {"seq": seq, "method": method, "dtype": method_dtype[method], "seconds_median": med,
                   "seconds_all": times[method, seq],
                   "speedup_vs_" + methods[0]: base / med, "rel_frobenius_diff_vs_" + methods[0]: diff,
                   "peak_rss_mb": max(rss[method, seq]), "gflops": gflops,
                   "fraction_of_peak": gflops / row_peak if gflops else None,
                   "fraction_of_adjacent_peak_median": statistics.median(adjacent[method, seq]) if gflops else None,
                   "fraction_of_adjacent_peak_all": adjacent[method, seq] if gflops else None}
            summary["rows"].append(row)
            print(f"{seq:4d} {method:17s} {med:9.2f} {base / med:6.2f} {diff:9.1e} {max(rss[method, seq]):8.0f} "
                  + (f"{gflops:8.1f} {100 * gflops / row_peak:6.1f}% "
                     f"{100 * row['fraction_of_adjacent_peak_median']:6.1f}%"
                     if gflops else f"{'-':>8} {'-':>7} {'-':>7}"))
    print("% peak: the median rate against the best matmul peak of the run; % adj.: the median over repetitions "
          "of each measurement's rate against the matmul peak measured right before and after it")
    Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
