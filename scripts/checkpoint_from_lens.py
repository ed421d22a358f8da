"""Rebuild a fit checkpoint from a saved lens, so a fit whose checkpoint was lost can go on.

    python scripts/checkpoint_from_lens.py LENS CHECKPOINT [--corpus stdlib-docs --split fit --min-chars 600]

The corpus options must be the ones of the original fit: the checkpoint records which prompts it has
seen, and resuming checks them. See ``jlens_core.fitting.fit.checkpoint_from_lens`` for the precision caveat.
"""
from __future__ import annotations

import argparse

from jlens_core import JacobianLens
from jlens_core.corpus import load_corpus
from jlens_core.fitting.fit import checkpoint_from_lens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lens")
    parser.add_argument("checkpoint")
    parser.add_argument("--corpus", default="stdlib-docs")
    parser.add_argument("--split", default="fit")
    parser.add_argument("--min-chars", type=int, default=600)
    args = parser.parse_args(argv)
    lens = JacobianLens.load(args.lens)
    prompts = load_corpus(args.corpus, min_chars=args.min_chars, split=args.split)
    next_idx = checkpoint_from_lens(lens, prompts, args.checkpoint)
    print(f"wrote {args.checkpoint}: {lens.n_prompts} prompts counted, the fit goes on at prompt {next_idx}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
