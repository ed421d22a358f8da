"""``jlens fit`` and ``jlens merge``.

``jlens fit`` streams one JSON record per prompt x layer to ``<LENS>.diagnostics.jsonl`` (flushed
per prompt) and its state to ``<LENS>.status.json``, so another program (the app) can follow a
fit it did not start. Under ``torchrun`` each rank fits every K-th prompt; rank 0 writes the lens and
these files, and each machine's local rank 0 writes its copy of the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from .._atomic import atomic_write_text
from ..fitting.runfiles import sidecar  # the run-file format, shared with the app
from ..lenses.fit_settings import FitPlan, FitSettings, add_fit_arguments
from .main import CLIError, say
from .model_args import (
    add_corpus_arguments,
    add_model_command,
    add_save_dtype_argument,
    model_loading_options,
    placement_requested,
)

log = logging.getLogger(__name__)


class StopAtDelta:
    """Stop once the max (over layers) relative change of the running mean stays below ``threshold``
    for ``patience`` prompts in a row."""

    def __init__(self, threshold: float, patience: int = 5) -> None:
        if threshold <= 0:
            raise CLIError(f"--stop-at-delta {threshold} must be > 0.")
        if patience < 1:
            raise CLIError(f"--stop-patience {patience} must be >= 1.")
        self.threshold, self.patience = threshold, patience

    def __call__(self, state) -> str | None:
        per_prompt: dict[int, float] = {}
        for rec in reversed(state.diagnostics):
            if rec["rel_change"] is None:
                break
            idx = rec["prompt_index"]
            per_prompt[idx] = max(per_prompt.get(idx, 0.0), rec["rel_change"])
            if len(per_prompt) > self.patience:
                break
        last = [per_prompt[i] for i in sorted(per_prompt)[-self.patience:]]
        if len(last) == self.patience and max(last) < self.threshold:
            return (f"max relative change of the running mean below {self.threshold:g} for {self.patience} "
                    f"prompts in a row (last {max(last):.3g}) after {state.n_done} prompts")
        return None


class StatusFile:
    """``<LENS>.status.json``: what a watcher needs (state, counts, timing, error), rewritten atomically."""

    def __init__(self, path: Path, **fields) -> None:
        self.path = path
        self.data = {"state": "starting", "pid": os.getpid(), "started": time.time(), **fields}
        self.write()

    def write(self, **fields) -> None:
        self.data.update(fields, updated=time.time())
        atomic_write_text(self.path, json.dumps(self.data, indent=1), shared=True)


def _init_world(device: str | None):
    """Join the torchrun process group when launched by torchrun (WORLD_SIZE > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, device
    import torch
    import torch.distributed as dist

    from ..fitting.fit import World

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = device if device not in (None, "cuda") else f"cuda:{local_rank}"
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return World(), device or "cpu"


def _interruptible() -> None:
    """Make SIGINT (Ctrl-C, the app's Stop) raise KeyboardInterrupt: the fit then stops with its checkpoint.

    A process started as a background job of a non-interactive shell (``cmd &`` in a script, CI)
    inherits SIGINT *ignored*, and Python then installs no handler, so a Stop would be lost.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def cmd_fit(args: argparse.Namespace) -> int:
    from ..corpus import load_corpus
    from ..fitting.fit import fit
    from ..layerspec import check_layer_spec, fit_source_layers
    from ..models.loading import load_model

    if args.layers:
        check_layer_spec(args.layers)
    if args.n_prompts is not None and args.n_prompts < 1:
        raise CLIError(f"--n-prompts {args.n_prompts} must be >= 1.")
    if args.first_prompt < 0:
        raise CLIError(f"--first-prompt {args.first_prompt} must be >= 0.")
    stop = StopAtDelta(args.stop_at_delta, args.stop_patience) if args.stop_at_delta else None
    out = Path(args.out)
    if out.is_dir():
        raise CLIError(f"--out {args.out!r} is a folder; give a file path such as {args.out.rstrip('/')}/lens.safetensors.")
    _interruptible()
    world, device = _init_world(args.device)
    rank = world.rank if world is not None else 0
    try:
        prompts = load_corpus(args.corpus, min_chars=args.min_chars, split=args.split)
        if args.first_prompt >= len(prompts):
            raise CLIError(f"--first-prompt {args.first_prompt} is past the end of the corpus ({len(prompts)} texts).")
        end = len(prompts) if args.n_prompts is None else args.first_prompt + args.n_prompts
        prompts = prompts[args.first_prompt: end]
        # a device map places the model itself; otherwise the rank's device (torchrun) or --device
        options = model_loading_options(args) | ({} if placement_requested(args) else {"device": device})
        model = load_model(args.model, **options, progress=say)
        sources = fit_source_layers(args.layers, model.n_layers, args.target_layer)
        checkpoint = Path(args.checkpoint) if args.checkpoint else sidecar(out, "ckpt")
        if args.resume_from:
            if world is not None:
                raise CLIError("--resume-from runs in one process: continue the reference checkpoint without torchrun "
                               "for a step (--n-prompts), then shard the jlens checkpoint it writes.")
            _from_reference_checkpoint(args, model, prompts, sources, checkpoint)
        if rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
        try:
            settings = FitSettings.from_args(args, source_layers=sources)
            plan = FitPlan.from_args(args)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
        code = _run_fit(args, model, prompts, settings, plan, checkpoint, stop, world, out, fit)
        if world is not None:
            world.dist.barrier()  # ranks leave together, once rank 0 has written the lens
            world.dist.destroy_process_group()
            world = None
            # Gloo's worker threads can still hold tensors with Python references when the interpreter
            # finalizes, which aborts the process (SIGABRT, "terminate called without an active
            # exception") after a successful fit and makes torchrun report the rank as failed. The lens
            # and every sidecar file are written and closed by now: leave without finalization.
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(code)
        return code
    finally:
        if world is not None:
            world.dist.destroy_process_group()


def _from_reference_checkpoint(args, model, prompts, sources, checkpoint: Path) -> None:
    """``--resume-from``: the reference library's checkpoint as this fit's checkpoint (docs/sharing.md)."""
    from ..fitting.reference_checkpoints import checkpoint_from_reference

    if checkpoint.exists() and not args.no_resume:
        raise CLIError(f"The checkpoint {str(checkpoint)!r} exists: resume it without --resume-from, or give "
                       "--no-resume to start over from the reference checkpoint.")
    args.no_resume = False
    try:
        settings = FitSettings.from_args(args, source_layers=sources)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    next_idx = checkpoint_from_reference(args.resume_from, checkpoint, model, prompts, settings)
    say(f"continuing the reference checkpoint {args.resume_from} at prompt {next_idx}")


def _run_fit(args, model, prompts, settings: FitSettings, plan: FitPlan, checkpoint, stop, world, out, fit) -> int:
    rank = world.rank if world is not None else 0
    diag_path, status_path = sidecar(out, "diagnostics.jsonl"), sidecar(out, "status.json")
    status = diag_file = bar = None
    if world is not None and not args.no_resume:  # rank 0's copy may be behind another machine's: agree first
        from ..fitting.fit import read_checkpoint
        from ..fitting.node_checkpoints import agree_on_checkpoint

        agree_on_checkpoint(world, checkpoint, lambda data: read_checkpoint(checkpoint, data))
    if rank == 0:
        status = StatusFile(status_path, out=str(out), model=model.name, corpus=args.corpus, n_total=len(prompts),
                            diagnostics=str(diag_path), checkpoint=str(checkpoint),
                            world_size=world.size if world else 1)
        resumed = []
        if checkpoint.exists() and not args.no_resume:
            from ..fitting.fit import read_checkpoint

            resumed = read_checkpoint(checkpoint)["diagnostics"]
        diag_file = open(diag_path, "w", encoding="utf-8")  # noqa: SIM115 -- closed in finally; rewritten from the checkpoint, then appended
        diag_file.writelines(json.dumps(rec) + "\n" for rec in resumed)
        diag_file.flush()
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), unit="prompt", dynamic_ncols=True, file=sys.stderr,
                       desc=f"fit {model.name}")
    t_start, first_idx = time.time(), None

    def on_progress(event) -> None:
        nonlocal first_idx
        if diag_file is None or status is None:  # only rank 0 reports progress, and it has both
            return
        first_idx = event.prompt_index if first_idx is None else first_idx
        diag_file.writelines(json.dumps(rec) + "\n" for rec in event.records)
        diag_file.flush()
        done_here = event.next_idx - first_idx
        rate = (time.time() - t_start) / max(done_here, 1)
        eta = rate * (event.n_total - event.next_idx)
        status.write(state="running", n_done=event.n_done, next_idx=event.next_idx, seconds_per_prompt=rate,
                     eta_seconds=eta, max_rel_change=event.max_rel_change,
                     last_skipped=event.reason if event.skipped else None, dim_batch=event.dim_batch,
                     peak_memory_bytes=event.peak_memory_bytes)
        if bar is not None:
            bar.n = event.next_idx
            delta = "-" if event.max_rel_change is None else f"{event.max_rel_change:.2e}"
            from ..models.device_maps import format_bytes

            peak = "" if event.peak_memory_bytes is None else f" peak {format_bytes(event.peak_memory_bytes)}"
            bar.set_postfix_str(f"{event.seconds:.1f}s/prompt max\u0394={delta}{peak}" +
                                (" (skipped)" if event.skipped else ""), refresh=True)

    try:
        lens = fit(model, prompts, settings, plan, checkpoint_path=checkpoint, resume=not args.no_resume,
                   progress=on_progress if rank == 0 else None, should_stop=stop, world=world)
    except BaseException as exc:
        from ..fitting.fit import RankFailedError

        failed = exc if isinstance(exc, RankFailedError) else None
        if status is not None:
            state = "stopped" if isinstance(exc, KeyboardInterrupt) else "failed"
            tb = traceback.format_exc() if state == "failed" else None
            if failed is not None:
                tb = "".join(traceback.format_exception(failed.original)) if failed.original is not None else None
            status.write(state=state, error=str(exc) if failed is not None else f"{type(exc).__name__}: {exc}",
                         traceback=tb, failed_rank=failed.rank if failed is not None else None)
        if failed is not None:
            world.dist.barrier()  # no rank exits (and gets the others killed) before rank 0 has said why
            if failed.original is not None:  # the rank that failed shows its own error (a traceback if a bug)
                raise failed.original from None
            raise CLIError(str(exc)) from None
        raise
    finally:
        if bar is not None:
            bar.close()
        if diag_file is not None:
            diag_file.close()
    if status is not None:  # rank 0
        # where jlens check --refit reads its prompts (docs/sharing.md)
        lens = lens.replace(corpus=args.corpus, provenance={**lens.record.provenance, "split": args.split})
        lens.save(out, dtype=args.save_dtype)
        status.write(state="done", n_done=lens.n_prompts, stop_reason=lens.stop_reason, lens=str(out),
                     seconds=time.time() - t_start)
        print(f"Wrote {out}: {lens.n_prompts} prompts, layers {lens.source_layers[0]}..{lens.source_layers[-1]} "
              f"-> {lens.target_layer}, {_size(out, lens)}"
              + (f"; stopped early: {lens.stop_reason}" if lens.stop_reason else ""), file=sys.stderr)
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from ..lenses.experts import ExpertLens, is_expert_lens_file
    from ..lenses.lens import JacobianLens

    merged: JacobianLens | ExpertLens
    if any(is_expert_lens_file(path) for path in args.lenses):  # expert lenses: sums and counts add
        merged = ExpertLens.merge([ExpertLens.load(path) for path in args.lenses])
    else:
        merged = JacobianLens.merge([JacobianLens.load(path) for path in args.lenses])
    merged.save(args.out, dtype=args.save_dtype, halves=not args.no_halves)
    print(f"Wrote {args.out}: {merged.n_prompts} prompts from {len(args.lenses)} lenses, "
          f"{_size(Path(args.out), merged, kept=not args.no_halves)}.", file=sys.stderr)
    return 0


def _size(path: Path, lens, kept: bool = True) -> str:
    """The file's size, and whether the split halves (about 2/3 of it) are in it."""
    size = path.stat().st_size
    text = f"{size / 2**20:.1f} MB" if size >= 2**20 else f"{size / 2**10:.0f} kB"
    if lens.raw_halves is not None and kept:
        return f"{text} with its split halves (about 3x the lens alone; --no-halves leaves them out)"
    return text


def register(subparsers) -> None:
    p = add_model_command(subparsers, "fit", help="fit a Jacobian lens on a corpus",
                          description="Fit a Jacobian lens: d_model backward passes per prompt, averaged over "
                                      "the corpus. Resumable; under torchrun, sharded over ranks.",
                          device_help="cuda, cuda:1, mps, cpu, or auto (spread over GPUs); default: best")
    add_corpus_arguments(p, split="fit", split_help="corpus part: 'fit' (default; disjoint from 'eval'), 'eval' or 'all'")
    p.add_argument("--out", required=True, help="lens file to write (safetensors), e.g. lens.safetensors")
    p.add_argument("--n-prompts", type=int, default=None, help="use N texts of the corpus from --first-prompt on (default all)")
    add_fit_arguments(p)  # the fields of FitSettings and FitPlan: names, defaults and help live there
    p.add_argument("--checkpoint", default=None, help="checkpoint file (default <OUT stem>.ckpt next to --out)")
    p.add_argument("--no-resume", action="store_true", help="start over even if the checkpoint exists")
    p.add_argument("--resume-from", default=None, metavar="CKPT",
                   help="continue a reference jlens fit checkpoint (jacobian_sum, n_done, next_idx, ...) on the same "
                        "corpus in the same order: written as this fit's --checkpoint, then resumed")
    p.add_argument("--stop-at-delta", type=float, default=None,
                   help="stop once the max relative change of the running mean stays below X")
    p.add_argument("--stop-patience", type=int, default=5,
                   help="prompts in a row below --stop-at-delta before stopping (default 5)")
    add_save_dtype_argument(p, "storage precision of the lens file (default float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (diagnostics are still written)")
    p.set_defaults(func=cmd_fit)

    m = subparsers.add_parser("merge", help="merge lenses fitted on disjoint prompt sets",
                              description="n_prompts-weighted mean of lenses; refuses different layers, widths, "
                                          "settings or models.")
    m.add_argument("lenses", nargs="+", help="lens files to merge")
    m.add_argument("--out", required=True, help="merged lens file to write")
    m.add_argument("--no-halves", action="store_true",
                   help="write no split halves, even where every lens keeps them (default: keep them, docs/method.md "
                        "§3.3, which makes the file about 3x the size)")
    add_save_dtype_argument(m, "storage precision")
    m.set_defaults(func=cmd_merge)
