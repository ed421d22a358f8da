"""Train a tuned lens: per layer an affine translator read as unembed(h + A h + b), minimising KL(final || lens)
over corpus tokens with the model frozen. Checkpoints next to --out; rerun the same command to resume; Ctrl-C keeps
the checkpoint.

``jlens tune``: train a tuned lens (the third lens) with a progress bar, checkpoints and resume. The first paragraph
above is the command's ``--help`` description (:func:`~jlens_core.cli.main.command_description`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .fit import _interruptible
from .main import CLIError, command_description, say
from .model_args import (
    add_corpus_arguments,
    add_model_command,
    add_save_dtype_argument,
    model_loading_options,
)


def cmd_tune(args: argparse.Namespace) -> int:
    from ..corpus import load_corpus
    from ..fitting.tuning import train_tuned_lens
    from ..layerspec import check_layer_spec, parse_layer_spec
    from ..models.loading import load_model

    if args.layers:
        check_layer_spec(args.layers)
    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise CLIError(f"--out {str(out)!r} must end in .safetensors.")
    texts = load_corpus(args.corpus, n=args.n_texts, min_chars=args.min_chars, split=args.split)
    heldout = load_corpus(args.corpus, n=args.heldout_texts, min_chars=args.min_chars, split="eval") \
        if args.heldout_texts else []
    model = load_model(args.model, **model_loading_options(args), progress=say)
    layers = parse_layer_spec(args.layers, model.n_layers) if args.layers else None
    checkpoint = Path(args.checkpoint) if args.checkpoint else out.with_suffix(".ckpt")
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="tune", unit="step", file=sys.stderr, dynamic_ncols=True)

    def progress(p) -> None:
        if bar is not None:
            bar.n = p.step
            post = {"kl": f"{p.train_kl_bits:.3f}"}
            if p.heldout_kl_bits:
                post["held-out"] = f"{sum(p.heldout_kl_bits.values()) / len(p.heldout_kl_bits):.3f}"
            bar.set_postfix(post, refresh=True)

    _interruptible()
    try:
        lens = train_tuned_lens(model, texts, layers=layers, steps=args.steps, tokens_per_step=args.tokens_per_step,
                                lr=args.lr, warmup_steps=args.warmup_steps, max_seq_len=args.max_seq_len,
                                skip_first=args.skip_first, heldout_texts=heldout, heldout_every=args.heldout_every,
                                checkpoint_path=checkpoint, checkpoint_every=args.checkpoint_every,
                                resume=not args.no_resume, progress=progress)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print(f"jlens tune: stopped; the checkpoint {checkpoint} keeps the steps done: rerun the same command to "
              "go on.", file=sys.stderr)
        return 130
    if bar is not None:
        bar.close()
    lens = lens.replace(settings={**lens.settings, "corpus": args.corpus, "split": args.split, "n_texts": len(texts),
                                  "heldout_texts": len(heldout)})
    lens.save(out, dtype=args.save_dtype)
    kl = lens.metrics.get("heldout_kl_bits")
    note = f"; held-out KL {sum(kl.values()) / len(kl):.3f} bits (mean over layers)" if kl else ""
    print(f"Wrote {out} ({lens!r}){note}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = add_model_command(subparsers, "tune", help="train a tuned lens (affine translators) for comparison",
                          description=command_description(__doc__))
    add_corpus_arguments(p, split="fit", split_help="corpus part to train on (default fit)", n_texts=200,
                         n_texts_help="training texts (default 200)", min_chars=600)
    p.add_argument("--heldout-texts", type=int, default=8,
                   help="texts of the 'eval' split to measure held-out KL on while training (default 8; 0 = none)")
    p.add_argument("--heldout-every", type=int, default=25, help="steps between held-out measurements (default 25)")
    p.add_argument("--out", required=True, help="the tuned lens file (.safetensors)")
    p.add_argument("--checkpoint", default=None, help="checkpoint path (default: --out with .ckpt)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (default 10)")
    p.add_argument("--no-resume", action="store_true", help="start over even if a checkpoint exists")
    p.add_argument("--layers", default=None, help="source layers, e.g. '0:12' (default: all below the last)")
    p.add_argument("--steps", type=int, default=150, help="optimisation steps (default 150)")
    p.add_argument("--tokens-per-step", type=int, default=128, help="tokens per step (default 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps (default 5)")
    p.add_argument("--max-seq-len", type=int, default=128, help="truncate texts to this many tokens (default 128)")
    p.add_argument("--skip-first", type=int, default=16, help="leave out the first positions of each text (default 16)")
    add_save_dtype_argument(p, "storage of the lens file (float16 halves it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_tune)
