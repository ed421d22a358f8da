"""``jlens check LENS [--model M] [--write-canary | --refit N]``: is this lens still the lens of this model? (docs/method.md §4.2)

Recomputes the forward canary the lens file stores and prints one sentence: exit 0 "still the lens of M",
exit 1 naming the part that changed (weights fingerprint, residuals, Jacobian), the first layer and by how
much, with the versions then and now; a file without a canary exits 0 and says how to add one
(``--write-canary``: made with the model given, written atomically, the lens's own tensors unchanged).
``--refit N`` is the drift check for lenses fitted elsewhere (docs/sharing.md): refit N prompts now, compare per layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..lenses.kinds import BASELINE, is_trained
from .main import CLIError, say
from .model_args import add_model_arguments, model_loading_options


def _lens_path(spec: str, model_name: str) -> Path | None:
    """The local file ``spec`` names (``default``: the shipped lens of the model), or None."""
    if spec == "default":
        from ..lenses.shipped import shipped_lens_path

        return shipped_lens_path(model_name)
    path = Path(spec).expanduser()
    return path if path.is_file() else None


def _fit_dtype_line(lens) -> str:
    """The compute dtype the lens was fitted in (``FitSettings.dtype``, docs/fitting.md "Precision"), in one line."""
    dtype = getattr(getattr(lens, "fit_settings", None), "dtype", "auto")
    if dtype == "auto":
        return "Fitted in: not recorded (a lens from before the fit dtype was recorded)."
    return f"Fitted in: {dtype} (Jacobian sums in float32)."


def cmd_check(args: argparse.Namespace) -> int:
    from ..lenses.canary import check_lens, make_canary, write_canary
    from ..lenses.header import LensFileError
    from ..lenses.loading import load_lens, load_lens_file
    from ..models.loading import load_model

    model = load_model(args.model, **model_loading_options(args), progress=say)
    path = _lens_path(args.lens, str(model.name))
    if args.lens == "default" and path is None:
        raise CLIError(f"No shipped lens for {model.name!r}: give a lens file.")
    lens = load_lens_file(path) if path is not None else load_lens(args.lens)
    if args.lens == BASELINE or not hasattr(lens, "target_layer"):
        raise CLIError(f"{args.lens!r} is not a fitted lens file: give one (jlens check LENS.safetensors).")
    if is_trained(lens):
        raise CLIError(f"{args.lens!r} is a tuned lens: the lens check covers lenses fitted by `jlens fit` (J, R-lens, "
                       "experts).")
    try:
        lens.check_model(model)
    except LensFileError as exc:
        print(f"Not the lens of {model.name}: {exc}")
        return 1
    if args.refit is not None:
        return _refit_check(args, model, lens)
    if args.write_canary:
        if path is None or path.suffix != ".safetensors":
            raise CLIError(f"--write-canary needs a local .safetensors lens file; {args.lens!r} is not one.")
        if not hasattr(lens, "source_layers") or not lens.source_layers:
            raise CLIError(f"{args.lens!r} has no source layer: a canary needs one.")
        canary = make_canary(model, lens)
        write_canary(path, canary)
        print(f"Wrote a canary of {model.name} to {path} ({canary.seconds:.1f} s): `jlens check {args.lens}` now "
              "checks the lens against it.")
        return 0
    result = check_lens(model, lens, lens_name=args.lens)
    print(result.message)
    print(_fit_dtype_line(lens))
    if result.status == "changed" and args.verbose:
        for part in result.parts:
            print(f"  {part.part}: {'ok' if part.ok else 'CHANGED'} (relative difference {part.difference:.2g}, "
                  f"tolerance {part.tolerance:.0e}){': ' + part.detail if part.detail else ''}", file=sys.stderr)
    return result.exit_code


def _refit_check(args: argparse.Namespace, model, lens) -> int:
    """``--refit N``: refit the first N prompts now and compare per layer (docs/sharing.md, the drift check)."""
    from ..corpus import load_corpus
    from ..fitting.drift import refit_check

    if args.refit < 1:
        raise CLIError(f"--refit {args.refit} must be >= 1.")
    from ..lenses.provenance import file_settings

    settings = file_settings(lens)
    recorded = settings.get("corpus")
    corpus = args.corpus or recorded
    if corpus is None:
        raise CLIError(f"{args.lens!r} records no corpus (a lens fitted elsewhere): give one with --corpus.")
    split = args.split if args.split is not None else settings.get("split", "fit")
    first = int(settings.get("first_prompt", 0)) if corpus == recorded else 0
    prompts = load_corpus(corpus, min_chars=args.min_chars, split=split)[first: first + args.refit]
    nested = corpus == recorded and split == settings.get("split", "fit")
    try:
        result = refit_check(model, lens, prompts, nested=nested)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    for row in result.layers:
        print(f"  layer {row.layer:>3}: difference {row.rel_diff:.3g}, bound {row.bound:.3g} "
              f"({'ok' if row.ok else 'OUT OF BOUNDS'})", file=sys.stderr)
    print(result.message)
    return result.exit_code


def register(subparsers) -> None:
    c = subparsers.add_parser("check", help="is this lens still the lens of this model? (its forward canary)",
                              description="Recompute the forward canary a lens file stores (a fixed text's residuals "
                                          "at every layer, one Jacobian on seeded probes, the weights' norms) with the "
                                          "model as it is now. Exit 0: still the lens of the model (or the file has no "
                                          "canary: add one with --write-canary); exit 1: the part that changed, the "
                                          "first layer and by how much, with the transformers/torch versions then and "
                                          "now.")
    c.add_argument("lens", metavar="LENS", help="a lens file, or 'default' (the shipped lens of --model)")
    add_model_arguments(c)
    c.add_argument("--write-canary", action="store_true",
                   help="make the canary with --model now and add it to the lens file (atomically; the matrices "
                        "stay bit for bit): for files fitted before canaries existed")
    c.add_argument("--refit", type=int, default=None, metavar="N",
                   help="the drift check, for lenses without a canary (fitted elsewhere): refit the first N prompts of "
                        "the lens's corpus (or --corpus) with the model as loaded now and compare per layer: row by row "
                        "with the lens's convergence record when it keeps one, else the matrices within the sampling "
                        "error the split halves predict; exit 1 names the first layer out of bounds")
    c.add_argument("--corpus", default=None, help="the corpus --refit reads (default: the one the lens records)")
    c.add_argument("--split", default=None, choices=["fit", "eval", "all"],
                   help="the corpus part --refit reads (default: the lens's, else 'fit')")
    c.add_argument("--min-chars", type=int, default=400, help="skip corpus texts shorter than this (default 400)")
    c.set_defaults(func=cmd_check)
