"""A 1B-class model on this machine: reading, lens file loading and one fit prompt, measured.

Researchers bring Llama-, Qwen- and Gemma-sized models. This builds a random model of that shape
from a config (Llama layout: d_model 2048, 16 layers, d_ff 8192, 32 heads / 8 key-value heads,
vocabulary 128256, tied embeddings: the shape of Llama-3.2-1B, 1.24 B parameters) with the
embedded default model's tokenizer (ids above its 49152 are never typed, only scored), a random
Jacobian lens for it, and reports:

* loading the lens file (fp16, all 15 source layers; seconds, MB of file and of memory);
* reading a 64-token prompt with the logit lens and with the Jacobian lens (seconds, peak memory
  above the loaded model, against ``layers x positions x vocab`` fp32, which is never held);
* one fit prompt at seq 128 (the fused estimator; on the CPU a measured share of the d_model rows,
  extrapolated linearly: the rows are independent and equally costly; on a GPU the whole prompt).

    python bench/large_model.py                    # CPU, fp32 (writes bench/large_model.json)
    python bench/large_model.py --fit-rows 64      # measure more rows of the fit prompt
    python bench/large_model.py --device cuda --dtype bfloat16 --json bench/large_model_gpu.json
    python bench/large_model.py --budgets 512MiB,4GiB        # one fit prompt at each memory budget only
                                                             # (writes bench/large_model_budget.json)

With ``--budgets`` it runs one whole fit prompt per budget (``jacobian_for_prompt(max_memory=...)``,
``dim_batch="auto"``: the budget chooses the rows per pass and the fused order) and reports the
plan, the seconds and the peak memory reached above the loaded model (sampled RSS on the CPU,
``torch.cuda.max_memory_allocated`` on a GPU) against the budget. On the CPU the whole prompt of all
15 layers takes half an hour, so ``--budget-seq`` and ``--budget-layers`` reduce it (defaults: 48
tokens, the last 2 layers backpropagated; the full width and MLP).

With ``--device-map`` the model is placed over several devices (accelerate's ``dispatch_model``) and
the row is: placing it, the 64-token readings through both lenses, and one whole fit prompt
(``jacobian_for_prompt``, ``method="auto"``) whose backward crosses from one device to the next. The
map is a strategy (``auto``: all visible GPUs, then the CPU), a JSON object of module names to devices
(the syntax of ``jlens fit --device-map``), or ``DEV,DEV,...``: the decoder layers cut into equal
consecutive parts, in that order (``cpu,cuda:0``: layers 0-7 on the CPU, 8-15, the final norm and the
tied embedding/head on the GPU)::

    python bench/large_model.py --device cuda --device-map cpu,cuda:0 --json bench/large_model_split_gpu.json
    python bench/large_model.py --device cuda --device-map auto --json bench/large_model_auto_gpu.json
    python bench/large_model.py --device-map cpu,cpu --d-model 256 --layers 4   # the same code, on the CPU

A script, not a test: it prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PROMPT_64 = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz combined "
             "movable metal type, oil-based ink and a wooden press adapted from those used for wine. Within fifty "
             "years presses were working in more than two hundred cities across Europe, and the price of a book fell "
             "so far that a clerk, a merchant or a student could own the texts that only monasteries had kept.")


class PeakRSS:
    """Peak resident memory of this process (sampled every 5 ms) while inside the block, in MB."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()

    @staticmethod
    def now() -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.005)

    def __enter__(self):  # -> PeakRSS
        self.start = self.now()
        self.peak = self.start
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_model(args, device_map=None):
    """The random 1B-class model as an HFLensModel (weights N(0, 0.02), norms 1); built on ``args.device``,
    or on the CPU and then placed by accelerate over ``device_map`` (module name -> device)."""
    import transformers as tf

    from jlens_core.models.loading import default_tokenizer
    from jlens_core.models.model import HFLensModel

    config = tf.LlamaConfig(hidden_size=args.d_model, intermediate_size=4 * args.d_model, num_hidden_layers=args.layers,
                            num_attention_heads=args.d_model // 64, num_key_value_heads=max(1, args.d_model // 256),
                            vocab_size=args.vocab, tie_word_embeddings=True, max_position_embeddings=4096,
                            bos_token_id=0, eos_token_id=1)
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):
        hf = tf.LlamaForCausalLM(config)
    hf = hf.to_empty(device=args.device).to(dtype)
    gen = torch.Generator(device=args.device).manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config).to(args.device)  # real buffers, not to_empty garbage
    hf.tie_weights()
    if device_map is not None:
        from accelerate import dispatch_model

        hf = dispatch_model(hf, device_map=device_map)
    tokenizer = default_tokenizer()
    return HFLensModel(hf, tokenizer, name=f"random-llama-{args.d_model}x{args.layers}-v{args.vocab}")


def random_lens(model):
    from jlens_core.lenses.lens import JacobianLens

    d = model.d_model
    gen = torch.Generator().manual_seed(1)
    jac = {layer: torch.eye(d) + torch.randn(d, d, generator=gen) / d ** 0.5 for layer in range(model.n_layers - 1)}
    return JacobianLens(jac, n_prompts=1, d_model=d, target_layer=model.n_layers - 1, n_layers=model.n_layers,
                        model_name=model.name, model_fingerprint=model.fingerprint())


def layer_split_map(devices: list[str], n_layers: int, tied: bool = True) -> dict[str, str]:
    """Module name -> device: the decoder layers in ``len(devices)`` equal consecutive parts, in order; the
    embedding on the first device (on the last when tied to the head), the final norm, the rotary
    embedding and the head on the last."""
    cuts = [round(i * n_layers / len(devices)) for i in range(len(devices) + 1)]
    mapping = {f"model.layers.{layer}": device for device, lo, hi in zip(devices, cuts, cuts[1:], strict=False)
               for layer in range(lo, hi)}
    last = devices[-1]
    return {"model.embed_tokens": last if tied else devices[0], **mapping, "model.rotary_emb": last,
            "model.norm": last, "lm_head": last}


def resolve_device_map(spec: str, args) -> dict[str, str | int]:
    """``--device-map``: a strategy (``auto``...), a JSON object, or ``DEV,DEV,...`` (:func:`layer_split_map`)."""
    from jlens_core.models.device_maps import STRATEGIES, check_device, parse_device_map

    if spec in STRATEGIES:  # placed by accelerate from the model's size and the free memory
        import transformers as tf
        from accelerate import infer_auto_device_map
        from accelerate.utils import get_balanced_memory

        config = tf.LlamaConfig(hidden_size=args.d_model, intermediate_size=4 * args.d_model,
                                num_hidden_layers=args.layers, num_attention_heads=args.d_model // 64,
                                num_key_value_heads=max(1, args.d_model // 256), vocab_size=args.vocab,
                                tie_word_embeddings=True)
        with torch.device("meta"):
            skeleton = tf.LlamaForCausalLM(config).to(getattr(torch, args.dtype))
        no_split = skeleton._no_split_modules
        memory = None if spec in ("auto", "sequential") else get_balanced_memory(
            skeleton, no_split_module_classes=no_split, low_zero=spec == "balanced_low_0")
        skeleton.tie_weights()  # accelerate keeps tied weights on one device
        return infer_auto_device_map(skeleton, max_memory=memory, no_split_module_classes=no_split)
    if spec.lstrip().startswith("{"):
        parsed = parse_device_map(spec)
        assert isinstance(parsed, dict)
        return parsed
    devices = [str(check_device(d.strip(), what="--device-map's device")) for d in spec.split(",")]
    return dict(layer_split_map(devices, args.layers))


def multi_device_main(args) -> dict:
    """One model over several devices: placing it, the readings, one whole fit prompt across the devices."""
    from collections import Counter

    from jlens_core.fitting.estimator import _fused_usable, jacobian_for_prompt
    from jlens_core.lenses.lens import LogitLens
    from jlens_core.models.placement import execution_device
    from jlens_core.reading.reader import read_prompts

    on_gpu = args.device.startswith("cuda")
    device_map = resolve_device_map(args.device_map, args)
    build_args = argparse.Namespace(**{**vars(args), "device": "cpu"})
    t = time.perf_counter()
    model = build_model(build_args, device_map=device_map)
    t_place = time.perf_counter() - t
    layers = model.hf_model.model.layers
    devices = [str(execution_device(layer)) for layer in layers]
    per_device = dict(Counter(devices))
    print(f"{model.name} ({args.dtype}) over {per_device}: built and placed in {t_place:.1f} s", flush=True)
    rows = [{"step": "build on the CPU and place", "seconds": t_place}]

    lens = random_lens(model)
    logit = LogitLens.for_model(model)
    ids = model.encode(PROMPT_64)[:, :64]
    read_prompts(model, {"logit": logit}, ids[:, :8])  # first-call set-up
    for attempt in ("first", "again"):
        _sync(args.device)
        t = time.perf_counter()
        read_prompts(model, {"logit": logit, "jacobian": lens}, ids)
        _sync(args.device)
        rows.append({"step": f"read a {int(ids.shape[1])}-token prompt, both lenses in one pass ({attempt})",
                     "seconds": time.perf_counter() - t})
        print(f"{rows[-1]['step']:70s} {rows[-1]['seconds']:8.2f} s", flush=True)

    target = model.n_layers - 1
    # backpropagate into the first device's last layer: the cotangent crosses a device boundary
    first_upper = next((i for i, d in enumerate(devices) if d != devices[0]), None)
    depth = args.budget_layers or (target - first_upper + 2 if first_upper is not None else 2)
    depth = min(depth, target)
    sources = list(range(target - depth, target))
    seq = args.budget_seq or (128 if on_gpu else 48)
    fit_ids = model.encode(PROMPT_64 * 3)[:, :seq]
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    _sync(args.device)
    t = time.perf_counter()
    result = jacobian_for_prompt(model, fit_ids, source_layers=sources, target_layer=target,
                                 dim_batch=args.dim_batch, max_seq_len=seq, skip_first=16, method="auto")
    _sync(args.device)
    seconds = time.perf_counter() - t
    crossed = sorted({devices[i] for i in range(sources[0] + 1, target + 1)})
    row = {"step": f"one fit prompt, seq {int(fit_ids.shape[1])}, layers {sources[0]}..{target - 1} -> {target}",
           "seconds": seconds, "method": "fused" if _fused_usable(model) else "batched",
           "devices_backpropagated": crossed, "dim_batch": result.dim_batch}
    if on_gpu:
        row["gpu_peak_MB"] = {f"cuda:{i}": torch.cuda.max_memory_allocated(i) / 2**20
                              for i in range(torch.cuda.device_count())}
    rows.append(row)
    print(f"{row['step']:70s} {seconds:8.2f} s  across {crossed}", flush=True)
    out = {"device": args.device, "device_map_spec": args.device_map, "layers_per_device": per_device,
           "gpus_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
           "measured_on_gpu": on_gpu, "dtype": args.dtype, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "model": model.name, "d_model": model.d_model,
           "layers": model.n_layers, "vocab": model.vocab_size, "load_average": os.getloadavg(), "rows": rows}
    path = args.json or str(ROOT / "bench" / "large_model_multi_device.json")
    Path(path).write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


def budget_main(args) -> None:
    """One fit prompt per memory budget: the plan, the seconds and the peak above the loaded model."""
    from jlens_core.fitting.estimator import jacobian_for_prompt
    from jlens_core.fitting.memory_budget import FitSizes, budget_bytes, plan_memory
    from jlens_core.models.device_maps import format_bytes

    on_gpu = args.device.startswith("cuda")
    seq = args.budget_seq or (128 if on_gpu else 48)
    model = build_model(args)
    target = model.n_layers - 1
    depth = args.budget_layers or (target if on_gpu else 2)
    sources, skip = list(range(target - depth, target)), 16
    ids = model.encode(PROMPT_64 * 3)[:, :seq]
    n_valid = int(ids.shape[1]) - 1 - skip
    sizes = FitSizes.of(model, n_valid=n_valid, layers_backward=depth, n_sources=len(sources), skip_first=skip)
    print(f"{model.name}: seq {int(ids.shape[1])} ({n_valid} valid), layers {sources[0]}..{target - 1} -> {target} "
          f"({depth} backpropagated), {args.dtype}, {torch.get_num_threads()} threads, device {args.device}",
          flush=True)
    print(f"{'budget':>10s} {'order':>11s} {'dim_batch':>9s} {'planned':>10s} {'peak':>10s} {'s/prompt':>9s}")
    # first-call set-up (the prefix-cache check, kernels) outside the measurements: a 3-position prompt
    jacobian_for_prompt(model, ids[:, :skip + 3], source_layers=sources, target_layer=target, dim_batch=64,
                        max_seq_len=seq, skip_first=skip, method="fused")
    rows = []
    for text in args.budgets.split(","):
        budget = budget_bytes(text)
        plan = plan_memory(sizes, budget, "fused")
        _sync(args.device)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
            gpu_base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        with PeakRSS() as mem:
            result = jacobian_for_prompt(model, ids, source_layers=sources, target_layer=target, dim_batch="auto",
                                         max_seq_len=seq, skip_first=skip, method="fused", max_memory=budget)
            _sync(args.device)
        seconds = time.perf_counter() - t
        peak = ((torch.cuda.max_memory_allocated() - gpu_base) if on_gpu else (mem.peak - mem.start) * 2**20)
        assert result.dim_batch == plan.dim_batch and result.layer_major == plan.layer_major
        order = "layer-major" if plan.layer_major else "row-major"
        rows.append({"budget_bytes": budget, "order": order, "dim_batch": plan.dim_batch,
                     "planned_bytes": plan.planned_bytes, "peak_bytes": int(peak), "seconds_per_prompt": seconds,
                     "peak_measure": "torch.cuda.max_memory_allocated above the loaded model" if on_gpu
                     else "process RSS sampled every 5 ms, above the loaded model"})
        print(f"{format_bytes(budget):>10s} {order:>11s} {plan.dim_batch:>9d} {format_bytes(plan.planned_bytes):>10s} "
              f"{format_bytes(peak):>10s} {seconds:9.1f}", flush=True)
    out = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "model": model.name, "d_model": model.d_model, "layers": model.n_layers, "d_ff": sizes.mlp_width,
           "seq": int(ids.shape[1]), "n_valid": n_valid, "layers_backpropagated": depth, "skip_first": skip,
           "load_average": os.getloadavg(), "rows": rows}
    path = args.json or str(ROOT / "bench" / "large_model_budget.json")
    Path(path).write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on the CPU (default), bfloat16 on a GPU")
    p.add_argument("--fit-rows", type=int, default=32, help="rows of the fit prompt to measure on the CPU "
                                                            "(default 32 of d_model; all on a GPU)")
    p.add_argument("--dim-batch", type=int, default=16)
    p.add_argument("--json", default=None, help="default bench/large_model.json (bench/large_model_budget.json "
                                                 "with --budgets)")
    p.add_argument("--budgets", default=None, help="comma-separated memory budgets (e.g. 512MiB,4GiB): only the "
                                                   "fit prompt, once per budget")
    p.add_argument("--budget-seq", type=int, default=None, help="tokens of the budgeted fit prompt (default 48 on "
                                                                "the CPU, 128 on a GPU)")
    p.add_argument("--budget-layers", type=int, default=None,
                   help="layers backpropagated in the budgeted fit prompt (default 2 on the CPU, all on a GPU)")
    p.add_argument("--device-map", default=None,
                   help="place the model over several devices: a strategy (auto: all visible GPUs), a JSON object "
                        "of module names to devices, or DEV,DEV,... (the layers cut into equal parts in that "
                        "order); then one row: place, read, one fit prompt across the devices")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.device_map:
        multi_device_main(args)
        return
    if args.budgets:
        budget_main(args)
        return
    args.json = args.json or str(ROOT / "bench" / "large_model.json")
    from fit_speed import matmul_peak_gflops

    from jlens_core.fitting import fused
    from jlens_core.lenses.lens import JacobianLens, LogitLens
    from jlens_core.reading.reader import read_prompt, read_prompts

    rows = []

    def row(step: str, seconds: float, **extra) -> None:
        rows.append({"step": step, "seconds": seconds, **extra})
        more = "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items())
        print(f"{step:74s} {seconds:8.2f} s  {more}", flush=True)

    peak = matmul_peak_gflops(device=args.device, dtype=getattr(torch, args.dtype) if args.device != "cpu"
                              else torch.float32)
    print(f"matmul peak {peak:.0f} GFLOP/s ({args.dtype}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {args.device}", flush=True)
    t = time.perf_counter()
    with PeakRSS() as mem:
        model = build_model(args)
    n_params = sum(p.numel() for p in model.hf_model.parameters())
    row("build the random model", time.perf_counter() - t, params_M=n_params / 1e6, rss_MB=mem.peak)

    lens = random_lens(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lens.safetensors"
        lens.save(path, dtype="float16")
        size_mb = path.stat().st_size / 2**20
        del lens
        os.sync()
        t = time.perf_counter()
        with PeakRSS() as mem:
            lens = JacobianLens.load(path, model=model)
        row("load the lens file (fp16)", time.perf_counter() - t, file_MB=size_mb, rss_added_MB=mem.peak - mem.start)

    ids = model.encode(PROMPT_64)[:, :64]
    n_tokens = int(ids.shape[1])
    full_grid_mb = model.n_layers * n_tokens * model.vocab_size * 4 / 2**20
    read_prompt(model, LogitLens.for_model(model), ids[:, :8])  # first-call set-up (token strings, threads)
    logit = LogitLens.for_model(model)
    readings = (("logit lens", lambda: read_prompt(model, logit, ids)),
                ("Jacobian lens", lambda: read_prompt(model, lens, ids)),
                # what the app does for its side-by-side view: one pass, both lenses
                ("both lenses in one pass", lambda: read_prompts(model, {"logit": logit, "jacobian": lens}, ids)))
    for name, read in readings:
        for attempt in ("first", "again"):
            _sync(args.device)
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
                gpu_base = torch.cuda.memory_allocated()
            t = time.perf_counter()
            with PeakRSS() as mem:
                read()
            _sync(args.device)
            extra = {"peak_added_MB": mem.peak - mem.start, "layers_x_pos_x_vocab_MB": full_grid_mb}
            if args.device.startswith("cuda"):  # the GPU's own peak above what the model holds
                extra["gpu_peak_added_MB"] = (torch.cuda.max_memory_allocated() - gpu_base) / 2**20
            row(f"read a {n_tokens}-token prompt, {name} ({attempt})", time.perf_counter() - t, **extra)

    fit_ids = model.encode(PROMPT_64 * 3)[:, :128]
    sources, target, skip = list(range(model.n_layers - 1)), model.n_layers - 1, 16
    d = model.d_model
    want = d if args.device != "cpu" else min(d, args.fit_rows)
    with torch.no_grad():
        _sync(args.device)
        t = time.perf_counter()
        with PeakRSS() as mem:
            prep = fused.prepare_layers(model, fit_ids, sources[0], target, skip)
            _sync(args.device)
            t_prep = time.perf_counter() - t
            t = time.perf_counter()
            for start in range(0, want, args.dim_batch):
                r = range(start, min(start + args.dim_batch, want))
                grad = None
                for j in range(target, sources[0], -1):
                    grad = fused.backward_layer(prep, j, grad, r)
                    grad.float().sum(dim=1).cpu()
            _sync(args.device)
            t_rows = time.perf_counter() - t
    total = t_prep + t_rows * d / want
    note = "measured" if want == d else f"extrapolated from {want} of {d} rows"
    row(f"one fit prompt, seq {int(fit_ids.shape[1])}, all {len(sources)} source layers ({note})", total,
        forward_s=t_prep, rows_measured=want, rss_added_MB=mem.peak - mem.start)
    out = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "matmul_peak_gflops": peak, "d_model": d, "layers": model.n_layers, "vocab": model.vocab_size,
           "params_M": n_params / 1e6, "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
