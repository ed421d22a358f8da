"""Give the shipped default J lens its split halves (docs/method.md §3.3), keeping its matrices bit for bit.

    .venv/bin/python scripts/ship_halves.py [--run-dir runs/ship-halves] [--n-prompts 100]

Refits the shipped lens's prompts with the shipped settings (the built-in corpus's "fit" split, texts of at least
600 characters, the first 100, every source layer, target = last layer, 128 tokens, skip_first 16); the fit keeps
the even and the odd prompts apart. It checkpoints after every prompt under ``--run-dir``: rerun to resume (about
70 s a prompt on a 2-core CPU: two hours). Then it checks that the refit's full mean equals the shipped matrices
to within fp16 rounding (the shipped file stores fp16), and writes the shipped file again with the *shipped*
matrices, their diagnostics and canary unchanged, plus the refit's two halves (fp16). Every result computed with
the shipped lens stays valid. A refit that differs is refused with the largest difference, and nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "assets" / "lenses" / "smollm2-135m.safetensors"
# fp16 keeps 11 significant bits: a relative rounding of at most 2^-11 per entry, so ~5e-4 of a matrix's norm.
TOLERANCE = 2e-3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lens", type=Path, default=SHIPPED, help="the shipped lens file (rewritten in place)")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "ship-halves", help="checkpoint folder")
    parser.add_argument("--n-prompts", type=int, default=100, help="the shipped lens's prompt count (default 100)")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    from jlens_core import JacobianLens, fit, load_corpus, load_model

    shipped = JacobianLens.load(args.lens)
    if shipped.n_prompts != args.n_prompts:
        print(f"{args.lens} averages {shipped.n_prompts} prompts, not --n-prompts {args.n_prompts}: "
              "give its count.", file=sys.stderr)
        return 2
    model = load_model()
    prompts = load_corpus("stdlib-docs", n=args.n_prompts, min_chars=600, split="fit")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), desc="refit with halves", unit="prompt")
    refit = fit(model, prompts, source_layers=shipped.source_layers, target_layer=shipped.target_layer,
                max_seq_len=128, skip_first=16, dim_batch=8, checkpoint_path=args.run_dir / "refit.ckpt",
                progress=lambda e: bar.update(1))
    bar.close()
    halves = refit.raw_halves
    if halves is None or refit.n_prompts != shipped.n_prompts:
        print(f"The refit counted {refit.n_prompts} prompts (halves: {refit.half_prompts}); the shipped lens "
              f"{shipped.n_prompts}: nothing written.", file=sys.stderr)
        return 1
    worst = max(float((refit.jacobians[layer] - shipped.jacobians[layer]).norm()
                      / shipped.jacobians[layer].norm()) for layer in shipped.source_layers)
    print(f"refit vs shipped: largest relative Frobenius difference {worst:.2e} (tolerance {TOLERANCE:.0e})")
    if worst > TOLERANCE:
        print("The refit is not the shipped lens: nothing written.", file=sys.stderr)
        return 1
    with_halves = shipped.with_halves(halves)  # the shipped matrices, record and canary, bit for bit
    with_halves.save(args.lens, dtype="float16", halves=True)
    print(f"wrote {args.lens} with halves {refit.half_prompts} ({args.lens.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
