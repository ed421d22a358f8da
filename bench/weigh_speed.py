"""Side-by-side speed of ``learn_expert_weights`` with and without its logit basis (the fast path).

In ONE run, on the same items of the default model (SmolLM2-135M, fp32 on the CPU, all 29 source
layers) and the same synthetic 8-expert lens (the shipped J lens per layer plus small seeded
perturbations, ``J_l + noise * std(J_l) * N(0, 1)`` per expert), ``learn_expert_weights`` runs twice
for a few steps: with the logit basis (the default, docs/method.md §9.1) and with ``basis_budget=0``
(every step unembeds through the ``[n, d] x [d, vocab]`` head), and a third time with the basis but the
previous step (autograd through the full logits instead of ``layer_surrogate``'s columns, and fresh
``[n, vocab]`` temporaries instead of the batch's buffers). Each scored iterate reports progress;
the seconds between consecutive reports are the seconds per iterate (forward, backward and Adam step
of all layers). Printed per path: the setup (the items' tensors, the basis where built, and the three
starts, i.e. up to the first report, less one iterate), the median seconds per iterate, and the full
run extrapolated to the default 3 starts x 201 iterates; then the ratio of the seconds per iterate and
of the extrapolated runs, and whether both paths kept the same iterate with the same macro pass@10.

    python bench/weigh_speed.py                        # 50 items, 2 steps per start
    python bench/weigh_speed.py --items 16 --steps 1   # shorter
    python bench/weigh_speed.py --json bench/weigh_speed.json

The model is loaded with ``jlens_core.load_model("smollm2-135m")`` (offline: the embedded GGUF); the
items are the first ``--items`` scorable items of ``--sets``. A script, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jlens_core import load_model
from jlens_core.evaluation.labelled_items import read_labelled_items
from jlens_core.fitting import expert_weights
from jlens_core.fitting.expert_weights import (
    BASIS_BUDGET_BYTES,
    STARTS,
    STEPS,
    basis_bytes,
    learn_expert_weights,
)
from jlens_core.lenses.experts import Clustering, ExpertLens
from jlens_core.lenses.loading import default_lens
from jlens_core.models.device_maps import parse_size


def synthetic_experts(model, n_experts: int, noise: float, seed: int) -> ExpertLens:
    """An expert lens of ``model``: per source layer of its shipped J lens, ``n_experts`` copies of ``J_l``
    each plus ``noise * std(J_l)`` times seeded standard normal noise (every expert above its threshold)."""
    lens = default_lens(model)
    if lens is None:
        raise SystemExit(f"No shipped lens for {model.name!r}: this bench needs the default model.")
    gen = torch.Generator().manual_seed(seed)
    d = model.d_model
    pooled, experts, counts, clustering = {}, {}, {}, {}
    for layer in lens.source_layers:
        j = lens.matrix(layer).float()
        pooled[layer] = j
        experts[layer] = j + noise * j.std() * torch.randn(n_experts, d, d, generator=gen)
        counts[layer] = torch.full((n_experts,), 1000)
        clustering[layer] = Clustering(torch.zeros(d), torch.eye(d)[:4], torch.randn(n_experts, 4, generator=gen))
    return ExpertLens(pooled, experts, counts, clustering, 1, d, target_layer=model.n_layers - 1,
                      n_layers=model.n_layers, model_name=model.name, model_fingerprint=model.fingerprint())


def dense_layer_surrogate(model, batch, layer, weights, *, k=expert_weights.PASS_K,
                          temperature=expert_weights.TEMPERATURE):
    """The previous step: the surrogate of the full logits with autograd, so the backward reads the whole basis."""
    logits = expert_weights.layer_logits(model, batch, layer, weights)
    std = expert_weights.layer_std(model, batch, layer, weights)
    return expert_weights.surrogate_terms(logits, batch, k=k, temperature=temperature, std=std), logits.detach()


def fresh_intermediate_ranks(logits, batch):
    """The previous ranks: fresh ``[n_inter, vocab]`` temporaries every call instead of the batch's buffers."""
    rows = logits.index_select(0, batch.inter_item)
    best = rows.gather(1, batch.cand).max(dim=1, keepdim=True).values
    above = rows > best
    if batch.kept is not None:
        above = above & (batch.kept[batch.inter_item] > 0)
    return above.sum(dim=1) + 1


def timed_run(model, lens, items, steps: int, basis_budget: int | None, *, previous_step: bool = False) -> dict:
    """One ``learn_expert_weights`` run; the time of every progress report and the minor page faults per
    iterate. ``previous_step``: the step as it was before ``layer_surrogate``: backpropagated through the full
    logits, its ``[n, vocab]`` temporaries allocated afresh."""
    marks: list[float] = []
    faults: list[int] = []
    kept = expert_weights.layer_surrogate, expert_weights.intermediate_ranks
    if previous_step:
        expert_weights.layer_surrogate = dense_layer_surrogate
        expert_weights.intermediate_ranks = fresh_intermediate_ranks

    def mark(_) -> None:
        marks.append(time.perf_counter())
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    began = time.perf_counter()
    try:
        fit = learn_expert_weights(model, lens, items, steps=steps, basis_budget=basis_budget, progress=mark)
    finally:
        expert_weights.layer_surrogate, expert_weights.intermediate_ranks = kept
    total = time.perf_counter() - began
    per_iterate = statistics.median(b - a for a, b in itertools.pairwise(marks))
    setup = marks[0] - began - per_iterate
    full = setup + len(STARTS) * (STEPS + 1) * per_iterate
    faults_per_iterate = statistics.median(b - a for a, b in itertools.pairwise(faults))
    return {"seconds_total": total, "setup_s": setup, "iterate_s": per_iterate, "full_run_s": full,
            "minor_faults_per_iterate": faults_per_iterate,
            "start": fit.start, "step": fit.step, "macro10": fit.macro[10],
            "weights": torch.stack([fit.weights[layer] for layer in sorted(fit.weights)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sets", default="association,couplets", help="labelled sets the items come from")
    parser.add_argument("--items", type=int, default=50, help="scorable items learned on")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--noise", type=float, default=0.1, help="expert perturbation, in units of std(J_l)")
    parser.add_argument("--steps", type=int, default=2, help="Adam steps per start measured (>= 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--basis-memory", default=None, metavar="SIZE",
                        help="the basis's budget (as jlens weigh --basis-memory; default 6GiB: about 130 items)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1 (the seconds per iterate are differences between iterates)")
    if args.threads:
        torch.set_num_threads(args.threads)

    model = load_model(args.model, device="cpu")
    lens = synthetic_experts(model, args.experts, args.noise, args.seed)
    began = time.perf_counter()
    items = [item for item in read_labelled_items(model, args.sets.split(","), lens.source_layers) if item.scored]
    items = items[: args.items]
    read_s = time.perf_counter() - began
    print(f"{model.name}: d={model.d_model}, vocab={model.vocab_size}, {len(lens.source_layers)} source layers, "
          f"{args.experts} experts, {len(items)} items (read in {read_s:.1f} s), {args.steps} steps per start, "
          f"{torch.get_num_threads()} threads")

    budget = None if args.basis_memory is None else parse_size(args.basis_memory, what="--basis-memory")
    needed = basis_bytes(len(lens.source_layers), len(items), args.experts, model.vocab_size)
    if needed > (BASIS_BUDGET_BYTES if budget is None else budget):
        parser.error(f"the basis of {len(items)} items needs {needed / 2**30:.1f} GiB, over its budget: every arm "
                     "would unembed; raise --basis-memory")
    runs = {"basis": timed_run(model, lens, items, args.steps, budget),
            "basis-prev": timed_run(model, lens, items, args.steps, budget, previous_step=True),
            "unembed": timed_run(model, lens, items, args.steps, 0)}
    print(f"{'path':12} {'setup s':>9} {'s/iterate':>10} {'faults/iterate':>15} {'full run s (3 x 201 iterates)':>30}  "
          "kept (start, step, pass@10)")
    for name, run in runs.items():
        print(f"{name:12} {run['setup_s']:9.2f} {run['iterate_s']:10.4f} {run['minor_faults_per_iterate']:15.0f} "
              f"{run['full_run_s']:30.1f}  ({run['start']}, {run['step']}, {run['macro10']:.4f})")
    fast, dense, slow = runs["basis"], runs["basis-prev"], runs["unembed"]
    same = (fast["start"], fast["step"], fast["macro10"]) == (slow["start"], slow["step"], slow["macro10"])
    weight_diff = float((fast["weights"] - slow["weights"]).abs().max())
    print(f"ratio per iterate: {slow['iterate_s'] / fast['iterate_s']:.1f}x; full run: "
          f"{slow['full_run_s'] / fast['full_run_s']:.1f}x; same kept iterate and macro: {same} "
          f"(weights max |diff| {weight_diff:.1e})")
    print(f"this step against the previous one through the basis (dense backward, fresh temporaries): "
          f"{dense['iterate_s'] / fast['iterate_s']:.2f}x per iterate")
    if args.json:
        out = {"model": model.name, "items": len(items), "experts": args.experts, "steps": args.steps,
               "threads": torch.get_num_threads(), "same_kept_iterate": same, "weights_max_abs_diff": weight_diff,
               "ratio_iterate": slow["iterate_s"] / fast["iterate_s"],
               "ratio_full_run": slow["full_run_s"] / fast["full_run_s"],
               "ratio_iterate_previous_step": dense["iterate_s"] / fast["iterate_s"],
               "runs": {name: {k: v for k, v in run.items() if k != "weights"} for name, run in runs.items()}}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
