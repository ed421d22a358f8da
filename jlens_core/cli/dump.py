"""``jlens dump`` and ``jlens diff``: write every hidden state of one forward pass, and compare two such dumps.

``jlens diff`` exits 0 when the dumps match within tolerance, 1 when they differ, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from .._atomic import atomic_write_text
from .main import CLIError, say
from .model_args import add_placement_arguments, model_loading_options

log = logging.getLogger(__name__)

DTYPES = ("float32", "float64", "bfloat16", "float16")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``dump`` and ``diff`` subcommands."""
    p = subparsers.add_parser(
        "dump", help="write every hidden state of one forward pass to a folder",
        description="Run one forward pass and write the embedding output, each selected decoder layer's "
                    "attention / MLP / residual output and the final-norm output as raw little-endian "
                    "float32 files, with manifest.jsonl and run.json (settings, versions, token ids).")
    p.add_argument("--model", required=True, help="'smollm2-135m', a Hugging Face id, a local folder or a .gguf")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--out", required=True, help="the dump folder (new or empty; --force to replace a dump)")
    p.add_argument("--ops", default="residual", help="per-layer ops: residual,attn,mlp or all (default: residual)")
    p.add_argument("--layers", default="all", help="layers: '0,4,8', '0:12', '0:12:2', '-1' or 'all' (default)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1, mps")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="compute dtype (default: the loader's)")
    add_placement_arguments(p)
    p.add_argument("--max-seq-len", type=int, default=None, help="truncate the prompt to N tokens")
    p.add_argument("--no-ends", action="store_true", help="do not dump the embedding and final-norm outputs")
    p.add_argument("--force", action="store_true", help="replace an earlier dump in --out")
    p.set_defaults(func=run_dump)

    q = subparsers.add_parser(
        "diff", help="compare two dumps and report the first layer/op where they part ways",
        description="Compare dump A with the reference dump B tensor by tensor (|a-b| <= atol + rtol*|b|). "
                    "Exit code 0: they match; 1: they differ; 2: bad input.")
    q.add_argument("a", help="dump folder A")
    q.add_argument("b", help="dump folder B (the reference)")
    q.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    q.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    q.add_argument("--json", default=None, metavar="FILE", help="also write the full result as JSON")
    q.add_argument("--max-rows", type=int, default=None, help="print at most N table rows")
    q.set_defaults(func=run_diff)


def _torch_dtype(name: str | None):
    if name is None:
        return None
    import torch

    return getattr(torch, name)


def run_dump(args: argparse.Namespace) -> int:
    from ..debugging.dump import dump_hidden_states, parse_ops
    from ..layerspec import check_layer_spec, parse_layer_spec

    ops = parse_ops(args.ops)
    check_layer_spec(args.layers)
    if args.max_seq_len is not None and args.max_seq_len < 1:
        raise CLIError(f"--max-seq-len {args.max_seq_len} must be at least 1.")
    if not args.prompt:
        raise CLIError("--prompt is empty: give some text.")
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise CLIError(f"{str(out)!r} is not empty: choose a new folder, or --force to replace an earlier dump.")
    try:
        from ..models.loading import load_model
    except ModuleNotFoundError as exc:
        if exc.name != "jlens_core.models.loading":
            raise
        raise CLIError("model loading (jlens_core.models.loading) is not available in this install.") from exc

    dtype = _torch_dtype(args.dtype)
    options = model_loading_options(args)
    model = load_model(args.model, **{**options, "dtype": dtype}, progress=say)
    if dtype is not None and model.dtype != dtype:
        log.info("Converting %s from %s to %s.", model.name, model.dtype, dtype)
        model.hf_model.to(dtype)
    layers = parse_layer_spec(args.layers, model.n_layers)
    settings = {"cli": {"model": args.model, "ops": args.ops, "layers": args.layers, "device": args.device,
                        "dtype": args.dtype, "max_seq_len": args.max_seq_len,
                        **{k: options[k] for k in ("device_map", "max_memory", "offload_folder") if options[k]}}}
    path = dump_hidden_states(model, args.prompt, out, ops=ops, layers=layers, ends=not args.no_ends,
                              max_length=args.max_seq_len, extra_settings=settings, overwrite=args.force)
    from ..debugging.dump import load_dump

    dump = load_dump(path, check_hashes=False)
    total = sum(e.bytes for e in dump.entries)
    print(f"Wrote {len(dump.entries)} tensors ({total / 2**20:.1f} MiB) of {dump.run['n_tokens']} tokens "
          f"from {model.name} ({dump.run['dtype']} on {dump.run['device']}) to {path}")
    if dump.run.get("not_dumped"):
        print(f"Not available in this layout: {', '.join(dump.run['not_dumped'])}")
    return 0


def run_diff(args: argparse.Namespace) -> int:
    from ..debugging.diff import diff_dumps

    if args.max_rows is not None and args.max_rows < 1:
        raise CLIError(f"--max-rows {args.max_rows} must be at least 1.")
    result = diff_dumps(args.a, args.b, atol=args.atol, rtol=args.rtol)
    print(result.to_text(max_rows=args.max_rows))
    if args.json:
        atomic_write_text(args.json, json.dumps(result.to_dict(), indent=1), shared=True)
    return 0 if result.matches else 1
