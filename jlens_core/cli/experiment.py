"""Run one of the paper's workspace experiments on a model, from a prompt set in the reference's format
(docs/experiments.md). Writes result.json, trials.csv, summary.csv and gate.csv (and result.html) to --out.

``jlens experiment NAME --items FILE``: the capability gate, the arms and their controls, Wilson 95 % and
category-clustered bootstrap intervals. The first paragraph above is the command's ``--help`` description.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from .common import advance, progress_bar, resolve_lenses
from .main import CLIError, command_description, say
from .model_args import LENS_HELP, add_model_command, model_loading_options

PREFILLED = ("verbal-report", "selectivity-language")  # the experiments whose reply start is a setting


def cmd_experiment(args: argparse.Namespace) -> int:
    from ..experiments.formats import load_experiment_items
    from ..experiments.run import RUNNERS, run_experiment
    from ..models.loading import load_model

    _, data = load_experiment_items(args.items or args.name, args.name)  # a bad file fails before the model loads
    if args.name not in RUNNERS:  # its file is read and checked above: say so
        raise CLIError(f"The {args.name} set is in its format, but the experiment does not run in this version: "
                       f"run one of {', '.join(RUNNERS)}.")
    model = load_model(args.model, **model_loading_options(args), progress=say)
    lenses = resolve_lenses([args.lens], model)
    lens = next(iter(lenses.values()))
    options: dict[str, Any] = {}
    if args.no_depth:
        options["depth"] = False
    if args.alpha is not None:
        options["alpha"] = args.alpha
    if args.prefill is not None:
        if args.name not in PREFILLED:
            raise CLIError(f"--prefill is for {' and '.join(PREFILLED)}: {args.name} takes no prefill.")
        options["prefill"] = args.prefill
    bar = progress_bar(1, args.name, args.no_progress, unit="step")
    result = run_experiment(model, lens, args.name, data, band=args.band, seed=args.seed,
                            progress=functools.partial(advance, bar) if bar else None, **options)
    if bar:
        bar.close()
    written = result.save(Path(args.out), html=args.html)
    print(f"{result.name} · {model.name} · {args.lens} lens · band {result.band.label} ({result.band.rule})")
    print(f"gate: {result.n_gated} of {len(result.gate)} passed")
    columns = ["arm", "trials", "successes", "rate", "wilson_low", "wilson_high", "boot_low", "boot_high", "top5_rate"]
    print(result.summary[columns].to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    for key in ("depth_onset", "broadcast_rate"):
        if key in result.extras:
            print(f"{key.replace('_', ' ')}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in result.extras[key].items()))
    for note in result.notes:
        print(f"note: {note}")
    print(f"{result.seconds:.1f} s", file=sys.stderr)
    print("Wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def register(subparsers) -> None:
    from ..experiments.formats import EXPERIMENTS

    e = add_model_command(subparsers, "experiment", help="one of the paper's workspace experiments (probe-swap, ...)",
                          description=command_description(__doc__))
    e.add_argument("name", choices=list(EXPERIMENTS), help="the experiment")
    e.add_argument("--items", default=None, metavar="FILE",
                   help="the prompt set: a .json file in the experiment's format (default: the small example set "
                        "shipped for it)")
    e.add_argument("--band", default=None, metavar="A-B",
                   help="the layers to swap at, e.g. 20-26 (default: derived with the study's band rule)")
    e.add_argument("--lens", default="default", help=f"{LENS_HELP} (default: default)")
    e.add_argument("--alpha", type=float, default=None, help="the coordinate swaps' scale (default 1: exchanged)")
    e.add_argument("--no-depth", action="store_true", help="probe-swap: skip the depth test")
    e.add_argument("--prefill", default=None, metavar="TEXT",
                   help="verbal-report, selectivity-language: the reply's start before the answer is read, e.g. "
                        "'I am thinking of a {category}:' (default: none)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random controls and the bootstrap (default 0)")
    e.add_argument("--out", required=True, metavar="DIR", help="folder for result.json and the tables")
    e.add_argument("--html", action="store_true", help="also write result.html, one self-contained page")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_experiment)
