"""Print the README's tables of the shipped lenses from their evaluation folder (markdown, numbers in bits).

    python scripts/readme_tables.py [assets/lenses/smollm2-135m.eval]
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

LENSES = [("logit", "logit"), ("jacobian", "Jacobian"), ("tuned", "tuned"), ("jacobian (shrink 0.25)", "J shrink 0.25"),
          ("jacobian (shrink 0.5)", "J shrink 0.5")]
MAIN = 3  # logit, Jacobian, tuned: the lenses with a CE column and in the pass@k / swap tables


def per_layer_table(evals: pd.DataFrame, every: int = 4) -> str:
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
    lines.append("")
    lines.append(f"best lens per layer (count, all): {best.to_dict()}; among logit/Jacobian/tuned: "
                 f"{best_main.to_dict()}; raw J worse than logit at layers: {worse}")
    return "\n".join(lines)


def pass_table(passes: pd.DataFrame) -> str:
    lines = ["| set | lens | pass@1 | pass@5 | pass@10 | 95 % interval @10 | items scored | words scored |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
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
            lines.append(f"| {first} | {label} | " + " | ".join(f"{rate.get(k, float('nan')):.2f}" for k in (1, 5, 10))
                         + f" | {ci} | {cover[0]} | {cover[1]} |")
    return "\n".join(lines)


def swap_table(swaps: pd.DataFrame) -> str:
    alphas = sorted(swaps["alpha"].unique())
    lines = ["| directions | " + " | ".join(f"α={a:g}" for a in alphas) + " | best (95 % interval) |",
             "| --- |" + " ---: |" * len(alphas) + " --- |"]
    labels = dict(LENSES[:MAIN]) | {"random": "random (control)"}
    for key in ("jacobian", "tuned", "logit", "random"):
        sub = swaps[swaps["lens"] == key].set_index("alpha")
        if sub.empty:
            continue
        best = sub["rate"].idxmax()
        lines.append(f"| {labels[key]} | " + " | ".join(f"{sub.at[a, 'rate']:.2f}" for a in alphas)
                     + f" | {sub.at[best, 'rate']:.2f} at α={best:g} ({sub.at[best, 'ci_low']:.2f}-"
                       f"{sub.at[best, 'ci_high']:.2f}) |")
    first = swaps.iloc[0]
    lines.append("")
    lines.append(f"items {int(first['items'])}, eligible {int(first['eligible'])}, skipped {int(first['skipped'])}, "
                 f"{float(first['seconds_per_item']):.2f} s per item")
    return "\n".join(lines)


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "assets/lenses/smollm2-135m.eval")
    print(per_layer_table(pd.read_csv(folder / "eval.csv")))
    print()
    print(pass_table(pd.read_csv(folder / "pass_at_k.csv")))
    if (folder / "swap_success.csv").is_file():
        print()
        print(swap_table(pd.read_csv(folder / "swap_success.csv")))


if __name__ == "__main__":
    main()
