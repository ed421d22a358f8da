"""Rebuild a fit checkpoint from a saved lens, so a fit whose checkpoint was lost can go on.

    python scripts/checkpoint_from_lens.py LENS CHECKPOINT [--corpus stdlib-docs --split fit --min-chars 600]

The checkpoint's fp64 sums are ``n_prompts * J_l`` read back from the lens file, so a lens stored in
fp16 carries its rounding (relative ~5e-4 per entry) into the prompts it already counted; the prompts
fitted after the resume are summed in fp64 as usual. The corpus options must be the ones of the
original fit: the checkpoint records which prompts it has seen, and resuming checks them.
"""
from __future__ import annotations

import argparse
import sys

import torch

from jlens_core import JacobianLens
from jlens_core.corpus import load_corpus
from jlens_core.fit import FitState, prompts_digest, write_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lens")
    parser.add_argument("checkpoint")
    parser.add_argument("--corpus", default="stdlib-docs")
    parser.add_argument("--split", default="fit")
    parser.add_argument("--min-chars", type=int, default=600)
    args = parser.parse_args(argv)

    lens = JacobianLens.load(args.lens)
    n_skipped = int(lens.settings.get("n_skipped", 0))
    next_idx = lens.n_prompts + n_skipped
    prompts = load_corpus(args.corpus, min_chars=args.min_chars, split=args.split)
    if next_idx > len(prompts):
        sys.exit(f"The lens counted {next_idx} prompts but the corpus has only {len(prompts)}: wrong corpus options?")
    settings = {"source_layers": list(lens.source_layers), "target_layer": lens.target_layer,
                "skip_first": lens.settings["skip_first"], "max_seq_len": lens.settings["max_seq_len"],
                "model_name": lens.model_name, "model_fingerprint": lens.model_fingerprint}
    state = FitState({layer: lens.jacobians[layer].double() * lens.n_prompts for layer in lens.source_layers},
                     n_done=lens.n_prompts, next_idx=next_idx, n_skipped=n_skipped,
                     diagnostics=list(lens.diagnostics))
    write_checkpoint(args.checkpoint, state, settings, prompts_digest(prompts, next_idx))
    print(f"wrote {args.checkpoint}: {lens.n_prompts} prompts counted, the fit goes on at prompt {next_idx}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
