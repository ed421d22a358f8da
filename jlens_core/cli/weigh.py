"""``jlens weigh``: learn an expert lens's combination weights on labelled items (docs/method.md §9.1).

Reads every item of the chosen sets once, splits them by a seeded hash of their prompt into training
and held-out items, learns the weights on the training items
(:func:`~jlens_core.fitting.expert_weights.learn_expert_weights`), writes the weighted expert lens
(and, with ``--combined``, the one-matrix Jacobian lens), and prints the exact macro pass@1/5/10 of the
pooled lens, uniform expert weights and the learned weights on both sides of the split.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from .common import advance, progress_bar, vocab_choices
from .main import CLIError, say
from .model_args import add_model_arguments, add_save_dtype_argument, model_loading_options

DEFAULT_SETS = "two_hop,arithmetic_chain,antonym_chain,translation_pivot,multilingual,couplets,typos,association,order_ops"


def _check_out(path: str, option: str) -> Path:
    out = Path(path)
    if out.suffix != ".safetensors":
        raise CLIError(f"{option} {str(out)!r} must end in .safetensors.")
    return out


def cmd_weigh(args: argparse.Namespace) -> int:
    import torch

    from ..evaluation.labelled_items import read_labelled_items
    from ..evaluation.passk import load_eval_set
    from ..fitting.expert_weights import REPORT_KS, learn_expert_weights, macro_pass_at_k, split_items
    from ..lenses.experts import ExpertLens, is_expert_lens_file
    from ..models.device_maps import parse_size
    from ..models.loading import load_model

    out = _check_out(args.out, "--out")
    combined_out = _check_out(args.combined, "--combined") if args.combined else None
    if not 0.0 < args.heldout_fraction < 1.0:
        raise CLIError(f"--heldout-fraction {args.heldout_fraction} must lie strictly between 0 and 1.")
    if args.steps < 0 or not args.lr > 0:
        raise CLIError(f"--steps {args.steps} must be >= 0 and --lr {args.lr} > 0.")
    try:
        basis_budget = None if args.basis_memory is None else parse_size(args.basis_memory, what="--basis-memory")
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if not sets:
        raise CLIError("--sets names no set: give e.g. --sets two_hop,association.")
    for spec in sets:  # an unknown name fails here, before the model loads
        load_eval_set(spec)
    lens_path = Path(args.lens)
    if not lens_path.is_file():
        raise CLIError(f"No lens file at {args.lens!r}.")
    if not is_expert_lens_file(lens_path):
        raise CLIError(f"{args.lens!r} is not an expert lens, so it has no experts to weigh: fit one with "
                       "`jlens fit --experts 8 ...` first.")
    model = load_model(args.model, **model_loading_options(args), progress=say)
    lens = ExpertLens.load(lens_path, model=model)
    bar = progress_bar(0, "read items", args.no_progress, unit="item")
    items = read_labelled_items(model, sets, lens.source_layers, vocab=args.vocab,
                                progress=functools.partial(advance, bar) if bar is not None else None)
    if bar is not None:
        bar.close()
    train, heldout = split_items(items, args.heldout_fraction, seed=args.seed)
    bar = progress_bar(0, "learn weights", args.no_progress, unit="step")

    def learn_progress(p) -> None:
        if bar is not None:
            bar.total = p.n_starts * (p.n_steps + 1)
            bar.n = p.start_index * (p.n_steps + 1) + p.step + 1
            bar.set_postfix({"start": p.start, "pass@10": f"{p.macro:.3f}", "best": f"{p.best_macro:.3f}"},
                            refresh=True)

    fit = learn_expert_weights(model, lens, train, steps=args.steps, lr=args.lr, progress=learn_progress,
                               basis_budget=basis_budget)
    if bar is not None:
        bar.close()
    weighted = lens.with_weights(fit.weights, fit.items)
    experts = {layer: lens.expert_matrices(layer) for layer in lens.source_layers}
    pooled = {layer: lens.pooled[layer][None] for layer in lens.source_layers}
    ones = {layer: torch.ones(1) for layer in lens.source_layers}
    uniform = {layer: lens.uniform_weights() for layer in lens.source_layers}
    scores = {}
    for split, part in (("train", train), ("held-out", heldout)):
        scores[("pooled", split)] = macro_pass_at_k(model, pooled, part, ones)
        scores[("uniform", split)] = macro_pass_at_k(model, experts, part, uniform)
        scores[("learned", split)] = macro_pass_at_k(model, experts, part, fit.weights)
    record = {"sets": sets, "vocab": args.vocab, "heldout_fraction": args.heldout_fraction, "seed": args.seed,
              "steps": args.steps, "lr": args.lr, "start": fit.start, "step": fit.step,
              "seconds": round(fit.seconds, 3), "n_train": len(train), "n_heldout": len(heldout),
              "heldout_items": [item.key for item in heldout],
              "macro": {f"{name}/{split}": {str(k): round(v, 6) for k, v in ks.items()}
                        for (name, split), ks in scores.items()}}
    weighted = weighted.replace(weighting={key: value for key, value in record.items() if key != "heldout_items"})
    weighted.save(out, dtype=args.save_dtype)
    sidecar = out.with_suffix(".weigh.json")
    sidecar.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    if combined_out is not None:
        weighted.to_jacobian_lens().save(combined_out, dtype=args.save_dtype)
    print(f"macro pass@k ({args.vocab} readout; {len(train)} training, {len(heldout)} held-out items; "
          f"learned from start {fit.start!r}, step {fit.step}, in {fit.seconds:.1f} s)")
    header = f"{'weights':<10}{'split':<10}" + "".join(f"{'pass@' + str(k):>9}" for k in REPORT_KS)
    print(header)
    for (name, split), ks in scores.items():
        print(f"{name:<10}{split:<10}" + "".join(f"{ks[k]:>9.3f}" for k in REPORT_KS))
    written = f"{out}" + (f" and {combined_out}" if combined_out else "")
    print(f"Wrote {written} ({weighted!r}); the run's record: {sidecar}", file=sys.stderr)
    return 0




def register(subparsers) -> None:
    p = subparsers.add_parser("weigh", help="learn an expert lens's combination weights on labelled items",
                              description="Learn per-layer signed unit-norm weights w of an expert lens (J_l = "
                                          "sum_e w_e J_{l,e}) on a seeded split of labelled pass@k sets: a smooth "
                                          "surrogate of macro pass@10, Adam from three starts, the iterate with the "
                                          "best exact macro pass@10 kept (docs/method.md §9.1). Prints the exact macro "
                                          "pass@1/5/10 of the pooled lens, uniform and learned weights on the training "
                                          "and held-out items; writes OUT and OUT.weigh.json.")
    p.add_argument("lens", help="the expert lens file (.safetensors, from jlens fit --experts E)")
    add_model_arguments(p)
    p.add_argument("--sets", default=DEFAULT_SETS,
                   help="comma-separated shipped set names or .json/.jsonl files (default: the nine shipped sets)")
    p.add_argument("--out", required=True, help="the weighted expert lens (.safetensors)")
    p.add_argument("--combined", default=None,
                   help="also write the one-matrix Jacobian lens (sum_e w_e J_e per layer) here (.safetensors)")
    add_save_dtype_argument(p, "storage of the written lenses (float16 halves them)")
    p.add_argument("--heldout-fraction", type=float, default=0.5,
                   help="fraction of items held out, by a seeded hash of the prompt (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    p.add_argument("--steps", type=int, default=200, help="Adam steps per start (default 200)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam learning rate (default 0.05)")
    p.add_argument("--vocab", choices=vocab_choices(), default="all",
                   help="the readout ranks are counted under: all tokens, or word tokens (default all)")
    p.add_argument("--basis-memory", default=None, metavar="SIZE",
                   help="memory the fast path's precomputed logits may take, e.g. 12GiB (default 6GiB; 0: always "
                        "unembed, slower, same result). It needs about 4 x items x layers x experts x vocab bytes")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_weigh)
