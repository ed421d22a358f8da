"""Write the bf16 benches' figures into the docs from their JSON files (regenerated, not retyped).

    python bench/bf16_tables.py [--print]

Reads ``bench/bf16_fit.json``, ``bench/bf16_fit_speed_all.json`` and ``bench/bf16_fit_speed.json`` (bench/bf16_fit.py,
the last two with ``--speed-only 0`` and ``--speed-only 24``) and ``bench/bf16_readout.json`` (bench/bf16_readout.py) and
replaces the text between ``<!-- bf16_tables:NAME -->`` and ``<!-- /bf16_tables:NAME -->`` in bench/README.md
(``fit``, ``fit_speed``, ``readout``, ``app`` from ``bench/app_latency.json`` and ``stability`` from
``bench/stability_speed.json``), docs/fitting.md
(``fit_decision``) and README.md (``fit_time``: a full-size lens's time from the all-layer speed run at 128 tokens). Each figure names the CPU and its bf16 flags. A
missing marker is an error: nothing is written. ``--print`` prints the blocks instead.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"fit": ROOT / "bench" / "README.md", "fit_speed": ROOT / "bench" / "README.md",
         "readout": ROOT / "bench" / "README.md",
         "fit_decision": ROOT / "docs" / "fitting.md", "fit_time": ROOT / "README.md", "app": ROOT / "bench" / "README.md",
         "stability": ROOT / "bench" / "README.md"}


def cpu_line(data: dict) -> str:
    cpu = data.get("cpu", {})
    flags = ", ".join(cpu.get("flags", [])) or "none"
    return (f"CPU: {cpu.get('model_name', '?')}, {cpu.get('cores', '?')} threads, torch {cpu.get('torch', '?')}; "
            f"flags {flags}; bf16 in hardware: {cpu.get('bf16_flag') or 'no'}. {data.get('conditions', '')}.")


def fit_block(data: dict) -> str:
    peaks = data.get("matmul_peak_gflops", {})
    lines = [cpu_line(data), "", "```",
             "matmul peak (GFLOP/s, best of the run): "
             + ", ".join(f"{k} {v['best']:.1f}" for k, v in peaks.items()),
             f"{'seq':>4} {'dtype':<9} {'s/prompt (median)':>18} {'GFLOP/s':>8} {'% peak':>7}  runs"]
    for key, seq in (("fit_64", data.get("seq", 64)), ("fit_128", 128)):
        row = data.get(key)
        if not row:
            continue
        for name in ("float32", "bfloat16"):
            r = row.get(name)
            if r:
                lines.append(f"{seq:>4} {name:<9} {r['median_s']:>18.2f} {r['gflops']:>8.1f} {r['pct_of_peak']:>6.1f}%  "
                             + " ".join(f"{s:.1f}" for s in r["seconds"]))
        if "speedup_median_of_pairs" in row:
            lo, hi = row["speedup_range"]
            lines.append(f"{seq:>4} bf16 speedup (median of interleaved pairs): {row['speedup_median_of_pairs']:.2f}x "
                         f"(range {lo:.2f}-{hi:.2f})")
    lines += ["```", ""]
    layers = data.get("layers")
    if layers:
        n = data.get("n_prompts")
        lines += [(f"bf16 lens against the fp32 lens of the same {n} prompts ({data.get('seq', 64)} tokens; "
                  f"halves {data.get('half_prompts')}), per layer: relative Frobenius difference, the predicted relative "
                  "SE it is held against (the lens's own split halves when both have prompts, else the shipped lens's "
                  "scaled to these prompts), their ratio (the rule: below 0.2), and the worst case for a 20-prompt lens "
                  "(the mean per-prompt difference, relative to the shipped lens's norm, against its SE at 20 prompts: by the triangle inequality a bound on a 20-prompt lens's difference):"), "",
                  "| layer | rel. diff | SE | ratio | worst case at 20 prompts |", "| ---: | ---: | ---: | ---: | ---: |"]
        for r in layers:
            se = r.get("predicted_rel_se") or r.get("shipped_se_at_n")
            worst = r.get("ratio_worst_case_20")
            lines.append(f"| {r['layer']} | {r['rel_diff']:.2e} | {se:.3f} | {r['ratio']:.3f} | "
                         f"{'' if worst is None else f'{worst:.3f}'} |")
        lines.append("")
    readings = data.get("readings")
    if readings:
        rows = readings["layers"]
        lines += [(f"Readings of {readings['n_texts']} held-out texts through the two lenses (every position): top-1 "
                  "agreement and mean KL(fp32 lens || bf16 lens), next to the same between the fp32 lens's halves "
                  "where it has both (the fit's own sampling noise):"), "",
                  "| layer | top-1 agreement | KL (nats) | halves' top-1 agreement | halves' KL (nats) |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            if r["layer"] % 4 == 0 or r["layer"] == rows[-1]["layer"]:
                ha, hk = r.get("halves_top1_agreement"), r.get("halves_kl_nats")
                lines.append(f"| {r['layer']} | {r['top1_agreement']:.3f} | {r['kl_nats']:.2e} | "
                             f"{'' if ha is None else f'{ha:.3f}'} | {'' if hk is None else f'{hk:.2e}'} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def decision_block(data: dict, speed: dict | None = None) -> str:
    rule = data.get("rule")
    cpu = data.get("cpu", {})
    if not rule:
        return "Not measured yet: run `python bench/bf16_fit.py`, then `python bench/bf16_tables.py`.\n"
    speed_text = ""
    for source, note in ((speed or {}, "source layers {lo}-{hi}"), (data, "all layers")):
        for seq in (128, 64):
            row = source.get(f"fit_{seq}", {})
            pairs = len(row.get("float32", {}).get("seconds", []))
            if row.get("speedup_median_of_pairs") and (pairs >= 2 or source is data):
                lo, hi = source.get("source_layers", ["?", "?"])
                speed_text = (f"bf16 fitted a {seq}-token prompt {row['speedup_median_of_pairs']:.2f}x as fast as fp32 "
                              f"(median of {pairs} interleaved pair{'s' if pairs != 1 else ''}, "
                              f"{note.format(lo=lo, hi=hi)})")
                break
        if speed_text:
            break
    where = (f"On the development host ({cpu.get('model_name', '?')}, bf16 in hardware: "
             f"{cpu.get('bf16_flag') or 'no'}; {data.get('n_prompts')} prompt(s) of {data.get('seq', 64)} tokens, "
             f"a loaded host)")
    n = data.get("n_prompts") or 0
    if n < 8:  # too few prompts to decide: the default stays fp32 (precision.CPU_BF16_DEFAULT)
        verdict = (f"with {n} prompt{'s' if n != 1 else ''} measured (a loaded host: a 64-token fp32 prompt took "
                   f"minutes), fewer than the 8 the decision asks for, fp32 stays the CPU default; on these prompts the "
                   f"bf16 difference was at most {rule['worst_ratio']:.3f} of the predicted SE of a lens of "
                   f"{n} prompt{'s' if n != 1 else ''} (layer {rule['worst_layer']}; the bound is 0.2)")
    elif rule["passes"]:
        verdict = (f"the bf16 lens was within {rule['worst_ratio']:.3f} of its predicted SE at its worst layer "
                   f"({rule['worst_layer']}), below the bound of 0.2 at every layer")
    else:
        verdict = (f"the bf16 lens differed from the fp32 lens by {rule['worst_ratio']:.3f} of the predicted SE at "
                   f"layer {rule['worst_layer']}, {rule['worst_ratio'] / rule['bound']:.1f}x the bound of 0.2: "
                   "bf16 stays off by default (fp32), `--fit-dtype bfloat16` asks for it")
    extra = ""
    if "worst_case_20_ratio" in rule:
        extra = (f" The worst case for a 20-prompt lens (the mean per-prompt difference against the shipped "
                 f"lens's SE at 20 prompts, a bound by the triangle inequality) is {rule['worst_case_20_ratio']:.3f} at layer {rule['worst_case_20_layer']}.")
    return f"{where}, {speed_text}; {verdict}.{extra} The figures: [bench](../bench/README.md#fitting-in-bf16).\n"


def fit_time_block(data: dict, n_prompts: int = 100) -> str:
    """The README's time for a full-size lens (``n_prompts`` prompts of 128 tokens, every layer), from the all-layer
    speed run: each dtype's median seconds per prompt times ``n_prompts``, and the CPU it was measured on."""
    row, cpu = data.get("fit_128") or {}, data.get("cpu", {})
    seconds = {name: row[name]["median_s"] for name in ("bfloat16", "float32") if row.get(name)}
    if not seconds:
        return "about two hours on a 2-core CPU (not measured at 128 tokens yet)"
    first = "bfloat16" if "bfloat16" in seconds else "float32"
    text = f"about {seconds[first] * n_prompts / 3600:.1f} hours in {'bf16' if first == 'bfloat16' else 'fp32'}"
    if first == "bfloat16" and "float32" in seconds:
        text += f" (fp32: {seconds['float32'] * n_prompts / 3600:.1f} hours)"
    per = " / ".join(f"{seconds[n]:.0f} s" for n in ("float32", "bfloat16") if n in seconds)
    return (f"{text} on a {cpu.get('cores', '?')}-thread {cpu.get('model_name', '?')} ({per} a prompt"
            f"{', fp32 / bf16' if len(seconds) == 2 else ''}, `bench/bf16_fit.py --speed-only 0`)")


def app_block(data: dict) -> str:
    """bench/app_latency.py's table: each step's median and range over its runs, and its goal (issue 52's)."""
    cpu = data.get("cpu", {})
    lines = [(f"CPU: {cpu.get('model_name', '?')}, {cpu.get('cores', '?')} threads, flags "
             f"{', '.join(cpu.get('flags', [])) or 'none'}; fp32 matmul peak {data['matmul_peak_gflops']:.0f} GFLOP/s; "
             f"{data.get('launches', 1)} launches of each kind, {data.get('reps', 1)} prompts, band {data.get('band')}."),
             "", "| step | median s (range) | goal s |", "|---|---|---|"]
    for row in data["rows"]:
        each = row["each"]
        spread = f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else ""
        goal = row.get("goal_seconds")
        said = "" if goal is None else f"{goal:g}" + (" **over**" if row["seconds"] > goal else "")
        lines.append(f"| {row['step']} | {row['seconds']:.2f}{spread} | {said} |")
    return "\n".join(lines) + "\n"


def stability_block(data: dict) -> str:
    """bench/stability_speed.py's figures: each arm's median seconds, and a reading with marks against a plain one."""
    lines = [cpu_line(data), "", "```", f"{data['reps']} texts of {data['seq']} tokens, medians:"]
    lines += [f"{name:<32} {seconds:>6.2f} s" for name, seconds in data["median_s"].items()]
    lines += [f"with marks / plain: {data['with_marks_over_plain']:.2f}x", "```"]
    return "\n".join(lines) + "\n"


def readout_block(data: dict) -> str:
    med = data["median_s"]
    lines = [cpu_line(data), "", "```",
             "matmul peak (GFLOP/s): " + ", ".join(f"{k} {v}" for k, v in data["matmul_peak_gflops"].items()),
             (f"{data['rows']} rows (layers x positions), chunks of {data['chunk_rows']} rows, vocabulary {data['vocab']}, "
             f"k = {data['k']}")]
    for name, seconds in med.items():
        lines.append(f"{name:<24} {seconds:>7.2f} s")
    lines += [f"speedup, top k: {data['speedup_top_k']:.2f}x; top k and ranks: {data['speedup_top_k_and_ranks']:.2f}x",
              "re-scored share of the vocabulary (mean per chunk) and chunks that fell back to fp32: "
              + "; ".join(f"{k} {v['rescored_fraction']:.1%}, {v['fallback_chunks']} of {v['chunks']}"
                          for k, v in data["rescoring"].items()),
              f"bit-identical to fp32: {data['bit_identical']}", "```"]
    return "\n".join(lines) + "\n"


def replace(text: str, name: str, block: str) -> str:
    # a block on lines of its own, or inline (the README's sentence: the block without its newline)
    pattern = re.compile(rf"(<!-- bf16_tables:{name} -->\n?).*?(<!-- /bf16_tables:{name} -->)", re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"no <!-- bf16_tables:{name} --> marker pair in the page")
    return pattern.sub(lambda m: m.group(1) + block + m.group(2), text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true")
    args = ap.parse_args()
    blocks = {}
    speeds = [json.loads(path.read_text()) for path in (ROOT / "bench" / "bf16_fit_speed_all.json",
                                                        ROOT / "bench" / "bf16_fit_speed.json") if path.is_file()]
    speed = speeds[-1] if speeds else None
    fit_json = ROOT / "bench" / "bf16_fit.json"
    if fit_json.is_file():
        data = json.loads(fit_json.read_text())
        blocks["fit"], blocks["fit_decision"] = fit_block(data), decision_block(data, speed)
    if speeds and speeds[0].get("source_layers", [0])[0] == 0:
        blocks["fit_time"] = fit_time_block(speeds[0])
    if speeds:
        parts = []
        for data in speeds:
            lo, hi = data.get("source_layers", ["?", "?"])
            parts.append(f"Speed alone (`--speed-only {lo}`), source layers {lo}-{hi}:\n\n" + fit_block(data))
        blocks["fit_speed"] = "\n".join(parts)
    app_json = ROOT / "bench" / "app_latency.json"
    if app_json.is_file():
        blocks["app"] = app_block(json.loads(app_json.read_text()))
    stability_json = ROOT / "bench" / "stability_speed.json"
    if stability_json.is_file():
        blocks["stability"] = stability_block(json.loads(stability_json.read_text()))
    readout_json = ROOT / "bench" / "bf16_readout.json"
    if readout_json.is_file():
        blocks["readout"] = readout_block(json.loads(readout_json.read_text()))
    if args.print:
        for name, block in blocks.items():
            print(f"== {name}\n{block}")
        return
    pages: dict[Path, str] = {}
    for name, block in blocks.items():
        page = PAGES[name]
        pages[page] = replace(pages.get(page, page.read_text(encoding="utf-8")), name, block)
    for page, text in pages.items():
        page.write_text(text, encoding="utf-8")
    print(f"wrote {', '.join(blocks)}", file=sys.stderr)


if __name__ == "__main__":
    main()
