"""Is a bf16 fit safe and how much faster is it? fp32 against bf16 fits of the default model, in ONE run.

One question, three measurements, all interleaved so that a shared host's load falls on both arms alike:

1. **Speed.** Seconds per prompt of ``jacobian_for_prompt`` (all source layers, ``dim_batch`` 8, method auto) in
   fp32 and in bf16 (the fit's bf16 twin of the model, ``jlens_core.fitting.precision.compute_model``), at 64
   tokens (every prompt of part 2, the order of the two arms alternating) and at 128 tokens (``--reps``
   repetitions on bench/fit_speed.py's prompt). Medians and the median of the per-pair ratios; achieved
   GFLOP/s (bench/fit_speed.py's FLOP count) against the matmul peak of each dtype measured in the same run.
2. **Error against sampling error.** The fp32 lens and the bf16 lens of the same ``--prompts`` corpus prompts
   (64 tokens, split halves kept): per layer the relative Frobenius difference ``||J_bf16 - J_fp32|| / ||J_fp32||``
   next to the fp32 lens's split-half predicted relative SE (docs/method.md §3.3). The rule of issue 52: bf16
   may be the default only where the difference is below one fifth of the SE at every layer.
3. **Readings.** Both lenses read ``--heldout`` held-out texts (the corpus's eval split, 64 tokens): per layer the
   top-1 agreement and the mean KL(fp32 lens || bf16 lens) in nats, next to the same figures between the fp32
   lens's two halves (the sampling noise of the fit, for scale).

    python bench/bf16_fit.py --prompts 20 --reps 2        # the table in bench/README.md
    python bench/bf16_fit.py --prompts 2 --reps 0 --heldout 2 --json /tmp/x.json   # a smoke run

Writes ``bench/bf16_fit.json`` (rewritten after every prompt, so a run cut short keeps what it measured).
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

from fit_speed import PROMPT, backward_flops, matmul_peak_gflops


def host_load(start: float) -> str:
    """The run's conditions as measured: the 1-minute load average before it and now (its own threads included)."""
    import os

    return (f"1-minute load average {start:.1f} before the run, {os.getloadavg()[0]:.1f} at its end (its own threads "
            f"included) on {os.cpu_count() or 1} cores; arms interleaved")


def cpu_flags() -> dict:
    """The CPU's model name and the flags that decide bf16 speed, as /proc/cpuinfo names them."""
    from jlens_core.models.cpu_features import cpu_bf16_flag

    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    shown = sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f", "avx512_vnni")))
    return {"model_name": name, "flags": shown, "bf16_flag": cpu_bf16_flag(),
            "cores": torch.get_num_threads(), "torch": torch.__version__}


def time_prompt(model, ids, sources, target) -> tuple[float, dict, bool]:
    from jlens_core.fitting.estimator import jacobian_for_prompt

    t0 = time.perf_counter()
    result = jacobian_for_prompt(model, ids, source_layers=sources, target_layer=target, max_seq_len=ids.shape[1])
    return time.perf_counter() - t0, result.jacobians, bool(result.layer_major)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20, help="corpus prompts of the two 64-token lenses")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions at 128 tokens (0: none)")
    ap.add_argument("--heldout", type=int, default=8, help="held-out texts the two lenses read")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=None,
                    help="stop adding prompts after this many minutes (at an even count, at least 8 prompts)")
    ap.add_argument("--sums", default=None, help="save the two lenses' per-half sums here (torch.save) after each "
                    "prompt; with --from-sums, read them instead of fitting")
    ap.add_argument("--from-sums", action="store_true")
    ap.add_argument("--speed-only", type=int, default=None, metavar="FIRST_LAYER",
                    help="only part 1, on source layers FIRST_LAYER..28 (a shorter backward), at 64 and 128 tokens, "
                         "--reps interleaved repetitions (for a host too loaded for the whole run)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "bf16_fit.json"))
    args = ap.parse_args()

    from jlens_core import load_model
    from jlens_core.corpus import load_corpus
    from jlens_core.fitting.precision import compute_model

    start_load = os.getloadavg()[0]
    out: dict = {"cpu": cpu_flags(), "conditions": host_load(start_load), "seq": args.seq}
    model = load_model()
    twin = compute_model(model, "bfloat16")
    arms = {"float32": model, "bfloat16": twin}
    n_layers = model.n_layers
    sources, target = list(range(n_layers - 1)), n_layers - 1
    peaks: dict[str, list[float]] = {"float32": [], "bfloat16": []}

    def measure_peaks() -> None:
        for name in ("float32", "bfloat16"):
            peaks[name].append(matmul_peak_gflops(seconds=1.5, dtype=getattr(torch, name)))

    def save() -> None:
        out["conditions"] = host_load(start_load)
        out["matmul_peak_gflops"] = {k: {"best": max(v), "all": [round(x, 1) for x in v]} for k, v in peaks.items() if v}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

    measure_peaks()
    flops = {seq: {lm: backward_flops(model, seq, 16, sources, target, fused=True, layer_major=lm)
                   for lm in (False, True)} for seq in (args.seq, 128)}

    if args.speed_only is not None:
        speed_only(args, out, arms, peaks, measure_peaks, save)
        return

    # -- parts 1 and 2: the two 64-token lenses, prompt by prompt, the arms alternating ----------------------
    texts = load_corpus(split="fit", n=args.prompts * 2)
    d = model.d_model
    sums = {name: {layer: torch.zeros(2, d, d, dtype=torch.float64) for layer in sources} for name in arms}
    counts = [0, 0]
    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    per_prompt_rel: list[dict] = []
    layer_major = {}
    t_start = time.perf_counter()
    if args.from_sums:
        saved = torch.load(args.sums)
        sums, counts, times, per_prompt_rel, layer_major = (saved[k] for k in (
            "sums", "counts", "times", "per_prompt_rel", "layer_major"))
        texts = []
        out["fit_64"] = speed_row(times, flops[args.seq], layer_major, peaks)
        out["per_prompt_rel_diff"] = per_prompt_rel
    for text in texts:
        done = counts[0] + counts[1]
        late = args.minutes is not None and time.perf_counter() - t_start > 60 * args.minutes
        if done >= args.prompts or (late and done >= 8 and done % 2 == 0):
            break
        ids = model.encode(text, max_length=args.seq)
        if ids.shape[1] < args.seq:
            continue
        i = counts[0] + counts[1]
        half = i % 2
        order = ("float32", "bfloat16") if i % 2 == 0 else ("bfloat16", "float32")
        jac = {}
        for name in order:
            seconds, jac[name], layer_major[name] = time_prompt(arms[name], ids, sources, target)
            times[name].append(seconds)
        for name in arms:
            for layer in sources:
                sums[name][layer][half] += jac[name][layer].double()
        counts[half] += 1
        per_prompt_rel.append({str(layer): rel(jac["bfloat16"][layer], jac["float32"][layer]) for layer in (0, 10, 20, 28)
                               if layer in sources})
        print(f"prompt {i}: fp32 {times['float32'][-1]:.1f} s, bf16 {times['bfloat16'][-1]:.1f} s", flush=True)
        out["fit_64"] = speed_row(times, flops[args.seq], layer_major, peaks)
        out["per_prompt_rel_diff"] = per_prompt_rel
        save()
        if args.sums:
            torch.save({"sums": sums, "counts": counts, "times": times, "per_prompt_rel": per_prompt_rel,
                        "layer_major": layer_major}, args.sums)
    n = sum(counts)
    out["n_prompts"] = n
    out["half_prompts"] = list(counts)
    lenses = {name: lenses_of(model, sums[name], counts, sources, target) for name in arms}
    shipped = shipped_se()
    rows = []
    for layer in sources:
        full32 = lenses["float32"][0].matrix(layer).double()
        diff = rel(lenses["bfloat16"][0].matrix(layer), full32)
        row = {"layer": layer, "rel_diff": diff}
        if min(counts) > 0:  # the lens's own split-half predicted SE (docs/method.md §3.3)
            even32, odd32 = (h.matrix(layer).double() for h in lenses["float32"][1])
            row["predicted_rel_se"] = float((even32 - odd32).norm() / full32.norm()) * (counts[0] * counts[1]) ** 0.5 / n
        # each half's own bf16 difference (one prompt per half: a prompt's), against the norm of the population's
        # lens (the shipped one's, 100 prompts; a few prompts' mean has a larger norm): the mean of per-prompt
        # differences bounds a lens's difference whatever its prompts (triangle inequality), however they correlate
        norm = shipped.get(("norm", layer)) or float(full32.norm())
        halves = [float((sums["bfloat16"][layer][h] - sums["float32"][layer][h]).norm()) / counts[h] / norm
                  for h in (0, 1) if counts[h]]
        row["half_diff_mean"] = sum(halves) / len(halves)
        row["half_diff_max"] = max(halves)
        if shipped:  # the shipped lens's SE (100 prompts, 128 tokens) at n and at 20 prompts (SE ~ 1/sqrt(n))
            row["shipped_se_at_n"] = shipped[layer] * (shipped["n"] / n) ** 0.5
            row["shipped_se_at_20"] = shipped[layer] * (shipped["n"] / 20) ** 0.5
        se = row.get("predicted_rel_se") or row.get("shipped_se_at_n")
        row["ratio"] = diff / se if se else None
        if shipped:
            row["ratio_worst_case_20"] = row["half_diff_mean"] / row["shipped_se_at_20"]
        rows.append(row)
    out["layers"] = rows
    worst = max(rows, key=lambda r: r["ratio"] or 0)
    out["rule"] = {"bound": 0.2, "worst_layer": worst["layer"], "worst_ratio": worst["ratio"],
                   "passes": all(r["ratio"] is not None and r["ratio"] < 0.2 for r in rows)}
    if shipped:
        worst20 = max(rows, key=lambda r: r["ratio_worst_case_20"])
        out["rule"].update(worst_case_20_layer=worst20["layer"], worst_case_20_ratio=worst20["ratio_worst_case_20"],
                           worst_case_20_passes=all(r["ratio_worst_case_20"] < 0.2 for r in rows))
    measure_peaks()
    save()

    # -- part 3: readings on held-out prose ----------------------------------------------------------------
    out["readings"] = readings(model, lenses, sources, args)
    save()

    # -- part 1 at 128 tokens ------------------------------------------------------------------------------
    interleaved(args, out, arms, sources, 128, flops[128], layer_major, peaks, measure_peaks, save)
    print(json.dumps({k: out[k] for k in ("fit_64", "rule", "readings") if k in out}, indent=1))


def interleaved(args, out: dict, arms: dict, sources: list[int], seq: int, flops: dict, layer_major: dict,
                peaks: dict, measure_peaks, save) -> None:
    """``--reps`` interleaved pairs (fp32 and bf16, the order alternating) on bench/fit_speed.py's prompt at
    ``seq`` tokens, into ``out["fit_<seq>"]`` after each pair."""
    ids = arms["float32"].encode(PROMPT, max_length=seq)
    target = arms["float32"].n_layers - 1
    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for rep in range(args.reps):
        for name in (("float32", "bfloat16") if rep % 2 == 0 else ("bfloat16", "float32")):
            seconds, _, layer_major[name] = time_prompt(arms[name], ids, sources, target)
            times[name].append(seconds)
            print(f"{seq} tokens, rep {rep}: {name} {seconds:.1f} s", flush=True)
        out[f"fit_{seq}"] = speed_row(times, flops, layer_major, peaks)
        measure_peaks()
        save()


def speed_only(args, out: dict, arms: dict, peaks: dict, measure_peaks, save) -> None:
    """Part 1 alone: seconds per prompt in both dtypes, interleaved, on source layers ``--speed-only``..L-2."""
    model = arms["float32"]
    target = model.n_layers - 1
    sources = list(range(args.speed_only, target))
    out["source_layers"] = [sources[0], sources[-1]]
    layer_major: dict = {}
    for seq in (64, 128):
        flops = {lm: backward_flops(model, seq, 16, sources, target, fused=True, layer_major=lm) for lm in (False, True)}
        interleaved(args, out, arms, sources, seq, flops, layer_major, peaks, measure_peaks, save)


def shipped_se() -> dict:
    """``{layer: predicted relative SE}`` of the shipped lens (its split halves), ``"n"`` its prompts and
    ``("norm", layer)`` its matrices' Frobenius norms; {} if none."""
    from jlens_core.lenses.loading import load_lens_file

    path = ROOT / "assets" / "lenses" / "smollm2-135m.safetensors"
    if not path.is_file():
        return {}
    lens = load_lens_file(path)
    if lens.halves() is None:
        return {}
    table = lens.half_diagnostics()
    return {**{int(r.layer): float(r.predicted_rel_se) for r in table.itertuples()}, "n": lens.n_prompts,
            **{("norm", layer): float(lens.matrix(layer).double().norm()) for layer in lens.source_layers}}


def speed_row(times: dict, flops: dict, layer_major: dict, peaks: dict) -> dict:
    row: dict = {}
    for name, values in times.items():
        if not values:
            continue
        median = statistics.median(values)
        gflops = flops[layer_major.get(name, True)] / median / 1e9
        row[name] = {"seconds": [round(v, 2) for v in values], "median_s": round(median, 2),
                     "gflops": round(gflops, 1), "pct_of_peak": round(100 * gflops / max(peaks[name]), 1)}
    pairs = [a / b for a, b in zip(times["float32"], times["bfloat16"])]
    if pairs:
        row["speedup_median_of_pairs"] = round(statistics.median(pairs), 2)
        row["speedup_range"] = [round(min(pairs), 2), round(max(pairs), 2)]
    return row


def lenses_of(model, half_sums: dict, counts: list[int], sources: list[int], target: int):
    """``(lens, (even, odd))`` from the per-half fp64 sums, as the fit makes them (docs/method.md §3.3)."""
    from jlens_core import JacobianLens

    n = sum(counts)
    common = {"target_layer": target, "n_layers": model.n_layers}
    full = JacobianLens({layer: (half_sums[layer].sum(0) / n).float() for layer in sources}, n, model.d_model, **common)
    halves = tuple(JacobianLens({layer: (half_sums[layer][h] / max(counts[h], 1)).float() for layer in sources},
                                counts[h], model.d_model, **common) for h in (0, 1))
    return full, halves


def readings(model, lenses: dict, sources: list[int], args) -> dict:
    """Per layer, over the held-out texts' positions: top-1 agreement and mean KL between the fp32 and bf16
    lenses' distributions, and the same between the fp32 lens's halves."""
    from jlens_core.corpus import load_corpus

    texts = [t for t in load_corpus(split="eval", n=args.heldout * 3)][: args.heldout]
    agree = {layer: [] for layer in sources}
    kl = {layer: [] for layer in sources}
    agree_h = {layer: [] for layer in sources}
    kl_h = {layer: [] for layer in sources}
    full32, full16 = lenses["float32"][0], lenses["bfloat16"][0]
    even, odd = lenses["float32"][1]
    halves = min(even.n_prompts, odd.n_prompts) > 0
    for text in texts:
        ids = model.encode(text, max_length=args.seq)
        with torch.no_grad():
            hs = model.hf_model(input_ids=ids, output_hidden_states=True).hidden_states
        for layer in sources:
            h = hs[layer + 1][0].float()  # the residual after layer `layer`
            with torch.no_grad():
                a = torch.log_softmax(model.unembed(full32.transport(h, layer)).double(), -1)
                b = torch.log_softmax(model.unembed(full16.transport(h, layer)).double(), -1)
                e = torch.log_softmax(model.unembed(even.transport(h, layer)).double(), -1) if halves else a
                o = torch.log_softmax(model.unembed(odd.transport(h, layer)).double(), -1) if halves else a
            agree[layer].append(float((a.argmax(-1) == b.argmax(-1)).double().mean()))
            kl[layer].append(float((a.exp() * (a - b)).sum(-1).mean()))
            agree_h[layer].append(float((e.argmax(-1) == o.argmax(-1)).double().mean()))
            kl_h[layer].append(float((e.exp() * (e - o)).sum(-1).mean()))
    return {"n_texts": len(texts), "layers": [
        {"layer": layer, "top1_agreement": statistics.mean(agree[layer]), "kl_nats": statistics.mean(kl[layer]),
         "halves_top1_agreement": statistics.mean(agree_h[layer]) if halves else None,
         "halves_kl_nats": statistics.mean(kl_h[layer]) if halves else None}
        for layer in sources]}


if __name__ == "__main__":
    main()
