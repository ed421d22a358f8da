"""For every item, lens and concept: the rank at every layer at the readout position, the first layer in the top k
and the band per lens (docs/method.md §8.1). Writes table.csv, items.csv, by_layer.csv, summary.csv,
comparisons.csv, summary.json and study.json to --out.

``jlens study``: where each item's concepts enter every lens's top k, over item sets. The first paragraph above is
the command's ``--help`` description (:func:`~jlens_core.cli.main.command_description`).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import sys
import time
from pathlib import Path

from .._atomic import atomic_write_text
from .common import advance, parse_readout, progress_bar, resolve_lenses, vocab_choices, write_csv
from .main import CLIError, command_description, say
from .model_args import add_model_command, model_loading_options


def _default_lenses(model) -> list[str]:
    """logit, the shipped J lens and the shipped tuned lens, those the model has (their files are read once, by
    ``resolve_lenses``)."""
    from ..lenses.shipped import shipped_lens_path, shipped_tuned_lens_path

    specs = ["logit"]
    if shipped_lens_path(model.name) is not None:
        specs.append("default")
    if shipped_tuned_lens_path(model.name) is not None:
        specs.append("tuned")
    return specs


def cmd_study(args: argparse.Namespace) -> int:
    from ..evaluation.study import study, study_sets
    from ..models.loading import load_model

    if args.k < 1:
        raise CLIError(f"--k {args.k} must be >= 1 (ranks are 1-based: --k 1 is top-1).")
    specs = [*(args.set or []), *(args.items or [])]
    if not specs:
        raise CLIError("Give the items: --set NAME (a shipped set, e.g. two_hop) or --items FILE (.json / .jsonl).")
    sets: dict[str, list] = {}
    for spec in specs:  # bad files fail before the model loads
        for name, items in study_sets(spec).items():
            if name in sets:
                raise CLIError(f"Two sets are named {name!r}: rename one of the files.")
            sets[name] = items
    readout = parse_readout(args.readout)
    out = Path(args.out)
    model = load_model(args.model, **model_loading_options(args), progress=say)
    lenses = resolve_lenses(args.lens or _default_lenses(model), model)
    n_items = sum(len(items) for items in sets.values())
    bar = progress_bar(n_items, "study", args.no_progress, unit="item")
    started = time.perf_counter()
    result = study(model, lenses, sets, k=args.k, answered_only=False if args.no_filter else None,
                   all_positions=args.all_positions, readout=readout, vocab=args.vocab, role=args.role,
                   n_boot=args.n_boot, seed=args.seed,
                   progress=functools.partial(advance, bar) if bar else None)
    if bar:
        bar.close()
    seconds = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    comparisons = result.comparisons()
    write_csv(result.table, out / "table.csv", quoting=csv.QUOTE_NONNUMERIC)
    write_csv(result.items, out / "items.csv", quoting=csv.QUOTE_NONNUMERIC)
    write_csv(result.by_layer, out / "by_layer.csv", quoting=csv.QUOTE_NONNUMERIC)
    write_csv(result.summary, out / "summary.csv", quoting=csv.QUOTE_NONNUMERIC)
    write_csv(comparisons, out / "comparisons.csv", quoting=csv.QUOTE_NONNUMERIC)
    result.save(out / "study.json")
    written = [out / name for name in ("table.csv", "items.csv", "by_layer.csv", "summary.csv", "comparisons.csv",
                                       "study.json")]
    if args.html:
        written.append(Path(args.html))
        result.to_html(args.html)
    atomic_write_text(out / "summary.json", json.dumps({"info": result.info,
                                                        "summary": result.summary.to_dict(orient="records"),
                                                        "comparisons": comparisons.to_dict(orient="records")},
                                                       indent=1, default=str), shared=True)
    columns = ["set", "lens", "kept", "dropped", "units", "unscored", "ever", "peak", "onset", "onset_low",
               "onset_high", "end", "end_low", "end_high"]
    print(f"study · k={args.k} · capability filter {'off' if args.no_filter else 'on where items carry answers'}")
    print(result.summary[columns].to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    if not comparisons.empty:
        print("\nonset against the baseline, paired over items (layers; 95 % bootstrap interval)")
        print(comparisons[["set", "lens", "baseline", "onset", "onset_baseline", "onset_diff", "onset_diff_low",
                           "onset_diff_high", "verdict"]].to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    for note in result.notes:
        print(f"note: {note}")
    print(f"\n{n_items} items x {len(lenses)} lenses in {seconds:.1f} s ({n_items / seconds:.1f} items/s, one "
          f"forward per item)", file=sys.stderr)
    print("Wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def register(subparsers) -> None:
    s = add_model_command(subparsers, "study", help="where concepts enter each lens's top k, over item sets",
                          description=command_description(__doc__))
    s.add_argument("--set", action="append", default=None, metavar="NAME",
                   help="a shipped item set (two_hop, antonym_chain, ...); repeatable")
    s.add_argument("--items", action="append", default=None, metavar="FILE",
                   help="a .json set ({\"items\": [...]}) or a .jsonl file of items (prompt, intermediates, optional "
                        "target / answer); repeatable")
    s.add_argument("--lens", action="append", default=None,
                   help="'logit', 'default' (the shipped J lens), 'tuned' (the shipped tuned lens) or a lens file; "
                        "repeat (default: logit, default and tuned, those the model has)")
    s.add_argument("--k", type=int, default=10, help="the top-k cut-off (default 10)")
    s.add_argument("--no-filter", action="store_true",
                   help="study every item, not only those the model answers (greedy next token = the answer's "
                        "first token)")
    s.add_argument("--all-positions", action="store_true",
                   help="also keep every concept's rank at every position of the prompt (table.csv)")
    s.add_argument("--role", choices=["intermediate", "target", "both"], default="intermediate",
                   help="the concepts studied (default: the intermediates)")
    s.add_argument("--readout", default=None,
                   help="readout for every item: last, last_newline, a token position, or before:TEXT "
                        "(default: each set's own)")
    s.add_argument("--vocab", choices=vocab_choices(), default="all",
                   help="ranks over every token (default) or word tokens only")
    s.add_argument("--n-boot", type=int, default=1000, help="bootstrap replicates of the intervals (default 1000)")
    s.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    s.add_argument("--out", required=True, help="folder for the tables and study.json")
    s.add_argument("--html", default=None, metavar="PAGE", help="also write a self-contained HTML page")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_study)
