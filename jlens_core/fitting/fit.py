"""Fitting a Jacobian lens over a corpus, with checkpoints, resume and sharding (docs/method.md §3)."""

from __future__ import annotations

import io
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

import torch
from jaxtyping import Float, Int

from .._atomic import atomic_write
from ..lenses.experts import Clustering, ExpertLens
from ..lenses.fit_settings import FitPlan, FitRecord, FitSettings, plan_provenance
from ..lenses.kinds import relevance_backward
from ..lenses.lens import JacobianLens, half_rel_diff
from ..models.model import LensModel
from .estimator import jacobian_for_prompt
from .expert_clusters import cluster_source_layers, clustering_from_payload, clustering_payload
from .memory_budget import (
    FitSizes,
    budget_bytes,
    peak_measure,
    peak_memory_bytes,
    plan_memory,
    reset_peak_memory,
)
from .node_checkpoints import agree_on_checkpoint
from .precision import compute_model, resolve_fit_dtype
from .relevance import relevance_unsupported_reason, unsupported_message
from .resume import check_same_settings, prompts_digest

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "jlens-checkpoint"
CHECKPOINT_VERSION = 1
# Settings recorded in a checkpoint that shape the result (FitSettings and the model); resuming with another
# value is an error.
CHECKPOINT_SETTINGS = (*FitSettings.field_names(), "model_fingerprint")


@dataclass
class FitProgress:
    """What the ``progress`` callback of :func:`fit` receives, once per prompt.

    Attributes:
        prompt_index: index of the prompt in the list.
        n_total: prompts in the list.
        n_done: prompts that counted so far (this one included).
        next_idx: where the fit goes on from.
        skipped: the prompt had no valid position (or could not be encoded) and did not count.
        reason: why it was skipped.
        records: the per-layer diagnostics of this prompt (empty when skipped).
        max_rel_change: the largest relative change of the running mean over layers (None at first).
        seconds: time this prompt took.
        dim_batch: rows per backward pass this prompt used (``None`` when skipped).
        peak_memory_bytes: the memory peak reached so far (:func:`~jlens_core.fitting.memory_budget.peak_memory_bytes`:
            CUDA ``max_memory_allocated`` since the fit started; on the CPU the whole process's RSS high-water mark).
    """

    prompt_index: int
    n_total: int
    n_done: int
    next_idx: int
    skipped: bool = False
    reason: str | None = None
    records: list[dict] = field(default_factory=list)
    max_rel_change: float | None = None
    seconds: float = 0.0
    dim_batch: int | None = None
    peak_memory_bytes: int | None = None


@dataclass
class FitState:
    """Running state of a fit. ``jacobian_sum`` holds fp64 sums of per-prompt ``J_l`` (exact merges).

    An expert fit (docs/method.md §9.1) also holds ``expert_sum`` (``{l: Tensor[E, d, d]}`` fp64, the
    row blocks ``G_p`` summed per expert over every counted position), ``expert_count`` (``{l:
    Tensor[E]}`` fp64, positions per expert) and the fixed ``clustering``; all three empty otherwise.

    With halves (docs/method.md §3.3), ``half_sum`` holds ``{l: Tensor[2, d, d]}`` fp64, the sums of the even
    (``[0]``) and odd (``[1]``) prompts apart, ``half_n`` the prompts in each, and an expert fit also
    ``expert_half_sum`` (``{l: [2, E, d, d]}``) and ``expert_half_count`` (``{l: [2, E]}``); all empty without.
    A prompt's half is the parity of its index in the whole prompt list (``first_prompt + i``).
    """

    jacobian_sum: dict[int, Float[torch.Tensor, "d_model d_model"]]
    n_done: int = 0
    next_idx: int = 0
    n_skipped: int = 0
    diagnostics: list[dict] = field(default_factory=list)
    stop_reason: str | None = None
    expert_sum: dict[int, Float[torch.Tensor, "experts d_model d_model"]] = field(default_factory=dict)
    expert_count: dict[int, Int[torch.Tensor, " experts"]] = field(default_factory=dict)
    clustering: dict[int, Clustering] = field(default_factory=dict)
    half_sum: dict[int, Float[torch.Tensor, "2 d_model d_model"]] = field(default_factory=dict)
    half_n: list[int] = field(default_factory=lambda: [0, 0])
    expert_half_sum: dict[int, Float[torch.Tensor, "2 experts d_model d_model"]] = field(default_factory=dict)
    expert_half_count: dict[int, Float[torch.Tensor, "2 experts"]] = field(default_factory=dict)

    def mean(self, layer: int) -> Float[torch.Tensor, "d_model d_model"]:
        return self.jacobian_sum[layer] / self.n_done


class RankFailedError(RuntimeError):
    """Raised on every rank of a sharded fit once one rank failed; ``original`` is that rank's own error
    (``None`` on the ranks that did not fail)."""

    def __init__(self, message: str, rank: int, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.rank, self.original = rank, original


class World:
    """A process group for sharded fitting (``torch.distributed``); ``None`` means one process.

    ``rank`` is the global rank (it picks the prompts; rank 0 writes the lens and the run files);
    ``local_rank`` is the rank on this machine (``LOCAL_RANK``, set by torchrun; without it, the global
    rank): each machine's local rank 0 writes the checkpoint, so a node that does not share rank 0's
    disk still has one to resume from.
    """

    syncs_every_step = False  # ranks meet every ``checkpoint_every`` steps and at the end

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        backend = self.dist.get_backend()
        work = tensor.cuda() if backend == "nccl" else tensor
        self.dist.all_reduce(work)
        return work.to(tensor.device)

    def gather_objects(self, obj) -> list:
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=src)
        return box[0]

    def check_failures(self, error: BaseException | None) -> None:
        """Collective: if any rank passes an error, raise :class:`RankFailedError` on every rank, with the
        first failed rank's message (so the others stop with its error instead of waiting on it)."""
        flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
        if float(self.all_reduce_sum(flag)[0]) == 0.0:
            return
        messages = self.gather_objects(None if error is None else f"{type(error).__name__}: {error}")
        failed = next(r for r, message in enumerate(messages) if message is not None)
        raise RankFailedError(f"Rank {failed} of {self.size} failed: {messages[failed]}", failed, error)


def checkpoint_settings(settings: FitSettings, model_name: str | None, model_fingerprint: dict | None) -> dict:
    """The ``settings`` a checkpoint records: the resolved :class:`FitSettings` and the model's identity."""
    return {**settings.to_dict(), "model_name": model_name, "model_fingerprint": model_fingerprint}


def write_checkpoint(path: str | os.PathLike, state: FitState, settings: dict, digest: str) -> None:
    """Write the fit state atomically (temp file in the same folder, then rename); ``settings`` is
    :func:`checkpoint_settings`'s dict."""
    payload = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "settings": settings,
               "jacobian_sum": {str(k): v for k, v in state.jacobian_sum.items()}, "n_done": state.n_done,
               "next_idx": state.next_idx, "n_skipped": state.n_skipped, "diagnostics": state.diagnostics,
               "stop_reason": state.stop_reason, "prompts_digest": digest}
    if state.clustering:  # an expert fit: its sums, counts and clustering (docs/method.md §9.1)
        payload.update(expert_sum={str(k): v for k, v in state.expert_sum.items()},
                       expert_count={str(k): v for k, v in state.expert_count.items()},
                       clustering=clustering_payload(state.clustering))
    if state.half_sum:  # the split halves (docs/method.md §3.3); checkpoints without them resume without halves
        payload.update(half_sum={str(k): v for k, v in state.half_sum.items()}, half_n=list(state.half_n))
        if state.expert_half_sum:
            payload.update(expert_half_sum={str(k): v for k, v in state.expert_half_sum.items()},
                           expert_half_count={str(k): v for k, v in state.expert_half_count.items()})
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def checkpoint_from_lens(lens: JacobianLens, prompts: Sequence, path: str | os.PathLike) -> int:
    """Write a checkpoint that resumes a fit from a saved lens (one whose checkpoint was lost).

    The fp64 sums are ``lens.n_prompts * J_l`` from the lens, so a lens stored in fp16 carries its
    rounding (relative ~5e-4 per entry) into the prompts it already counted. ``prompts`` must be the
    original fit's prompt list (at least its first ``n_prompts + n_skipped`` entries, in order).

    Returns:
        The prompt index a resumed fit goes on at.

    Raises:
        ValueError: ``prompts`` is shorter than what the lens counted.
    """
    n_skipped = lens.record.n_skipped
    next_idx = lens.n_prompts + n_skipped
    if next_idx > len(prompts):
        raise ValueError(f"The lens counted {next_idx} prompts (skipped ones included) but only {len(prompts)} "
                         "were given: pass the prompt list of the original fit.")
    # a plain lens, even one made from an expert lens's combination: the checkpoint resumes a fit without experts
    settings = checkpoint_settings(lens.fit_settings.replace(experts=0), lens.model_name, lens.model_fingerprint)
    state = FitState({layer: lens.jacobians[layer].double() * lens.n_prompts for layer in lens.source_layers},
                     n_done=lens.n_prompts, next_idx=next_idx, n_skipped=n_skipped,
                     diagnostics=list(lens.diagnostics))
    raw = lens.raw_halves
    if raw is not None:  # its halves' sums too, so the resumed fit keeps them (with the same fp16 caveat)
        state.half_n = [raw[0].n_prompts, raw[1].n_prompts]
        state.half_sum = {layer: torch.stack([half.jacobians[layer].double() * half.n_prompts for half in raw])
                          for layer in lens.source_layers}
    write_checkpoint(path, state, settings, prompts_digest(prompts, next_idx))
    return next_idx


def read_checkpoint(path: str | os.PathLike, data: bytes | None = None) -> dict:
    """Load a checkpoint written by :func:`write_checkpoint` (from ``data``, its bytes, when given; ``path``
    then only names it in errors).

    Raises:
        ValueError: the file is not a jlens checkpoint or cannot be read.
    """
    try:
        payload = torch.load(path if data is None else io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"Cannot read the checkpoint {str(path)!r}: {exc}. Delete it (or pass resume=False / "
                         "--no-resume) to start over.") from exc
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{str(path)!r} is not a jlens fit checkpoint.")
    return payload


def _check_resume(path, payload: dict, settings: dict, prompts: Sequence) -> None:
    """Raise unless the checkpoint was made with ``settings`` (:func:`checkpoint_settings`) on ``prompts``."""
    # checkpoints from before rules= are J fits, from before experts= fits without experts: FitSettings' defaults
    saved = {**FitSettings.from_checkpoint(payload["settings"]).to_dict(),
             "model_fingerprint": payload["settings"].get("model_fingerprint")}
    if payload["settings"].get("dtype", "auto") == "auto":  # from before the dtype setting: goes on in this dtype
        saved["dtype"] = settings.get("dtype")
    check_same_settings(path, saved, settings, CHECKPOINT_SETTINGS, run="fit")
    if payload["next_idx"] > len(prompts) or prompts_digest(prompts, payload["next_idx"]) != payload["prompts_digest"]:
        raise ValueError(
            f"The checkpoint {str(path)!r} was made on another prompt list: its first {payload['next_idx']} "
            "prompts differ from these. Resume with the same corpus and order, or start over with resume=False.")


class _OneProcess:
    """:class:`World`'s interface for an unsharded fit: every collective is the identity."""

    rank, size, local_rank = 0, 1, 0
    syncs_every_step = True  # folding in a prompt costs nothing here, and keeps progress live

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_objects(self, obj) -> list:
        return [obj]

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def check_failures(self, error: BaseException | None) -> None:
        pass  # a prompt's error is raised where it happened


@dataclass
class _Pending:
    """This rank's contributions since the last sync: fp64 Jacobian sums, counts, diagnostics, events."""

    delta: dict[int, torch.Tensor]
    n: int = 0
    skipped: int = 0
    records: list[dict] = field(default_factory=list)
    events: list[FitProgress] = field(default_factory=list)
    expert_delta: dict[int, torch.Tensor] = field(default_factory=dict)  # {l: [E, d, d]} fp64
    count_delta: dict[int, torch.Tensor] = field(default_factory=dict)  # {l: [E]} fp64
    half_delta: dict[int, torch.Tensor] = field(default_factory=dict)  # {l: [2, d, d]} fp64: even, odd
    half_n: list[int] = field(default_factory=lambda: [0, 0])
    expert_half_delta: dict[int, torch.Tensor] = field(default_factory=dict)  # {l: [2, E, d, d]} fp64
    count_half_delta: dict[int, torch.Tensor] = field(default_factory=dict)  # {l: [2, E]} fp64

    def clear(self) -> None:
        for matrix in [*self.delta.values(), *self.expert_delta.values(), *self.count_delta.values(),
                       *self.half_delta.values(), *self.expert_half_delta.values(), *self.count_half_delta.values()]:
            matrix.zero_()
        self.n, self.skipped, self.records, self.events, self.half_n = 0, 0, [], [], [0, 0]


class _FitRun:
    """One fit, from its start (or checkpoint) to its lens: the state, this rank's pending part, the schedule.

    Rank ``r`` of ``K`` reads prompts ``r, r + K, ...``; each step reads one prompt per rank. One
    process folds every prompt into the state at once (cheap, keeps progress live); sharded ranks
    meet every ``checkpoint_every`` steps and at the end. ``world`` is :class:`World` or :class:`_OneProcess`.
    """

    def __init__(self, model: LensModel, prompts: Sequence, settings: FitSettings, plan: FitPlan, *,
                 world: World | _OneProcess, checkpoint_path: str | os.PathLike | None,
                 progress: Callable[[FitProgress], None] | None,
                 should_stop: Callable[[FitState], str | None] | None) -> None:
        """``settings``: resolved (:meth:`FitSettings.resolved`) for ``model``."""
        self.model, self.prompts, self.settings, self.plan, self.world = model, prompts, settings, plan, world
        # the model the Jacobians are computed with: a bf16 twin for a bf16 fit of an fp32 model (precision.py)
        self.compute = compute_model(model, settings.dtype) if settings.dtype != "auto" else model
        self.checkpoint_path, self.checkpoint_every = checkpoint_path, plan.checkpoint_every
        self.progress, self.should_stop = progress, should_stop
        self.sources: list[int] = list(settings.source_layers or ())
        self.target: int = int(settings.target_layer if settings.target_layer is not None else model.n_layers - 1)
        self.model_fingerprint = model.fingerprint()
        self.checkpoint_settings = checkpoint_settings(settings, model.name, self.model_fingerprint)
        # what jacobian_for_prompt takes besides the prompt, the layers and the clustering
        self.estimator: dict[str, Any] = {"dim_batch": plan.dim_batch, "max_seq_len": settings.max_seq_len,
                          "skip_first": settings.skip_first, "method": plan.method, "rules": settings.rules,
                          "max_memory": plan.max_memory}
        d = model.d_model
        self.state = FitState({layer: torch.zeros(d, d, dtype=torch.float64) for layer in self.sources})
        self.pending = _Pending({layer: torch.zeros(d, d, dtype=torch.float64) for layer in self.sources})
        self.halves = plan.halves  # off for good once resumed from a checkpoint without them
        if self.halves:
            self.state.half_sum = {layer: torch.zeros(2, d, d, dtype=torch.float64) for layer in self.sources}
            self.pending.half_delta = {layer: torch.zeros(2, d, d, dtype=torch.float64) for layer in self.sources}
        self.steps = 0
        self.experts: int = settings.experts
        self.memory: dict | None = None  # with a budget: the budget and its plan at max_seq_len (lens settings)
        self.peak_bytes: int | None = None

    def _expert_buffers(self, halves: bool = False) -> dict[int, torch.Tensor]:
        d = self.model.d_model
        shape = (2, self.experts, d, d) if halves else (self.experts, d, d)
        return {layer: torch.zeros(*shape, dtype=torch.float64) for layer in self.sources}

    def cluster(self) -> None:
        """An expert fit's clustering (docs/method.md §9.1), unless the checkpoint brought one: made on rank 0
        from the first ``cluster_prompts`` prompts and sent to every rank, so all route alike."""
        if not self.experts or self.state.clustering:
            self._allocate_experts()
            return
        error, clustering = None, None
        if self.world.rank == 0:
            try:
                clustering = cluster_source_layers(
                    self.model, self.prompts, self.sources, experts=self.experts,
                    cluster_prompts=self.settings.cluster_prompts, skip_first=self.settings.skip_first,
                    max_seq_len=self.settings.max_seq_len)
            except Exception as exc:  # sharded: the others must not wait for a clustering that never comes
                if self.world.size == 1:
                    raise
                error = exc
        self.world.check_failures(error)
        payload = self.world.broadcast_object(None if clustering is None else clustering_payload(clustering))
        self.state.clustering = clustering_from_payload(payload)
        self._allocate_experts()

    def _allocate_experts(self) -> None:
        if not self.experts:
            return
        if not self.state.expert_sum:
            self.state.expert_sum = self._expert_buffers()
            self.state.expert_count = {layer: torch.zeros(self.experts, dtype=torch.float64) for layer in self.sources}
        self.pending.expert_delta = self._expert_buffers()
        self.pending.count_delta = {layer: torch.zeros(self.experts, dtype=torch.float64) for layer in self.sources}
        if self.halves:
            if not self.state.expert_half_sum:
                self.state.expert_half_sum = self._expert_buffers(halves=True)
                self.state.expert_half_count = {layer: torch.zeros(2, self.experts, dtype=torch.float64)
                                                for layer in self.sources}
            self.pending.expert_half_delta = self._expert_buffers(halves=True)
            self.pending.count_half_delta = {layer: torch.zeros(2, self.experts, dtype=torch.float64)
                                             for layer in self.sources}

    def resume(self) -> None:
        """Go on from the checkpoint (its settings and prompts checked), if there is one."""
        path = self.checkpoint_path
        if path is None:
            return
        if self.world.size > 1:  # one copy per machine: every rank goes on from the most advanced one
            payload = agree_on_checkpoint(self.world, path, lambda data: read_checkpoint(path, data),
                                          lambda saved: _check_resume(path, saved, self.checkpoint_settings,
                                                                      self.prompts))
            if payload is None:
                return
        elif not Path(path).exists():
            return
        else:
            payload = read_checkpoint(path)
            _check_resume(path, payload, self.checkpoint_settings, self.prompts)
        self.state = FitState({int(k): v.double() for k, v in payload["jacobian_sum"].items()},
                              n_done=payload["n_done"], next_idx=payload["next_idx"], n_skipped=payload["n_skipped"],
                              diagnostics=list(payload["diagnostics"]), stop_reason=payload.get("stop_reason"))
        if "clustering" in payload:  # an expert fit: the same clustering, sums and counts
            self.state.clustering = clustering_from_payload(payload["clustering"])
            self.state.expert_sum = {int(k): v.double() for k, v in payload["expert_sum"].items()}
            self.state.expert_count = {int(k): v.double() for k, v in payload["expert_count"].items()}
        self._resume_halves(payload)
        log.info("Resuming from %s: %d prompts counted, going on at prompt %d.", path, self.state.n_done,
                 self.state.next_idx)

    def _resume_halves(self, payload: dict) -> None:
        """The checkpoint's halves (docs/method.md §3.3); a checkpoint without them (older, or made with
        ``halves=False``) that counted prompts leaves this fit without halves: they would not be exact."""
        if not self.halves:
            return
        with_halves = "half_sum" in payload and (not self.experts or "expert_half_sum" in payload)
        if not with_halves:
            if self.state.n_done > 0:
                log.info("The checkpoint has no split halves: the lens will have none (docs/method.md §3.3).")
                self.halves = False
                self.state.half_sum, self.pending.half_delta = {}, {}
            return
        self.state.half_sum = {int(k): v.double() for k, v in payload["half_sum"].items()}
        self.state.half_n = [int(n) for n in payload["half_n"]]
        if self.experts:
            self.state.expert_half_sum = {int(k): v.double() for k, v in payload["expert_half_sum"].items()}
            self.state.expert_half_count = {int(k): v.double() for k, v in payload["expert_half_count"].items()}

    def run(self) -> None:
        """Step until every prompt is read or ``should_stop`` says stop."""
        while self.state.next_idx < len(self.prompts) and self.state.stop_reason is None:
            self._step()

    def _step(self) -> None:
        state, world, n_total = self.state, self.world, len(self.prompts)
        idx = state.next_idx + world.rank
        error = None
        if idx < n_total:
            try:
                self._read_prompt(idx)
            except Exception as exc:  # sharded: tell the other ranks before stopping, so none waits on us
                if world.size == 1:
                    raise
                error = exc
        world.check_failures(error)
        state.next_idx = min(state.next_idx + world.size, n_total)
        self.steps += 1
        at_end = state.next_idx >= n_total
        on_schedule = self.steps % self.checkpoint_every == 0
        if not (world.syncs_every_step or on_schedule or at_end):
            return
        events = self._sync(final=at_end)
        # each machine's local rank 0 writes: every rank holds the same state here
        if self.checkpoint_path is not None and world.local_rank == 0 and (on_schedule or at_end or state.stop_reason):
            write_checkpoint(self.checkpoint_path, state, self.checkpoint_settings,
                             prompts_digest(self.prompts, state.next_idx))
        # reported once the checkpoint holds them: a stop after a reported prompt never finds it a prompt behind
        if world.rank == 0 and self.progress is not None:
            for event in events:
                self.progress(event)

    def _read_prompt(self, idx: int) -> None:
        """Add prompt ``idx``'s Jacobians and diagnostics to the pending part (or record it skipped)."""
        pending, n_total, d = self.pending, len(self.prompts), self.model.d_model
        t0 = time.perf_counter()
        try:
            result = jacobian_for_prompt(self.compute, self.prompts[idx], source_layers=self.sources,
                                         target_layer=self.target, **self.estimator,
                                         clustering=self.state.clustering or None)
        except ValueError as exc:  # too short, or empty: skipped, and said so
            log.warning("Skipping prompt %d: %s", idx, exc)
            pending.skipped += 1
            pending.events.append(FitProgress(idx, n_total, 0, 0, skipped=True, reason=str(exc),
                                              seconds=time.perf_counter() - t0))
            return
        seconds = time.perf_counter() - t0
        n_before = self.state.n_done + pending.n
        half = (self.plan.first_prompt + idx) % 2  # parity in the whole prompt list (docs/method.md §3.3)
        if self.halves:
            pending.half_n[half] += 1
        records = []
        prompt_hash = prompts_digest([self.prompts[idx]], 1)[:12]
        for layer in self.sources:
            jac = result.jacobians[layer].double()
            rel = None
            if n_before > 0:
                mean_before = (self.state.jacobian_sum[layer] + pending.delta[layer]) / n_before
                rel = float((jac - mean_before).norm() / ((n_before + 1) * mean_before.norm()))
            pending.delta[layer] += jac
            if result.expert_sums is not None and result.expert_counts is not None:
                pending.expert_delta[layer] += result.expert_sums[layer].double()
                pending.count_delta[layer] += result.expert_counts[layer].double()
                if self.halves:
                    pending.expert_half_delta[layer][half] += result.expert_sums[layer].double()
                    pending.count_half_delta[layer][half] += result.expert_counts[layer].double()
            record: dict[str, Any] = {"prompt_index": idx, "layer": layer, "seq_len": result.seq_len,
                                      "n_valid": result.n_valid, "seconds": round(seconds, 4),
                                      "jacobian_norm": float(jac.norm() / math.sqrt(d)), "rel_change": rel}
            if layer == self.sources[0]:  # which text, once per prompt: the drift check matches rows by it
                record["prompt_hash"] = prompt_hash
            if self.halves:
                pending.half_delta[layer][half] += jac
                record["half"] = half
                record["half_rel_diff"] = self._half_rel_diff(layer)
            records.append(record)
        pending.n += 1
        pending.records.extend(records)
        rels = [r["rel_change"] for r in records if r["rel_change"] is not None]
        self.peak_bytes = peak_memory_bytes(self.model.device)
        pending.events.append(FitProgress(idx, n_total, 0, 0, records=records,
                                          max_rel_change=max(rels) if rels else None, seconds=seconds,
                                          dim_batch=result.dim_batch, peak_memory_bytes=self.peak_bytes))

    def _half_rel_diff(self, layer: int) -> float | None:
        """``||e - o||_F / ||m||_F`` of the running means of this rank's view (the state and its pending part),
        once both halves hold a prompt (docs/method.md §3.3)."""
        state, pending = self.state, self.pending
        n = [state.half_n[h] + pending.half_n[h] for h in (0, 1)]
        if min(n) == 0:
            return None
        sums = state.half_sum[layer] + pending.half_delta[layer]  # [2, d, d]
        full = (sums[0] + sums[1]) / (n[0] + n[1])
        return half_rel_diff(full, sums[0] / n[0], sums[1] / n[1])

    def _sync(self, final: bool) -> list[FitProgress]:
        """Fold every rank's pending part into the state and ask ``should_stop``; returns the progress events."""
        state, world, pending = self.state, self.world, self.pending
        for layer in self.sources:
            state.jacobian_sum[layer] += world.all_reduce_sum(pending.delta[layer])
            if self.experts:  # sums and counts add over ranks like the pooled sums
                state.expert_sum[layer] += world.all_reduce_sum(pending.expert_delta[layer])
                state.expert_count[layer] += world.all_reduce_sum(pending.count_delta[layer])
            if self.halves:  # and so do the halves'
                state.half_sum[layer] += world.all_reduce_sum(pending.half_delta[layer])
                if self.experts:
                    state.expert_half_sum[layer] += world.all_reduce_sum(pending.expert_half_delta[layer])
                    state.expert_half_count[layer] += world.all_reduce_sum(pending.count_half_delta[layer])
        counts = world.all_reduce_sum(torch.tensor([pending.n, pending.skipped, *pending.half_n], dtype=torch.float64))
        state.half_n = [state.half_n[0] + int(counts[2]), state.half_n[1] + int(counts[3])]
        records = sorted((r for part in world.gather_objects(pending.records) for r in part),
                         key=lambda r: (r["prompt_index"], r["layer"]))
        events = sorted((e for part in world.gather_objects(pending.events) for e in part),
                        key=lambda e: e.prompt_index)
        pending.clear()
        n_running = state.n_done
        state.n_done += int(counts[0])
        state.n_skipped += int(counts[1])
        state.diagnostics.extend(records)
        for event in events:
            n_running += 0 if event.skipped else 1
            event.n_done, event.next_idx = n_running, state.next_idx
        if self.should_stop is not None and state.n_done > 0 and not final:
            reason = world.broadcast_object(self.should_stop(state) if world.rank == 0 else None)
            if reason:
                state.stop_reason = reason
        return events

    def lens(self) -> JacobianLens | ExpertLens:
        """The fitted lens: the mean of the counted prompts' ``J_l`` (with ``experts``, an :class:`ExpertLens`
        whose pooled matrices are that mean and whose experts are ``expert_sum / expert_count``).

        Raises:
            ValueError: no prompt counted.
        """
        state, skip_first = self.state, self.settings.skip_first
        if state.n_done == 0:
            raise ValueError(f"No prompt counted: all {len(self.prompts)} prompts were skipped (each needs at least "
                             f"{skip_first + 2} tokens with skip_first={skip_first}). Give longer prompts.")
        memory = None if self.memory is None else {**self.memory, "peak_bytes": self.peak_bytes,
                                                   "peak_measure": peak_measure(self.model.device)}
        record = FitRecord(model_name=self.model.name, model_fingerprint=self.model_fingerprint,
                           n_prompts=state.n_done, n_skipped=state.n_skipped, diagnostics=tuple(state.diagnostics),
                           stop_reason=state.stop_reason, provenance=plan_provenance(self.plan, memory=memory))
        halves = None
        if self.halves:  # the even and odd halves: the means of their own prompts (zeros for a half without any)
            halves = tuple(self._lens_of_sums(h, record.for_half(state.half_n[h])) for h in (0, 1))
        return self._lens_of_sums(None, record, halves=halves)

    def _lens_of_sums(self, half: int | None, record: FitRecord, *, halves: tuple | None = None
                      ) -> JacobianLens | ExpertLens:
        """A lens of the fit's class from its running sums: the whole fit's (``half=None``), or the even (0) or odd
        (1) prompts' (docs/method.md §3.3), with ``record`` (its prompts: ``record.n_prompts``) and ``halves``."""
        state, n = self.state, record.n_prompts
        shape: dict[str, Any] = {"d_model": self.model.d_model, "n_layers": self.model.n_layers}
        if half is None:
            pooled = {layer: state.mean(layer).float() for layer in self.sources}
        else:
            pooled = {layer: (state.half_sum[layer][half] / max(n, 1)).float() for layer in self.sources}
        if not self.experts:
            return JacobianLens.from_fit(pooled, self.settings, record, halves=halves, **shape)
        sums, counts = ((state.expert_sum, state.expert_count) if half is None else
                        ({layer: state.expert_half_sum[layer][half] for layer in self.sources},
                         {layer: state.expert_half_count[layer][half] for layer in self.sources}))
        return ExpertLens.from_fit(pooled, {layer: (sums[layer] / counts[layer].clamp_min(1)[:, None, None]).float()
                                            for layer in self.sources},
                                   {layer: counts[layer].round().long() for layer in self.sources}, state.clustering,
                                   self.settings, record, halves=halves, **shape)


def _plan_fit_memory(model: LensModel, settings: FitSettings, plan: FitPlan) -> dict:
    """The budget's plan for the longest prompt (``max_seq_len`` tokens), before any prompt: a budget too small
    raises here (each prompt would otherwise be skipped for it). Returns the lens settings' ``memory`` part.
    ``settings`` are resolved; ``plan.max_memory`` is set."""
    from .estimator import _fused_usable

    assert plan.max_memory is not None and settings.source_layers and settings.target_layer is not None
    budget = budget_bytes(plan.max_memory)
    skip_first = settings.skip_first
    n_valid = max(1, settings.max_seq_len - 1 - skip_first)
    method = plan.method
    if method == "auto":
        method = "fused" if _fused_usable(model) else "batched"
    sources = list(settings.source_layers)
    sizes = FitSizes.of(model, n_valid=n_valid, layers_backward=settings.target_layer - sources[0],
                        n_sources=len(sources), skip_first=skip_first, experts=settings.experts)
    dim_batch = plan.dim_batch
    planned = plan_memory(sizes, budget, method, None if isinstance(dim_batch, str) else dim_batch)
    return {"budget_bytes": budget, "method": method, "dim_batch_at_max_seq_len": planned.dim_batch,
            "layer_major": planned.layer_major, "planned_bytes": planned.planned_bytes}


class FitKeywords(TypedDict, total=False):
    """The fields of :class:`FitSettings` and :class:`FitPlan` that :func:`fit` also takes as keywords (as it
    did before the settings were types); each replaces that field of ``settings`` / ``plan``."""

    source_layers: Sequence[int] | None
    target_layer: int | None
    skip_first: int
    max_seq_len: int
    rules: str
    cluster_prompts: int
    dim_batch: int | str
    max_memory: int | str | None
    method: str
    checkpoint_every: int
    first_prompt: int
    halves: bool


class FitRunOptions(FitKeywords, total=False):
    """:func:`fit`'s keywords besides its named parameters: :class:`FitKeywords` (fields of the settings and the
    plan), ``resume`` (go on from ``checkpoint_path`` when it exists; default ``True``) and ``world`` (a
    :class:`World` to shard over; default one process)."""

    resume: bool
    world: World | None


def fit_settings_and_plan(settings: FitSettings | None = None, plan: FitPlan | None = None,
                          **keywords: object) -> tuple[FitSettings, FitPlan]:
    """``settings`` and ``plan`` (defaults when ``None``) with the fields named in ``keywords`` replaced.

    Raises:
        TypeError: a keyword that is a field of neither (one sentence naming the known ones).
        ValueError: a bad value (one sentence naming it).
    """
    settings = settings if settings is not None else FitSettings()
    plan = plan if plan is not None else FitPlan()
    for value, want, name in ((settings, FitSettings, "settings"), (plan, FitPlan, "plan")):
        if not isinstance(value, want):
            raise TypeError(f"fit()'s {name} must be a {want.__name__}, not a {type(value).__name__}: pass "
                            "FitSettings third (or settings=) and FitPlan fourth (or plan=).")
    unknown = [key for key in keywords if key not in FitSettings.field_names() and key not in FitPlan.field_names()]
    if unknown:
        raise TypeError(f"fit() has no setting {unknown[0]!r}: the known ones are "
                        f"{', '.join(FitSettings.field_names() + FitPlan.field_names())}.")
    # the plan first: its errors (checkpoint_every, method, dim_batch) came first before settings were types
    plan = plan.replace(**{k: v for k, v in keywords.items() if k in FitPlan.field_names()})
    settings = settings.replace(**{k: v for k, v in keywords.items() if k in FitSettings.field_names()})
    return settings, plan


@overload
def fit(model: LensModel, prompts: Sequence, settings: None = None, plan: FitPlan | None = None, *,
        experts: Literal[0] | None = None, checkpoint_path: str | os.PathLike | None = None,
        progress: Callable[[FitProgress], None] | None = None,
        should_stop: Callable[[FitState], str | None] | None = None,
        **keywords: Unpack[FitRunOptions]) -> JacobianLens: ...


@overload
def fit(model: LensModel, prompts: Sequence, settings: FitSettings | None = None, plan: FitPlan | None = None, *,
        experts: int | None = None, checkpoint_path: str | os.PathLike | None = None,
        progress: Callable[[FitProgress], None] | None = None,
        should_stop: Callable[[FitState], str | None] | None = None,
        **keywords: Unpack[FitRunOptions]) -> JacobianLens | ExpertLens: ...


def fit(model: LensModel, prompts: Sequence, settings: FitSettings | None = None, plan: FitPlan | None = None, *,
        experts: int | None = None, checkpoint_path: str | os.PathLike | None = None,
        progress: Callable[[FitProgress], None] | None = None,
        should_stop: Callable[[FitState], str | None] | None = None,
        **keywords: Unpack[FitRunOptions]) -> JacobianLens | ExpertLens:
    """Fit a Jacobian lens: the plain mean of per-prompt ``J_l`` over the prompts with valid positions.

    Args:
        model: an :class:`~jlens_core.models.model.HFLensModel`.
        prompts: texts (or token-id sequences), in a fixed order.
        settings: what shapes the lens (:class:`~jlens_core.lenses.fit_settings.FitSettings`: source and target
            layers, ``skip_first``, ``max_seq_len``, ``rules``, ``experts``, ``cluster_prompts``); default
            ``FitSettings()``. ``rules="relevance"`` is the R-lens (the same average with the relevance rules in
            the backward, docs/method.md §9.1). ``experts=E > 0`` also fits ``E`` expert Jacobians per source
            layer in the same backward passes (docs/method.md §9.1, experts): the first ``cluster_prompts``
            prompts' kept positions are clustered per layer first, then every source position's row block is
            added to its cluster's sum. That holds ``E d^2`` fp64 sums per source layer twice (state and pending)
            and fp32 once per prompt: ``20 E d^2`` bytes per layer (SmolLM2-135M, E = 8, 29 layers: 1.5 GB).
        plan: how it runs (:class:`~jlens_core.lenses.fit_settings.FitPlan`: ``dim_batch``, ``method`` as in
            :func:`~jlens_core.fitting.estimator.jacobian_for_prompt`; ``checkpoint_every``; ``max_memory``, a
            budget (bytes, or ``"6GiB"``) for one prompt's working memory on each device the layers run on,
            beyond the model's weights and the fit's running sums (docs/fitting.md, memory budget): ``dim_batch``
            and the fused order follow from it per prompt, checked before the first prompt at ``max_seq_len``;
            the lens settings record it, the plan and the peak reached). Default ``FitPlan()``.
        experts, **keywords: any field of ``settings`` or ``plan`` by name (:class:`FitKeywords`), replacing it:
            ``fit(model, prompts, skip_first=2, dim_batch=16)`` as before the settings were types.
        checkpoint_path: if given, the running state is written there atomically every
            ``checkpoint_every`` prompts and at the end, and (with ``resume``) read back to go on.
        progress: called once per prompt (on rank 0) with a :class:`FitProgress`.
        should_stop: called after each prompt (each sync when sharded) with the state; a non-empty
            string stops the fit early and is recorded as the lens's ``stop_reason``.
        world: a :class:`World` to shard prompts over ``torch.distributed`` ranks (rank ``r`` fits
            prompts ``r, r + K, ...``; sums are all-reduced at each checkpoint and at the end).

    Returns:
        The fitted :class:`~jlens_core.lenses.lens.JacobianLens`, with the diagnostics of every prompt x layer;
        with ``experts``, an :class:`~jlens_core.lenses.experts.ExpertLens` (its pooled lens is the same mean).
        Its ``fit_settings`` are the resolved settings, its ``record`` what the fit recorded.

    Raises:
        TypeError: a keyword that is no setting.
        ValueError: bad layers or settings (unknown ``rules`` included), ``rules="relevance"`` on a model
            the rules do not cover, a checkpoint made with other settings (rules, experts included) or
            prompts, no prompt with a valid position, ``experts < 0``, ``cluster_prompts < 1``, or fewer
            kept positions in the cluster prompts than ``experts``, or a ``max_memory`` too small for one
            row per backward pass (``MemoryBudgetError``, with the bytes needed).
        RankFailedError: sharded, on every rank, once a rank failed on a prompt (with its error).
    """
    resume: bool = keywords.pop("resume", True)
    world: World | None = keywords.pop("world", None)
    if experts is not None:
        keywords = {**keywords, "experts": experts}  # type: ignore[typeddict-unknown-key]
    settings, plan = fit_settings_and_plan(settings, plan, **keywords)
    settings = settings.resolved(model.n_layers)
    settings = settings.replace(dtype=resolve_fit_dtype(settings.dtype, model))
    if relevance_backward(settings.rules):  # before any prompt: per prompt it would read as "skipped"
        reason = relevance_unsupported_reason(model)
        if reason is not None:
            raise ValueError(unsupported_message(model, reason))
    memory = None
    if plan.max_memory is not None:
        memory = _plan_fit_memory(model, settings, plan)
        plan = plan.replace(max_memory=memory["budget_bytes"])
    run = _FitRun(model, prompts, settings, plan, world=world if world is not None else _OneProcess(),
                  checkpoint_path=checkpoint_path, progress=progress, should_stop=should_stop)
    if resume:
        run.resume()
    run.memory = memory
    run.cluster()
    reset_peak_memory(model.device)
    t_start = time.perf_counter()
    run.run()
    lens = run.lens()
    log.info("Fit done: %d prompts counted, %d skipped, %.1f s.", lens.n_prompts, run.state.n_skipped,
             time.perf_counter() - t_start)
    # -- lens check (docs/method.md §4.2): the forward canary, made once the matrices are done -- #
    from ..lenses.canary import make_canary

    lens = lens.replace(canary=make_canary(model, lens))
    from ..lenses.provenance import PROVENANCE_KEY, model_provenance

    # versions, revision, capture point (docs/sharing.md): one entry of the record's provenance, the file's settings
    return lens.replace(provenance={**lens.record.provenance, PROVENANCE_KEY: model_provenance(model)})
