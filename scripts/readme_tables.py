"""Write the shipped lenses' tables into docs/results.md from their evaluation folder (markdown, numbers in bits).

    python scripts/readme_tables.py [EVAL_DIR] [--page docs/results.md] [--print]

EVAL_DIR defaults to assets/lenses/smollm2-135m.eval (``eval.csv``, ``pass_at_k.csv``, optional
``pass_at_k_detail.csv`` and ``swap_success.csv``, as ``jlens eval`` writes them; from the detail, the
pass@k table adds pass@10 with the copied intermediates left out, docs/method.md §8). Each table replaces the text between its markers
in the page, ``<!-- readme_tables:NAME -->`` and ``<!-- /readme_tables:NAME -->`` (NAME: ``per_layer``,
``pass_at_k``, ``swap`` (from ``swap/`` and ``swap_centred/``), ``lens_comparison`` (from the ``all`` and
``word/`` detail tables), ``ablation`` (the same on the held-out half of the items, when expert lenses were
evaluated), ``ablation_steps`` (on those items, the J lens to each expert lens one change at a time, each step's
paired difference: where a gain comes from), ``decoys`` (from ``decoy/``: real against decoy intermediates per lens, on the held-out half when a lens has
learned weights), ``across_sets`` (from ``across_sets_<stack>/``: learned weights
on sets they never saw, scripts/expert_weights_across_sets.py), ``across_sets_decoys`` (from
``across_sets_<stack>/decoy/``: the decoy control of the same)); the prose around them is left alone. A missing marker is an error: nothing is
written. ``--print`` prints the tables instead. The one-line summaries under each table (best lens per
layer, swap eligibility) are printed, for writing the prose by hand.
"""
from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

import pandas as pd

DEFAULT_EVAL_DIR = Path("assets/lenses/smollm2-135m.eval")
DEFAULT_PAGE = Path("docs/results.md")

# (key in the evaluation tables, label); the MAIN ones have a CE column and rows in the pass@k / swap tables
MAIN_LENSES = [("logit", "logit"), ("jacobian", "Jacobian"), ("relevance", "R-lens"), ("jacobian++", "J++"),
               ("relevance++", "R++"), ("jacobian-experts", "J-experts (uniform)"),
               ("relevance-experts", "R-experts (uniform)"), ("tuned", "tuned")]
LENSES = MAIN_LENSES + [(f"{key} (shrink {a})", f"{short} shrink {a}") for key, short in
                        (("jacobian", "J"), ("relevance", "R")) for a in ("0.25", "0.5")]
MAIN = len(MAIN_LENSES)
HELDOUT_FRACTION, SPLIT_SEED = 0.5, 0  # jlens weigh's defaults: the split the shipped J++ / R++ weights used


def per_layer_table(evals: pd.DataFrame, every: int = 4) -> tuple[str, str]:
    """The per-layer KL/CE table (every ``every``-th layer, the last source layer, the mean) and a summary line."""
    kl = evals.pivot(index="layer", columns="lens", values="kl_bits")
    ce = evals.pivot(index="layer", columns="lens", values="ce_bits")
    names = [(key, label) for key, label in LENSES if key in kl.columns]
    main = [(key, label) for key, label in names if key in dict(LENSES[:MAIN])]
    head = [f"KL {label}" for _, label in names] + [f"CE {label}" for _, label in main]
    lines = ["| layer | " + " | ".join(head) + " |", "| ---: |" + " ---: |" * len(head)]
    last_source = kl.index.max() - 1  # the last row is the target layer itself, where every lens is exact
    shown = [layer for layer in kl.index if layer % every == 0 and layer < last_source] + [last_source]
    for layer in shown:
        cells = [f"{kl.at[layer, key]:.2f}" for key, _ in names] + [f"{ce.at[layer, key]:.2f}" for key, _ in main]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    means = [f"{kl[key].mean():.2f}" for key, _ in names] + [f"{ce[key].mean():.2f}" for key, _ in main]
    lines.append(f"| mean {kl.index.min()}-{kl.index.max()} | " + " | ".join(means) + " |")
    best = kl[[key for key, _ in names]].drop(index=kl.index.max()).idxmin(axis=1).value_counts()
    best_main = kl[[key for key, _ in main]].drop(index=kl.index.max()).idxmin(axis=1).value_counts()
    worse = [int(layer) for layer in kl.index if kl.at[layer, "jacobian"] > kl.at[layer, "logit"]]
    summary = (f"best lens per layer (count, all): {best.to_dict()}; among logit/Jacobian/tuned: "
               f"{best_main.to_dict()}; raw J worse than logit at layers: {worse}")
    return "\n".join(lines), summary


def excluding_copied(detail: pd.DataFrame, k: int = 10) -> pd.DataFrame:
    """pass@``k`` per set x lens with the copied intermediates left out (``set, lens, pass_rate``), and the
    macro mean over sets, from a ``pass_at_k_detail.csv`` frame."""
    from jlens_core.evaluation.passk import summarize_pass_at_k

    parts = [summarize_pass_at_k(part, k, exclude_copied=True, n_boot=1).assign(set=name)
             for name, part in detail.groupby("set", sort=False)]
    per_set = pd.concat(parts, ignore_index=True)[["set", "lens", "pass_rate"]]
    macro = per_set.groupby("lens", sort=False)["pass_rate"].mean().reset_index().assign(set="macro mean")
    return pd.concat([per_set, macro], ignore_index=True)


def pass_table(passes: pd.DataFrame, excluded: pd.DataFrame | None = None) -> str:
    """The pass@k table: per set x lens, pass@1/5/10, the interval at k=10, the copied intermediates and
    pass@10 without them (with ``excluded``, from :func:`excluding_copied`), coverage; headed by the readout."""
    vocab = ", ".join(sorted(set(passes["vocab"].dropna()))) if "vocab" in passes else "all"
    head = "| set | lens | pass@1 | pass@5 | pass@10 | 95 % interval @10 |"
    rule = "| --- | --- | ---: | ---: | ---: | --- |"
    if excluded is not None:
        head += " copied | pass@10 without copied |"
        rule += " ---: | ---: |"
    lines = [f"Readout: `vocab={vocab}`.", "", head + " items scored | words scored |", rule + " ---: | ---: |"]
    for name in passes["set"].unique():
        rows = passes[passes["set"] == name]
        for key, label in LENSES[:MAIN]:
            sub = rows[rows["lens"] == key].set_index("k")
            if sub.empty:
                continue
            rate = sub["pass_rate"]
            first = name if key == "logit" else ""
            ci = f"{sub.at[10, 'ci_low']:.2f}-{sub.at[10, 'ci_high']:.2f}" if 10 in sub.index and "ci_low" in sub and \
                name != "macro mean" else ""
            cover = (f"{int(sub['items_scored'].iloc[0])}/{int(sub['n_items'].iloc[0])}",
                     f"{int(sub['words_scored'].iloc[0])}/{int(sub['n_words'].iloc[0])}") if key == "logit" else ("", "")
            copied = ""
            if excluded is not None:
                hit = excluded[(excluded["set"] == name) & (excluded["lens"] == key)]["pass_rate"]
                n_copied = f"{int(sub['copied'].iloc[0])}" if key == "logit" and "copied" in sub else ""
                copied = f" {n_copied} | {hit.iloc[0]:.2f} |" if len(hit) else f" {n_copied} |  |"
            lines.append(f"| {first} | {label} | " + " | ".join(f"{rate.get(k, float('nan')):.2f}" for k in (1, 5, 10))
                         + f" | {ci} |{copied} {cover[0]} | {cover[1]} |")
    return "\n".join(lines)


def _swap_label(key: str) -> str:
    """A swap arm's row label: a lens, ``random (control)`` or ``norm-matched token (control, <lens>)``."""
    labels = dict(LENSES)
    if key == "random":
        return "random directions (control)"
    if key.startswith("norm-matched"):
        lens = key[len("norm-matched"):].strip(" ()")
        return f"norm-matched token (control{', ' + labels.get(lens, lens) if lens else ''})"
    return labels.get(key, key)


def swap_table(swaps: pd.DataFrame | dict[str, pd.DataFrame]) -> tuple[str, str]:
    """The swap-success table (per lens x directions x alpha, best alpha with its interval) and a summary line.

    ``swaps`` is one ``swap_success.csv`` frame or ``{"raw": frame, "centred": frame}``."""
    runs = swaps if isinstance(swaps, dict) else {"raw": swaps}
    first_run = next(iter(runs.values()))
    alphas = sorted(first_run["alpha"].unique())
    # runs since issue #31 hold Clopper-Pearson in ci_low/ci_high and Wilson beside it; older ones Wilson only
    interval = "Clopper-Pearson" if "wilson_low" in first_run else "Wilson"
    lines = ["| directions | arm | " + " | ".join(f"α={a:g}" for a in alphas) + f" | best (95 % {interval}) |",
             "| --- | --- |" + " ---: |" * len(alphas) + " --- |"]
    order = [key for key, _ in MAIN_LENSES]

    def arm_order(arm: str) -> tuple[bool, bool, int]:  # lenses, the random control, norm-matched ones; by lens
        lens = arm.split("(")[-1].strip(") ")
        return arm.startswith("random"), arm.startswith("norm-matched"), order.index(lens) if lens in order \
            else len(order)

    for mode, frame in runs.items():
        arms = sorted(dict.fromkeys(frame["lens"]), key=arm_order)
        for i, key in enumerate(arms):
            sub = frame[frame["lens"] == key].set_index("alpha")
            if sub.empty or sub["rate"].isna().all():
                continue
            best = sub["rate"].idxmax()
            lines.append(f"| {mode if i == 0 else ''} | {_swap_label(key)} | "
                         + " | ".join(f"{sub.at[a, 'rate']:.2f}" for a in alphas)
                         + f" | {sub.at[best, 'rate']:.2f} at α={best:g} ({sub.at[best, 'ci_low']:.2f}-"
                           f"{sub.at[best, 'ci_high']:.2f}) |")
    row = first_run.iloc[0]
    summary = (f"items {int(row['items'])}, eligible {int(row['eligible'])}, skipped {int(row['skipped'])}, "
               f"{float(row['seconds_per_item']):.2f} s per item"
               + (f", unmatched {int(row['unmatched'])}" if "unmatched" in row else ""))
    return "\n".join(lines), summary


def _estimate(row, digits: int = 2) -> str:
    """``macro (ci_low-ci_high)``: a macro pass@k and its interval, the interval to ``digits`` decimals."""
    return f"{row['macro']:.3f} ({row['ci_low']:.{digits}f}-{row['ci_high']:.{digits}f})"


def _difference(row) -> str:
    """``diff (diff_low to diff_high)``: a paired difference and its interval."""
    return f"{row['diff']:+.3f} ({row['diff_low']:+.3f} to {row['diff_high']:+.3f})"


def comparison_table(detail: pd.DataFrame, *, keep=None, n_boot: int = 2000) -> tuple[str, str]:
    """Macro pass@k per lens x readout with paired intervals against the J lens (``all`` readout), the
    copied intermediates left out at k=10 beside it (jlens_core.evaluation.lens_comparison), and a summary."""
    from jlens_core.evaluation.lens_comparison import macro_comparison

    table = macro_comparison(detail, (1, 5, 10), keep=keep, n_boot=n_boot)
    clean = macro_comparison(detail, 10, keep=keep, exclude_copied=True, n_boot=n_boot).set_index(["lens", "vocab"])
    at = table.set_index(["lens", "vocab", "k"])
    lines = [("| lens | readout | pass@1 (95 %) | pass@5 (95 %) | pass@10 (95 %) | Δ@10 vs J (95 %, paired) | ratio @10 | "
             "verdict | pass@10 without copied |"),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    labels = dict(LENSES)
    variants = list(dict.fromkeys(zip(table["lens"], table["vocab"])))
    variants.sort(key=lambda v: ([key for key, _ in LENSES].index(v[0]) if v[0] in labels else len(LENSES), v[1]))
    for lens, vocab in variants:
        r10 = at.loc[(lens, vocab, 10)]
        r1, r5 = at.loc[(lens, vocab, 1)], at.loc[(lens, vocab, 5)]
        lines.append(f"| {labels.get(lens, lens)} | {vocab} | {_estimate(r1)} | {_estimate(r5)} | {_estimate(r10, 3)} | "
                     f"{_difference(r10)} | {r10['ratio']:.2f} | {r10['verdict']} | "
                     f"{clean.loc[(lens, vocab), 'macro']:.3f} |")
    first = table.iloc[0]
    summary = (f"comparison: {int(first['n_sets'])} sets, {int(first['items_scored'])} items, "
               f"{int(first['words_scored'])} words; baseline {first['baseline']}")
    return "\n".join(lines), summary


# The ablation's paths from the J lens to each expert lens, one change a step (variant, what the step adds):
# the difference of each step is paired on the same held-out items, so the gain splits into its parts.
ABLATION_PATHS = [
    [(("jacobian", "all"), "J lens (baseline)"), (("jacobian-experts", "all"), "experts, uniform weights"),
     (("jacobian++", "all"), "learned weights"), (("jacobian++", "word"), "word readout")],
    [(("jacobian", "all"), "J lens (baseline)"), (("relevance", "all"), "relevance rules"),
     (("relevance-experts", "all"), "experts, uniform weights"), (("relevance++", "all"), "learned weights"),
     (("relevance++", "word"), "word readout")],
]


def ablation_steps_table(detail: pd.DataFrame, *, keep=None, n_boot: int = 2000) -> str:
    """Each :data:`ABLATION_PATHS` step's change in macro pass@10 against the step before it (a paired
    bootstrap on the same items, ``keep``), and the path's total against the J lens: where a gain comes from.
    Paths whose lenses are not all in ``detail`` are left out."""
    from jlens_core.evaluation.lens_comparison import macro_comparison

    present = set(zip(detail["lens"], detail["vocab"]))
    lines = ["| path | step adds | lens | readout | pass@10 | Δ@10 vs the step before (95 %, paired) | verdict |",
             "| --- | --- | --- | --- | ---: | ---: | --- |"]
    labels = dict(LENSES)
    for path in ABLATION_PATHS:
        if not all(variant in present for variant, _ in path):
            continue
        end = labels.get(path[-1][0][0], path[-1][0][0])
        for (before, _), (variant, adds) in itertools.pairwise(path):
            table = macro_comparison(detail, 10, keep=keep, baseline=before, n_boot=n_boot)
            row = table.set_index(["lens", "vocab"]).loc[variant]
            lines.append(f"| to {end} | {adds} | {labels.get(variant[0], variant[0])} | {variant[1]} | "
                         f"{row['macro']:.3f} | {_difference(row)} | {row['verdict']} |")
        total = macro_comparison(detail, 10, keep=keep, n_boot=n_boot).set_index(["lens", "vocab"]).loc[path[-1][0]]
        lines.append(f"| to {end} | **all steps** | {end} | {path[-1][0][1]} | {total['macro']:.3f} | "
                     f"{_difference(total)} vs the J lens | {total['verdict']} |")
    return "\n".join(lines)


def decoy_table(real: pd.DataFrame, decoy: pd.DataFrame, *, keep=None, n_boot: int = 2000) -> str:
    """Per lens (``all`` readout): macro pass@10 of the real intermediates and of the decoys (another item's
    intermediates at the same prompt, docs/method.md §8), real - decoy with a paired interval (how much of a
    lens's score is reading the step rather than favouring its kind of word) and that gap's difference to the J
    lens's gap, paired on the same items (jlens_core.evaluation.lens_comparison.gap_comparison)."""
    from jlens_core.evaluation.lens_comparison import gap_comparison

    labels = dict(LENSES)
    lines = ["| lens | pass@10 real | pass@10 decoys | real − decoys (95 %, paired) | gap − the J lens's gap (95 %, paired) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    order = [key for key, _ in LENSES]
    in_both = [lens for lens in dict.fromkeys(real["lens"]) if lens in set(decoy["lens"])]
    baseline = "jacobian" if "jacobian" in in_both else in_both[0]
    gaps = gap_comparison(real, decoy, 10, baseline=baseline, keep=keep, n_boot=n_boot).set_index("lens")
    for lens in sorted(gaps.index, key=lambda x: (order.index(x) if x in order else len(order), x)):
        row = gaps.loc[lens]
        versus = ("baseline" if row["verdict"] == "baseline" else "" if baseline != "jacobian" else
                  f"{row['gap_diff']:+.3f} ({row['gap_diff_low']:+.3f} to {row['gap_diff_high']:+.3f})")
        lines.append(f"| {labels.get(lens, lens)} | {row['real']:.3f} | {row['decoy']:.3f} | {row['gap']:+.3f} "
                     f"({row['gap_low']:+.3f} to {row['gap_high']:+.3f}) | {versus} |")
    return "\n".join(lines)


def across_sets_table(details: dict[str, pd.DataFrame], *, n_boot: int = 2000) -> str:
    """Per stack (``across_sets_<stack>/``, scripts/expert_weights_across_sets.py): macro pass@1/5/10 of the J
    lens, the stack's pooled lens, its uniform weights and its weights learned on the *other* sets, with the
    paired comparison against the J lens (every set read by weights that never saw it)."""
    from jlens_core.evaluation.lens_comparison import macro_comparison

    lines = [("| experts | lens | pass@1 (95 %) | pass@5 (95 %) | pass@10 (95 %) | Δ@10 vs J (95 %, paired) | "
              "ratio @10 | verdict |"), "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for stack, detail in details.items():
        at = macro_comparison(detail, (1, 5, 10), n_boot=n_boot).set_index(["lens", "vocab", "k"])
        for lens in dict.fromkeys(detail["lens"]):
            r1, r5, r10 = (at.loc[(lens, "all", k)] for k in (1, 5, 10))
            lines.append(f"| {stack} | {lens} | {_estimate(r1)} | {_estimate(r5)} | {_estimate(r10, 3)} | "
                         f"{_difference(r10)} | {r10['ratio']:.2f} | {r10['verdict']} |")
    return "\n".join(lines)


def across_sets_decoy_table(reals: dict[str, pd.DataFrame], decoys: dict[str, pd.DataFrame], *,
                            n_boot: int = 2000) -> str:
    """Per stack: the decoy control of the across-sets comparison (``across_sets_<stack>/decoy/``): macro pass@10 on
    the real intermediates and on the decoys, the gap, and the gap minus the J lens's gap, paired
    (jlens_core.evaluation.lens_comparison.gap_comparison)."""
    from jlens_core.evaluation.lens_comparison import gap_comparison

    lines = [("| experts | lens | pass@10 real | pass@10 decoys | real − decoys (95 %, paired) | "
             "gap − the J lens's gap (95 %, paired) | verdict |"), "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for stack, real in reals.items():
        gaps = gap_comparison(real, decoys[stack], 10, n_boot=n_boot)
        order = list(dict.fromkeys(real["lens"]))
        for row in sorted(gaps.itertuples(), key=lambda r: order.index(r.lens)):
            versus = ("baseline" if row.verdict == "baseline" else
                      f"{row.gap_diff:+.3f} ({row.gap_diff_low:+.3f} to {row.gap_diff_high:+.3f})")
            lines.append(f"| {stack} | {row.lens} | {row.real:.3f} | {row.decoy:.3f} | {row.gap:+.3f} "
                         f"({row.gap_low:+.3f} to {row.gap_high:+.3f}) | {versus} | {row.verdict} |")
    return "\n".join(lines)


def weights_heldout(detail: pd.DataFrame):
    """The items of ``detail``'s sets that the shipped weights never saw (the weigh split's held-out half): learned
    weights are scored on these only."""
    from jlens_core.evaluation.lens_comparison import heldout_items

    return heldout_items(sorted(detail["set"].unique()), HELDOUT_FRACTION, seed=SPLIT_SEED)


def tables(folder: Path) -> tuple[dict[str, str], list[str]]:
    """The tables by marker name, and their summary lines, from an evaluation folder.

    Raises:
        FileNotFoundError: ``eval.csv`` or ``pass_at_k.csv`` is missing from ``folder``.
    """
    per_layer, layer_summary = per_layer_table(pd.read_csv(folder / "eval.csv"))
    detail_path = folder / "pass_at_k_detail.csv"
    excluded = excluding_copied(pd.read_csv(detail_path)) if detail_path.is_file() else None
    found = {"per_layer": per_layer, "pass_at_k": pass_table(pd.read_csv(folder / "pass_at_k.csv"), excluded)}
    summaries = [layer_summary]
    swap_runs = {mode: pd.read_csv(folder / sub / "swap_success.csv")
                 for mode, sub in (("raw", "swap"), ("centred", "swap_centred"))
                 if (folder / sub / "swap_success.csv").is_file()}
    if not swap_runs and (folder / "swap_success.csv").is_file():  # an older layout: one raw run beside eval.csv
        swap_runs = {"raw": pd.read_csv(folder / "swap_success.csv")}
    if swap_runs:
        found["swap"], swap_summary = swap_table(swap_runs)
        summaries.append(swap_summary)
    word = folder / "word" / "pass_at_k_detail.csv"
    if detail_path.is_file() and word.is_file():
        detail = pd.concat([pd.read_csv(detail_path), pd.read_csv(word)], ignore_index=True)
        found["lens_comparison"], comparison_summary = comparison_table(detail)
        summaries.append(comparison_summary)
        if detail["lens"].str.contains(r"\+\+|experts", regex=True).any():
            held = weights_heldout(detail)
            found["ablation"], ablation_summary = comparison_table(detail, keep=held)
            summaries.append("held-out " + ablation_summary)
            found["ablation_steps"] = ablation_steps_table(detail, keep=held)
    decoy_path = folder / "decoy" / "pass_at_k_detail.csv"
    if detail_path.is_file() and decoy_path.is_file():
        real = pd.read_csv(detail_path)
        held = weights_heldout(real) if real["lens"].str.contains(r"\+\+", regex=True).any() else None
        found["decoys"] = decoy_table(real, pd.read_csv(decoy_path), keep=held)
    across = {sub.name.removeprefix("across_sets_"): pd.read_csv(sub / "pass_at_k_detail.csv")
              for sub in sorted(folder.glob("across_sets_*")) if (sub / "pass_at_k_detail.csv").is_file()}
    if across:
        found["across_sets"] = across_sets_table(across)
        across_decoys = {stack: pd.read_csv(folder / f"across_sets_{stack}" / "decoy" / "pass_at_k_detail.csv")
                         for stack in across if (folder / f"across_sets_{stack}" / "decoy" / "pass_at_k_detail.csv").is_file()}
        if across_decoys:
            found["across_sets_decoys"] = across_sets_decoy_table({s: across[s] for s in across_decoys}, across_decoys)
    return found, summaries


def replace_between_markers(text: str, name: str, body: str) -> str:
    """``text`` with the lines between ``<!-- readme_tables:NAME -->`` and its closing marker set to ``body``.

    Raises:
        ValueError: the page lacks the pair of markers (or holds it twice): add them where the table goes.
    """
    # the lines between may be none (a new pair of markers)
    pattern = re.compile(rf"(<!-- readme_tables:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /readme_tables:{re.escape(name)} -->)",
                         re.DOTALL)
    matches = pattern.findall(text)
    if len(matches) != 1:
        raise ValueError(f"The page has {len(matches)} pairs of markers for table {name!r}; it needs exactly one: "
                         f"put <!-- readme_tables:{name} --> and <!-- /readme_tables:{name} --> where the table goes.")
    return pattern.sub(lambda m: m.group(1) + body.strip("\n") + "\n" + m.group(2), text)


def write_tables(page: Path, found: dict[str, str]) -> None:
    """Replace every table of ``found`` in ``page``; the page is left untouched if any marker is missing."""
    text = page.read_text(encoding="utf-8")
    for name, body in found.items():
        text = replace_between_markers(text, name, body)
    page.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=DEFAULT_EVAL_DIR, help="evaluation folder")
    parser.add_argument("--page", type=Path, default=DEFAULT_PAGE, help="markdown page with the markers")
    parser.add_argument("--print", action="store_true", help="print the tables instead of writing the page")
    args = parser.parse_args(argv)
    found, summaries = tables(args.folder)
    if args.print:
        print("\n\n".join(found.values()))
    else:
        try:
            write_tables(args.page, found)
        except ValueError as exc:
            print(f"readme_tables: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {', '.join(found)} into {args.page}")
    print("\n".join(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
