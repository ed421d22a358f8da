"""Add the lenses of one `jlens eval` folder to another's results, so a comparison grows without rerunning
the lenses it already holds (scripts/compare_lenses.sh with ADD_LENSES):

    python scripts/merge_eval.py BASE ADDED

``BASE`` and ``ADDED`` are evaluation folders written by the same commands (``eval.csv``, ``pass_at_k*.csv``,
``word/``, ``swap/``, ``swap_centred/``). For each table both hold, ADDED's rows of every lens BASE lacks are
appended to BASE's (a lens BASE holds keeps BASE's rows: the logit lens and the random control that every
swap run adds, for example); the per-item swap table gains ADDED's new columns, matched by item name.
``eval.json`` is rewritten from the merged tables and ``eval.png`` redrawn. Every lens is scored on the same
items by the same code, and each lens's numbers depend on that lens alone, so a merged folder reads as one run.

Exit status 2 with one sentence when a folder or a table is missing, or the two runs scored different items.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

# tables with one row per lens (and layer, set, k, item ...): merged by the "lens" column
LENS_TABLES = ["eval.csv", "pass_at_k.csv", "pass_at_k_detail.csv", "word/pass_at_k.csv", "word/pass_at_k_detail.csv",
               "decoy/pass_at_k.csv", "decoy/pass_at_k_detail.csv", "swap/swap_success.csv",
               "swap_centred/swap_success.csv"]
ITEM_TABLES = ["swap/swap_items.csv", "swap_centred/swap_items.csv"]
# eval.json's lists and the table each is written from
JSON_LISTS = {"per_layer": "eval.csv", "pass_at_k": "pass_at_k.csv", "swap_success": "swap_success.csv"}


class MergeError(ValueError):
    """The folders cannot be merged (the message says which file and why)."""


def merge_lens_rows(base: pd.DataFrame, added: pd.DataFrame, where: str) -> pd.DataFrame:
    """``base`` with ``added``'s rows of every lens ``base`` lacks appended.

    Raises:
        MergeError: the two tables' columns differ, or the new lenses were scored on other items
            (``pass_at_k_detail.csv``: its ``set, name, role, word`` rows).
    """
    if list(base.columns) != list(added.columns):
        raise MergeError(f"{where}: the columns differ ({sorted(set(base.columns) ^ set(added.columns))}); "
                         "both folders must come from the same jlens eval command.")
    new = added[~added["lens"].isin(set(base["lens"]))]
    if "name" in base.columns and "role" in base.columns:  # per-item detail: the same items, or no pairing
        keys = ["set", "name", "role", "word"]
        lens = base["lens"].iloc[0]
        ours = set(map(tuple, base[base["lens"] == lens][keys].to_numpy()))
        for other in new["lens"].unique():
            theirs = set(map(tuple, new[new["lens"] == other][keys].to_numpy()))
            if theirs != ours:
                raise MergeError(f"{where}: lens {other!r} was scored on {len(theirs)} item words, the base on "
                                 f"{len(ours)} (or other ones): rerun both on the same sets.")
    return pd.concat([base, new], ignore_index=True)


def merge_item_columns(base: pd.DataFrame, added: pd.DataFrame, where: str) -> pd.DataFrame:
    """``base`` with ``added``'s columns that ``base`` lacks, matched row by row on ``name``.

    Raises:
        MergeError: the two tables hold other items.
    """
    if list(base["name"]) != list(added["name"]):
        raise MergeError(f"{where}: the two runs hold other items; rerun both on the same swap set.")
    extra = [column for column in added.columns if column not in base.columns]
    merged = pd.concat([base, added[extra]], axis=1)
    if "set" in merged.columns:  # keep the set name last, as jlens eval writes it
        merged = merged[[c for c in merged.columns if c != "set"] + ["set"]]
    return merged


def merge_folders(base: Path, added: Path) -> list[Path]:
    """Merge ``added`` into ``base`` (in place); returns the files rewritten.

    Raises:
        MergeError: a folder is missing, a table sits in only one of them, or the tables do not match.
    """
    for folder in (base, added):
        if not folder.is_dir():
            raise MergeError(f"{folder} is not a folder: give two jlens eval output folders.")
    written = []
    for rel in LENS_TABLES + ITEM_TABLES:
        ours, theirs = base / rel, added / rel
        if not theirs.is_file():
            continue
        if not ours.is_file():
            raise MergeError(f"{ours} is missing while {theirs} exists: run the base comparison with the same "
                             "steps first.")
        merge = merge_item_columns if rel in ITEM_TABLES else merge_lens_rows
        frame = merge(pd.read_csv(ours), pd.read_csv(theirs), rel)
        frame.to_csv(ours, index=False)
        written.append(ours)
    for sub in ("", "word", "decoy", "swap", "swap_centred"):
        summary = base / sub / "eval.json"
        if not summary.is_file():
            continue
        result = json.loads(summary.read_text(encoding="utf-8"))
        for key, rel in JSON_LISTS.items():
            if key in result and (base / sub / rel).is_file():
                result[key] = pd.read_csv(base / sub / rel).to_dict(orient="records")
        summary.write_text(json.dumps(result, indent=1, default=float), encoding="utf-8")
        written.append(summary)
        if sub == "" and "per_layer" in result:
            from jlens_core.figures.png_plots import plot_eval_curves

            title = f"{result['model']}: {result['n_texts']} texts of {result['corpus']} ({result['split']})"
            written.append(plot_eval_curves(pd.read_csv(base / "eval.csv"), base / "eval.png", title))
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/merge_eval.py BASE ADDED", file=sys.stderr)
        return 2
    try:
        written = merge_folders(Path(argv[0]), Path(argv[1]))
    except MergeError as err:
        print(err, file=sys.stderr)
        return 2
    print("merged into " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
