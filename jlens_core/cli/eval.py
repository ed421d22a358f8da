"""``jlens eval``: per-layer KL / cross-entropy curves, pass@k and swap success (``jlens inspect``: cli/inspect.py)."""

from __future__ import annotations

import argparse
import csv
import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._atomic import atomic_write_text
from .common import advance, parse_readout, progress_bar, resolve_lenses, vocab_choices, write_csv
from .main import CLIError, say
from .model_args import LENS_HELP, add_corpus_arguments, add_model_command, model_loading_options

if TYPE_CHECKING:  # the CLI imports torch only when a command runs
    import pandas as pd

    from ..lenses.protocol import Lens
    from ..models.model import LensModel


def _plot(frame, out: Path, title: str) -> Path | None:
    from ..figures.png_plots import plot_eval_curves

    try:
        return plot_eval_curves(frame, out, title)
    except ImportError:
        return None


def _run_per_layer(model: LensModel, lenses: dict[str, Lens], texts: list[str], args: argparse.Namespace,
                   out: Path) -> pd.DataFrame:
    """Per-layer KL / cross-entropy of every lens on ``texts``, written to ``eval.csv``."""
    from ..evaluation.by_layer import evaluate

    bar = progress_bar(len(texts) * len(lenses), "eval", args.no_progress)
    frame = evaluate(model, lenses, texts, max_seq_len=args.max_seq_len,
                     progress=(lambda done, total: advance(bar, done, total)) if bar else None)
    if bar:
        bar.close()
    write_csv(frame, out / "eval.csv")
    return frame


def _run_pass_at_k(model: LensModel, lenses: dict[str, Lens], eval_sets: list[tuple[str, list]], readout,
                   args: argparse.Namespace, out: Path) -> pd.DataFrame:
    """pass@k per evaluation set (with their macro mean when several), written to ``pass_at_k.csv``;
    the per-item detail to ``pass_at_k_detail.csv``."""
    from ..evaluation.passk import pass_at_k_sets

    bars: dict[str, Any] = {}

    def progress(name: str, done: int, total: int) -> None:
        if done == 0:
            bars[name] = progress_bar(total, f"pass@k {name}", args.no_progress, unit="item")
        elif bars.get(name):
            advance(bars[name], done, total)
        if done == total and bars.get(name):
            bars[name].close()

    passes, details = pass_at_k_sets(model, lenses, [(Path(name).stem, items) for name, items in eval_sets],
                                     progress=progress, k=tuple(args.k), readout=readout, spelling=args.spelling,
                                     vocab=args.vocab, exclude_copied=args.exclude_copied,
                                     stability=getattr(args, "stability", False))
    write_csv(passes, out / "pass_at_k.csv")
    write_csv(details, out / "pass_at_k_detail.csv", quoting=csv.QUOTE_NONNUMERIC)
    return passes


def _run_swaps(model: LensModel, lenses: dict[str, Lens], swap_sets: list[tuple[str, list[dict]]],
               args: argparse.Namespace, out: Path) -> pd.DataFrame:
    """Swap success per swap set, written to ``swap_success.csv``; the per-item rows to ``swap_items.csv``."""
    import pandas as pd

    from ..interventions.swap_success import swap_success

    summaries, item_tables = [], []
    for name, items in swap_sets:
        bar = progress_bar(len(items), f"swap {Path(name).stem}", args.no_progress, unit="item")
        report = swap_success(model, lenses, items, alphas=tuple(args.alpha), centred=args.centred,
                              seed=args.swap_seed, controls=args.swap_controls,
                              progress=functools.partial(advance, bar) if bar else None)
        if bar:
            bar.close()
        summaries.append(report.summary.assign(set=Path(name).stem, items=report.n_items,
                                               skipped=report.n_skipped, unmatched=report.n_unmatched,
                                               centred=report.centred, seed=report.seed,
                                               seconds_per_item=round(report.seconds_per_item, 3)))
        item_tables.append(report.items.assign(set=Path(name).stem))
    swaps = pd.concat(summaries, ignore_index=True)
    write_csv(swaps, out / "swap_success.csv")
    # tokens may hold a bare carriage return, which pandas leaves unquoted unless asked
    write_csv(pd.concat(item_tables, ignore_index=True), out / "swap_items.csv", quoting=csv.QUOTE_NONNUMERIC)
    return swaps


def _print_tables(frame: pd.DataFrame | None, passes: pd.DataFrame | None, swaps: pd.DataFrame | None,
                  args: argparse.Namespace) -> None:
    """The per-layer, pass@k and swap-success tables on stdout (those that ran)."""
    if frame is not None:
        print(frame.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if passes is not None:
        excluded = "copied intermediates excluded" if args.exclude_copied else "copied intermediates counted"
        print(f"\npass@k · readout vocab={args.vocab} · {excluded}")
        print(passes.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if swaps is not None:
        print(f"\nswap success · {'centred' if args.centred else 'raw'} read directions · 95 % intervals: "
              f"ci = Clopper-Pearson, wilson = Wilson · controls seeded with {args.swap_seed} · unmatched: "
              "eligible items with no norm-matched token within 10 %")
        print(swaps.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def cmd_eval(args: argparse.Namespace) -> int:
    from ..corpus import load_corpus
    from ..evaluation.passk import decoy_items, load_eval_set
    from ..interventions.swap_success import load_swap_set
    from ..models.loading import load_model

    readout = parse_readout(args.readout)
    eval_sets = [(name, load_eval_set(name)) for name in args.pass_at_k or []]  # bad files fail before loading
    if args.decoys:
        eval_sets = [(name, decoy_items(items)) for name, items in eval_sets]
        empty = [name for name, items in eval_sets if not items]
        if empty:
            raise CLIError(f"--decoys: no item of {', '.join(empty)} has a decoy (another item's intermediates "
                           "absent from its prompt): give sets of several items.")
    swap_sets = [(name, load_swap_set(name)) for name in args.swap or []]  # bad files fail before loading
    if args.n_texts < 0:
        raise CLIError(f"--n-texts {args.n_texts} must be >= 0 (0 skips the per-layer evaluation).")
    texts = load_corpus(args.corpus, n=args.n_texts, min_chars=args.min_chars, split=args.split) \
        if args.n_texts else []
    model = load_model(args.model, **model_loading_options(args), progress=say)
    lenses = resolve_lenses(args.lens, model, args.shrinkage)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": model.name, "corpus": args.corpus, "split": args.split, "n_texts": len(texts),
              "max_seq_len": args.max_seq_len}
    frame = _run_per_layer(model, lenses, texts, args, out) if texts else None
    if frame is not None:
        result["per_layer"] = frame.to_dict(orient="records")
    passes = _run_pass_at_k(model, lenses, eval_sets, readout, args, out) if eval_sets else None
    if passes is not None:
        result["pass_at_k"] = passes.to_dict(orient="records")
    swaps = _run_swaps(model, lenses, swap_sets, args, out) if swap_sets else None
    written = [out / "eval.json"]
    if swaps is not None:
        result["swap_success"] = swaps.to_dict(orient="records")
        written += [out / "swap_success.csv", out / "swap_items.csv"]
    atomic_write_text(out / "eval.json", json.dumps(result, indent=1, default=float), shared=True)
    if frame is not None:
        plot = _plot(frame, out / "eval.png", f"{model.name}: {len(texts)} texts of {args.corpus} ({args.split})")
        written = [out / "eval.csv"] + written + ([plot] if plot else [])
    _print_tables(frame, passes, swaps, args)
    print("\nWrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def register(subparsers) -> None:
    e = add_model_command(subparsers, "eval", help="per-layer KL and cross-entropy of lenses on a corpus",
                          description="Mean KL(final || lens) and next-token cross-entropy (bits) per layer and "
                                      "lens on texts not used for fitting; optional pass@k on evaluation sets. "
                                      "Writes eval.csv, eval.json and eval.png to --out.")
    e.add_argument("--lens", action="append", default=None,
                   help=f"{LENS_HELP}; repeat to compare (default: logit and default)")
    add_corpus_arguments(e, split="eval", split_help="corpus part (default 'eval': disjoint from what `jlens fit` uses "
                                                     "by default)",
                         n_texts=100, n_texts_help="texts to evaluate on (default 100; 0 skips the evaluation by layer)")
    e.add_argument("--max-seq-len", type=int, default=128, help="truncate texts to this many tokens (default 128)")
    e.add_argument("--shrinkage", type=float, action="append", default=None,
                   help="also evaluate each Jacobian lens shrunk as (1-a) J + a I; repeat for several a")
    e.add_argument("--pass-at-k", action="append", default=None, metavar="SET",
                   help="also run pass@k on a shipped evaluation set (two_hop, multilingual, ...) or a .json / "
                        ".jsonl file; repeatable (a macro mean is added over several)")
    e.add_argument("--readout", default=None,
                   help="pass@k readout for every item: last, last_newline, a token position, or before:TEXT "
                        "(default: each set's own)")
    e.add_argument("--spelling", choices=["whole", "first_token"], default="whole",
                   help="pass@k word matching: complete single-token spellings (default) or the older first-token rule")
    e.add_argument("--k", type=int, nargs="+", default=[1, 5, 10], help="k values for pass@k (default 1 5 10)")
    e.add_argument("--vocab", choices=vocab_choices(), default="all",
                   help="pass@k readout: every token (default) or word tokens only (a letter or digit in the text; "
                        "the item's spellings are always kept)")
    e.add_argument("--exclude-copied", action="store_true",
                   help="pass@k: leave out intermediates that appear in the prompt (the 'copied' column counts them)")
    e.add_argument("--stability", action="store_true",
                   help="with --pass-at-k: also rank each word under the split halves of the lenses that keep them "
                        "(best_rank_even/odd in pass_at_k_detail.csv) and report found_by_both_halves with its "
                        "interval; a lens without halves says so in one sentence and gets NaN")
    e.add_argument("--decoys", action="store_true",
                   help="pass@k of decoys: each item scored on another item's intermediates instead of its own "
                        "(the control for a lens that ranks a kind of word high everywhere; docs/method.md §8)")
    e.add_argument("--swap", action="append", default=None, metavar="SET",
                   help="also measure swap success on a swap set ('swaps', shipped, or a .jsonl); writes "
                        "swap_success.csv and swap_items.csv")
    e.add_argument("--alpha", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0],
                   help="swap scales for --swap (default 0.5 1 2 4)")
    e.add_argument("--centred", action="store_true",
                   help="--swap along centred read directions (each minus the mean over the vocabulary at its layer)")
    e.add_argument("--swap-seed", type=int, default=0,
                   help="seed of --swap's random-direction and norm-matched controls (default 0; recorded in the table)")
    e.add_argument("--swap-controls", choices=["first", "each"], default="first",
                   help="--swap's norm-matched control: with the first lens's directions (default) or one per lens, "
                        "'norm-matched (<lens>)', each in its own lens's geometry")
    e.add_argument("--out", required=True, help="folder for eval.csv, eval.json, eval.png")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(func=_eval_defaults)


def _eval_defaults(args: argparse.Namespace) -> int:
    if args.lens is None:
        args.lens = ["logit", "default"]
    return cmd_eval(args)
