"""``jlens export LENS --format reference | transformer-lens | neuronpedia | jpp --out DIR``: a lens in another
library's format (docs/sharing.md).

Writes the lens (a file or a shipped lens's name) for the reference jlens library, TransformerLens's ``JacobianLens``,
Neuronpedia's Hub layout (``<model_id>/jlens/<dataset>/...``: the lens, ``<slug>_convergence.csv``, ``config.yaml``) or
the J++ layout (J++ / R++ lenses), prints the files written with their sizes, and names in one sentence what the
format cannot hold (split halves, canary, expert weights, R-lens rules). ``--model`` (optional) supplies the
provenance of a lens fitted before provenance records existed, and is checked against the lens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .main import CLIError, command_description


def cmd_export(args: argparse.Namespace) -> int:
    from ..lenses.export import export_lens
    from ..lenses.loading import load_lens

    lens = load_lens(args.lens)
    model = None
    if args.model:
        from ..models.loading import load_model
        from .main import say

        model = load_model(args.model, progress=say)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {args.out!r} is a file; give a folder (the export names its files).")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = export_lens(lens, out, args.format, model=model, model_id=args.model_id, dataset=args.dataset)
    seconds = time.perf_counter() - started
    for path in result.files:
        print(f"{path}\t{path.stat().st_size / 2**20:.1f} MB")
    print(f"Exported {args.lens} as {args.format} in {seconds:.1f} s.", file=sys.stderr)
    if result.left_out:
        print(result.left_out, file=sys.stderr)
    return 0


def register(subparsers) -> None:
    from ..lenses.export import FORMATS

    e = subparsers.add_parser("export", help="write a lens for the reference library, TransformerLens, Neuronpedia or J++",
                              description=command_description(__doc__))
    e.add_argument("lens", metavar="LENS", help="a lens file, or a shipped lens's name (smollm2-135m, smollm2-135m:jpp)")
    e.add_argument("--format", required=True, choices=list(FORMATS), help="the layout to write")
    e.add_argument("--out", required=True, metavar="DIR", help="the folder to write in (the root of Neuronpedia's layout)")
    e.add_argument("--model", default=None,
                   help="the lens's model: its provenance for a lens that records none (checked against the lens)")
    e.add_argument("--model-id", default=None, help="neuronpedia: the model id folder (default: the model's name)")
    e.add_argument("--dataset", default=None, help="neuronpedia: the corpus folder (default: the lens's corpus)")
    e.set_defaults(func=cmd_export)
