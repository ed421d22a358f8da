"""``jlens decompose`` and ``jlens jspace-structure``: a prompt's residuals decomposed into the J-space, and the
J-space's structure by layer over a corpus, each beside its controls (docs/method.md §11).

``decompose`` reads every position of the prompt (or ``--positions``) at each layer and prints, per cell, the
explained fraction beside the random dictionary's and the active atoms with their coefficients (``--format json``:
one JSON document). ``jspace-structure`` writes ``structure.json``, ``structure.csv``, ``mlp_gain.csv`` and
``jspace.png`` to ``--out``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .main import CLIError, command_description, say
from .model_args import LENS_HELP, add_corpus_arguments, add_model_command, model_loading_options


def _layers(spec: str | None, model, lens) -> list[int]:
    from ..interventions.read_directions import check_layers
    from ..layerspec import parse_layer_spec

    chosen = parse_layer_spec(spec, model.n_layers) if spec else list(lens.source_layers)
    return check_layers(model, lens, chosen)


def cmd_decompose(args: argparse.Namespace) -> int:
    from ..jspace.decompose import decompose
    from ..layerspec import check_layer_spec, parse_layer_spec
    from ..models.loading import load_model
    from ..reading.inputs import record_residuals
    from .common import resolve_lenses

    if not args.prompt or not args.prompt.strip():
        raise CLIError("--prompt is empty: give some text to decompose.")
    if args.k < 1:
        raise CLIError(f"--k {args.k} selects no atom: give k >= 1 (the paper uses up to 25).")
    if args.layers:
        check_layer_spec(args.layers)
    model = load_model(args.model, **model_loading_options(args), progress=say)
    lens = next(iter(resolve_lenses([args.lens], model).values()))
    layers = _layers(args.layers, model, lens)
    ids = model.encode(args.prompt)
    seq = int(ids.shape[-1])
    positions = parse_layer_spec(args.positions, seq) if args.positions else list(range(1 if seq > 1 else 0, seq))
    recorded = record_residuals(model, ids, layers)
    texts = [model.decode([int(t)]) for t in ids[0]]
    cells: list[dict[str, Any]] = []
    for layer in layers:
        dec = decompose(model, lens, recorded[layer][positions].float(), layer, k=args.k, method=args.method,
                        gauge=args.gauge, seed=args.seed)
        for row, pos in enumerate(positions):
            cells.append({"layer": layer, "position": pos, "token": texts[pos],
                          "explained": float(dec.explained[row]), "random_explained": float(dec.random_explained[row]),
                          "shuffled_explained": float(dec.shuffled_explained[row]),
                          "occupancy": int(dec.occupancy[row]),
                          "atoms": [{"token": t, "id": i, "coefficient": c} for t, i, c in dec.atoms(row)]})
    if args.format == "json":
        print(json.dumps({"model": model.name, "lens": str(lens.kind), "k": args.k, "method": args.method,
                          "gauge": args.gauge, "seed": args.seed, "cells": cells}, indent=1))
        return 0
    print(f"J-space of {model.name} ({lens.kind} lens, {args.gauge} gauge, k={args.k}, {args.method}); "
          "explained = 1 - |x - x_J|^2 / |x|^2, beside a random dictionary of the same size")
    for cell in cells:
        atoms = ", ".join(f"{a['token']!r} {a['coefficient']:.2f}" for a in cell["atoms"][:args.show])
        more = len(cell["atoms"]) - args.show
        print(f"L{cell['layer']:>2} pos {cell['position']:>3} {cell['token']!r:<14} J {cell['explained']:6.1%} "
              f"random {cell['random_explained']:6.1%}  {cell['occupancy']:>2} atoms: {atoms}"
              + (f" (+{more})" if more > 0 else ""))
    return 0


def cmd_structure(args: argparse.Namespace) -> int:
    from .._atomic import atomic_write_text
    from ..corpus import load_corpus
    from ..jspace.structure import jspace_structure
    from ..models.loading import load_model
    from .common import resolve_lenses

    if args.k < 1:
        raise CLIError(f"--k {args.k} selects no atom: give k >= 1 (the paper uses up to 25).")
    if args.per_text < 1:
        raise CLIError(f"--per-text {args.per_text} draws no residual: give at least 1.")
    texts = load_corpus(args.corpus, n=args.n_texts, min_chars=args.min_chars, split=args.split)
    model = load_model(args.model, **model_loading_options(args), progress=say)
    lens = next(iter(resolve_lenses([args.lens], model).values()))
    layers = _layers(args.layers, model, lens)
    gauges = ("centred", "raw") if args.gauge == "both" else (args.gauge,)
    result = jspace_structure(model, lens, texts, layers=layers, k=args.k, method=args.method, gauges=gauges,
                              per_text=args.per_text, max_seq_len=args.max_seq_len, n_boot=args.n_boot,
                              mlp_directions=args.mlp_directions, seed=args.seed, progress=say)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"settings": result.settings | {"corpus": args.corpus, "split": args.split}, "rows": result.rows,
           "mlp_gain": result.mlp_gain}
    atomic_write_text(out / "structure.json", json.dumps(doc, indent=1), shared=True)
    frame = result.frame()
    atomic_write_text(out / "structure.csv", frame.to_csv(index=False), shared=True)
    gains = result.mlp_frame()
    atomic_write_text(out / "mlp_gain.csv", gains.to_csv(index=False), shared=True)
    written = [out / "structure.json", out / "structure.csv", out / "mlp_gain.csv"]
    try:
        from ..figures.png_plots import plot_jspace_structure

        n = result.settings["n_residuals_per_layer"]
        written.append(plot_jspace_structure(frame, gains, out / "jspace.png",
                                             f"{model.name}, {lens.kind} lens: {n} residuals per layer, "
                                             f"k = {args.k}, {args.method}"))
    except ImportError as exc:  # matplotlib is optional (jlens[plot])
        say(f"no figure: {exc}")
    cols = ["layer", "gauge", "explained", "random_explained", "shuffled_explained", "occupancy", "steps90"]
    print(frame[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if len(gains):
        print(gains[["layer", "jlens_gain", "neuron_gain"]].to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lens", default="default", help=f"{LENS_HELP} (default: default)")
    p.add_argument("--layers", default=None, help="layers, e.g. '10:20' or '4,8' (default: every source layer)")
    p.add_argument("--k", type=int, default=25, help="atoms per decomposition (default 25, the paper's)")
    p.add_argument("--method", choices=["gradient_pursuit", "nnls"], default="gradient_pursuit",
                   help="coefficient update (default gradient_pursuit, the paper's; nnls: exact)")
    p.add_argument("--seed", type=int, default=0, help="seed of the controls (default 0)")


def register(subparsers) -> None:
    p = add_model_command(subparsers, "decompose", help="decompose a prompt's residuals into the J-space",
                          description=command_description(__doc__))
    p.add_argument("--prompt", required=True, help="the text whose residuals are decomposed")
    p.add_argument("--positions", default=None, help="positions, e.g. '5:' or '3,4' (default: all but the first)")
    p.add_argument("--gauge", choices=["centred", "raw"], default="centred",
                   help="atoms minus their mean over the vocabulary (centred, default) or not (raw)")
    p.add_argument("--format", choices=["text", "json"], default="text", help="output format (default text)")
    p.add_argument("--show", type=int, default=8, help="atoms shown per cell in text output (default 8)")
    _common(p)
    p.set_defaults(func=cmd_decompose)

    s = add_model_command(subparsers, "jspace-structure", help="the J-space by layer over a corpus, with controls",
                          description=command_description(__doc__))
    s.add_argument("--out", required=True, help="folder for structure.json, structure.csv, mlp_gain.csv, jspace.png")
    add_corpus_arguments(s, split="eval", split_help="corpus part (default eval: held out from the fits)",
                         n_texts=8, n_texts_help="texts to read (default 8)")
    s.add_argument("--per-text", type=int, default=3, help="residuals drawn per text (default 3)")
    s.add_argument("--max-seq-len", type=int, default=64, help="tokens read per text (default 64)")
    s.add_argument("--gauge", choices=["both", "centred", "raw"], default="both", help="gauges (default both)")
    s.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
    s.add_argument("--mlp-directions", type=int, default=2000,
                   help="directions per set for the MLP gain (default 2000; 0 skips it)")
    _common(s)
    s.set_defaults(func=cmd_structure)
