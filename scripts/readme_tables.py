"""Print the README's tables of the shipped lens from its evaluation folder (markdown, numbers in bits).

    python scripts/readme_tables.py [assets/lenses/smollm2-135m.eval]
"""
from __future__ import annotations

import sys

import pandas as pd

LENSES = [("logit", "logit"), ("jacobian", "Jacobian"), ("jacobian (shrink 0.25)", "J shrink 0.25"),
          ("jacobian (shrink 0.5)", "J shrink 0.5")]


def per_layer_table(evals: pd.DataFrame, every: int = 4) -> str:
    kl = evals.pivot(index="layer", columns="lens", values="kl_bits")
    ce = evals.pivot(index="layer", columns="lens", values="ce_bits")
    names = [(key, label) for key, label in LENSES if key in kl.columns]
    head = [f"KL {label}" for _, label in names] + [f"CE {label}" for _, label in names[:3]]
    lines = ["| layer | " + " | ".join(head) + " |", "| ---: |" + " ---: |" * len(head)]
    last_source = kl.index.max() - 1  # the last row is the target layer itself, where every lens is exact
    shown = [layer for layer in kl.index if layer % every == 0 and layer < last_source] + [last_source]
    for layer in shown:
        cells = [f"{kl.at[layer, key]:.2f}" for key, _ in names] + [f"{ce.at[layer, key]:.2f}" for key, _ in names[:3]]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    means = [f"{kl[key].mean():.2f}" for key, _ in names] + [""] * len(names[:3])
    lines.append(f"| mean {kl.index.min()}-{kl.index.max()} | " + " | ".join(means) + " |")
    best = kl[[key for key, _ in names]].drop(index=kl.index.max()).idxmin(axis=1).value_counts()
    worse = [int(layer) for layer in kl.index if kl.at[layer, "jacobian"] > kl.at[layer, "logit"]]
    lines.append("")
    lines.append(f"best lens per layer (count): {best.to_dict()}; raw J worse than logit at layers: {worse}")
    return "\n".join(lines)


def pass_table(passes: pd.DataFrame) -> str:
    lines = ["| set | lens | pass@1 | pass@5 | pass@10 |", "| --- | --- | ---: | ---: | ---: |"]
    for name in passes["set"].unique():
        rows = passes[passes["set"] == name]
        for key, label in LENSES[:2]:
            sub = rows[rows["lens"] == key].set_index("k")["pass_rate"]
            first = f"{name} ({int(rows['n_items'].iloc[0])})" if key == "logit" else name
            lines.append(f"| {first} | {label} | " + " | ".join(f"{sub.get(k, float('nan')):.2f}" for k in (1, 5, 10)) + " |")
    return "\n".join(lines)


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else "assets/lenses/smollm2-135m.eval"
    print(per_layer_table(pd.read_csv(f"{folder}/eval.csv")))
    print()
    print(pass_table(pd.read_csv(f"{folder}/pass_at_k.csv")))


if __name__ == "__main__":
    main()
