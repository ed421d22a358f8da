"""The arrays :func:`~jlens_core.reading.reader.read_prompts` fills, and the loop that fills them.

Every lens's layers are **rows** of one set of arrays (lens after lens, :class:`RowLayout`); the
columns are the read positions. The rows are read a chunk of positions at a time (at most
``CHUNK_ELEMENTS`` logits per array): the model's output row once per chunk (:func:`read_rows`),
then groups of the other rows, each group transported, unembedded by one matrix product and reduced
to its statistics (:class:`RowGroupReader`) in the per-thread pool of
:mod:`~jlens_core.reading.openmp_workers`. Only the statistics are kept (:class:`ReadingArrays`),
so ``layers x positions x vocab`` is never held (docs/method.md §6).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..lenses.protocol import Lens
from ..lenses.readout import transported_logits
from ..models.model import LensModel
from . import logit_stats
from .logit_stats import centred_logit_stats, chunk_size, final_distribution, rank_of
from .openmp_workers import run_in_workers


class RowLayout:
    """Every lens's layers as rows of one set of arrays, lens after lens; each reading gets its slice.

    Args:
        layer_lists: ``{lens name: [layer, ...]}``, each list ascending.
    """

    def __init__(self, layer_lists: Mapping[str, list[int]]) -> None:
        self.layer_lists = dict(layer_lists)
        self.row_lens: list[str] = []  # [n_rows] the lens of each row
        self.row_layer: list[int] = []  # [n_rows] the layer of each row
        self._first_row: dict[str, int] = {}
        for name, layer_list in self.layer_lists.items():
            self._first_row[name] = len(self.row_lens)
            self.row_lens += [name] * len(layer_list)
            self.row_layer += layer_list

    @property
    def n_rows(self) -> int:
        return len(self.row_lens)

    @property
    def all_layers(self) -> list[int]:
        """Every layer some lens reads, ascending (each recorded once)."""
        return sorted(set(self.row_layer))

    def rows(self, name: str) -> slice:
        """The rows of lens ``name``."""
        start = self._first_row[name]
        return slice(start, start + len(self.layer_lists[name]))


@dataclass(frozen=True)
class Targets:
    """What every row is scored against: the read positions, their next tokens, the pinned tokens, top-k.

    Attributes:
        positions: ``LongTensor[n_pos]`` the read positions.
        next_ids: ``LongTensor[n_pos]`` the actual next token, ``-1`` at the prompt's last position.
        pin_names / pin_ids: the pinned tokens' names and ``LongTensor[n_pinned]`` ids.
        mask: ``BoolTensor[vocab]`` of the tokens top-k may list (word tokens, or word-like), or None for all.
        k: tokens kept per cell.
        kept: ``FloatTensor[vocab]`` 0/1, the ids ranks count above a token (the word-token readout,
            docs/method.md §9.1), or None for all.
    """

    positions: torch.Tensor
    next_ids: torch.Tensor
    pin_names: list[str]
    pin_ids: torch.Tensor
    mask: torch.Tensor | None
    k: int
    kept: torch.Tensor | None = None


@dataclass(frozen=True)
class Chunk:
    """A run of ``c`` read positions (``columns`` of the arrays) and the model's final distribution there.

    Attributes:
        columns: the chunk's columns in the result arrays.
        positions: ``LongTensor[c]`` the positions (rows of the recorded residuals).
        final_p / final_neg_entropy: from :func:`~jlens_core.reading.logit_stats.final_distribution`,
            ``[c, vocab]`` / ``[c]``.
        next_ids / final_top1: ``LongTensor[c]`` the next token (``-1``: none) and the model's top-1.
    """

    columns: slice
    positions: torch.Tensor
    final_p: torch.Tensor
    final_neg_entropy: torch.Tensor
    next_ids: torch.Tensor
    final_top1: torch.Tensor

    def part(self, p0: int, p1: int) -> Chunk:
        """Positions ``p0:p1`` of this chunk."""
        return Chunk(slice(self.columns.start + p0, self.columns.start + p1), self.positions[p0:p1],
                     self.final_p[p0:p1], self.final_neg_entropy[p0:p1], self.next_ids[p0:p1],
                     self.final_top1[p0:p1])


def reused_array(scratch: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """``scratch[name]`` viewed as ``shape`` (grown or replaced when it is too small or of another kind).

    One array per role and worker for every group: a fresh 64 MB array per group costs more in page
    faults than its arithmetic.
    """
    n = math.prod(shape)
    array = scratch.get(name)
    if array is None or array.numel() < n or array.dtype != dtype or array.device != device:
        array = scratch[name] = torch.empty(n, dtype=dtype, device=device)
    return array[:n].view(shape)


class ReadingArrays:
    """The statistics of every row x read position, filled block by block (numpy, on the CPU).

    Attributes:
        top_ids: ``int64[n_rows, n_pos, k]``; top_probs: ``float32[n_rows, n_pos, k]``.
        entropy, kl, ce, next_rank: ``float64[n_rows, n_pos]`` (bits; ranks NaN without a next token).
        final_rank: ``int64[n_rows, n_pos]``; pin_ranks: ``{name: int64[n_rows, n_pos]}``.
        final_top1: ``int64[n_pos]`` the model's own top-1 token.
        block: logit rows the statistics pass over at a time (``STATS_BLOCK_ELEMENTS // vocab``).
    """

    def __init__(self, n_rows: int, n_positions: int, targets: Targets, vocab: int) -> None:
        shape, k = (n_rows, n_positions), targets.k
        self.top_ids = np.zeros((*shape, k), dtype=np.int64)
        self.top_probs = np.zeros((*shape, k), dtype=np.float32)
        self.entropy = np.zeros(shape)
        self.kl = np.zeros(shape)
        self.ce = np.zeros(shape)
        self.next_rank = np.zeros(shape)
        self.final_rank = np.zeros(shape, dtype=np.int64)
        self.pin_ranks = {name: np.zeros(shape, dtype=np.int64) for name in targets.pin_names}
        self.final_top1 = np.zeros(n_positions, dtype=np.int64)
        self.block = max(1, logit_stats.STATS_BLOCK_ELEMENTS // vocab)
        self.targets = targets

    def write(self, rows: list[int], chunk: Chunk, z: torch.Tensor, scratch: dict[str, torch.Tensor]) -> None:
        """The statistics of ``z`` (``[g, c, vocab]`` fp32 logits of ``rows`` at ``chunk``), block by block.

        A block holds at most ``block`` logit rows: several rows of all ``c`` positions, or (``c``
        past a block) one row's run of positions. ``z`` is overwritten (centred).
        """
        c = z.shape[1]
        n_pos, n_layers = min(c, self.block), max(1, self.block // c)
        for b0 in range(0, len(rows), n_layers):
            for p0 in range(0, c, n_pos):
                p1 = min(c, p0 + n_pos)
                self._write_block(rows[b0: b0 + n_layers], chunk.part(p0, p1), z[b0: b0 + n_layers, p0:p1], scratch)

    def _write_block(self, rows: list[int], chunk: Chunk, z: torch.Tensor, scratch: dict[str, torch.Tensor]) -> None:
        # the rows are disjoint between workers, so their writes into the arrays never meet
        g, sl, nxt, t = z.shape[0], chunk.columns, chunk.next_ids, self.targets
        work = reused_array(scratch, "scratch", z.shape, z.dtype, z.device)
        log_norm, ent, kld, cel = centred_logit_stats(z, chunk.final_p, chunk.final_neg_entropy, nxt, work)  # z centred
        self.entropy[rows, sl] = ent.double().cpu().numpy()
        self.kl[rows, sl] = kld.double().cpu().numpy()
        self.ce[rows, sl] = cel.double().cpu().numpy()
        nr = rank_of(z, nxt.clamp_min(0).expand(g, -1), work, t.kept).double()
        self.next_rank[rows, sl] = torch.where(nxt >= 0, nr, torch.full_like(nr, float("nan"))).cpu().numpy()
        self.final_rank[rows, sl] = rank_of(z, chunk.final_top1.expand(g, -1), work, t.kept).cpu().numpy()
        for j, name in enumerate(t.pin_names):
            self.pin_ranks[name][rows, sl] = rank_of(z, t.pin_ids[j].expand(g, z.shape[1]), work,
                                                     t.kept).cpu().numpy()
        if t.mask is None:
            top_z, indices = z.topk(t.k, dim=-1)  # [g, c, k]
        else:
            indices = torch.where(t.mask, z, work.fill_(float("-inf"))).topk(t.k, dim=-1)[1]
            top_z = z.gather(-1, indices)
        self.top_ids[rows, sl] = indices.cpu().numpy()
        self.top_probs[rows, sl] = (top_z - log_norm[..., None]).exp().cpu().numpy()

    def copy_row(self, source: int, target: int) -> None:
        """Row ``target`` of every per-row array becomes a copy of row ``source``."""
        arrays: tuple[np.ndarray, ...] = (self.top_ids, self.top_probs, self.entropy, self.kl, self.ce,
                                          self.next_rank, self.final_rank, *self.pin_ranks.values())
        for array in arrays:
            array[target] = array[source]

    def reading_fields(self, rows: slice) -> dict[str, Any]:
        """:class:`~jlens_core.reading.prompt_reading.PromptReading`'s statistics for ``rows``, as copies."""
        return {"top_ids": self.top_ids[rows].copy(), "top_probs": self.top_probs[rows].copy(),
                "entropy_bits": self.entropy[rows].copy(), "kl_bits": self.kl[rows].copy(),
                "ce_bits": self.ce[rows].copy(), "next_token_rank": self.next_rank[rows].copy(),
                "final_top1_rank": self.final_rank[rows].copy(),
                "pinned_ranks": {n: a[rows].copy() for n, a in self.pin_ranks.items()},
                "final_top1_ids": self.final_top1.copy()}


class RowGroupReader:
    """One task of the pool: a group of rows at one chunk, transported, unembedded by one matmul, reduced.

    Args:
        model: the model (its ``unembed``, with ``out=`` where it takes one).
        lenses: ``{name: lens}`` as in ``layout``.
        layout: the rows.
        resid: ``{layer: Tensor[seq, d_model]}`` the recorded residuals.
        results: the arrays the statistics go to.
        vocab: the unembedding's width.
    """

    def __init__(self, model: LensModel, lenses: Mapping[str, Lens], layout: RowLayout, resid: Mapping[int, torch.Tensor],
                 results: ReadingArrays, vocab: int) -> None:
        self.model, self.lenses, self.layout, self.resid = model, lenses, layout, resid
        self.results, self.vocab = results, vocab
        # LensModel's unembed takes out=; a model written before it did still reads (without reuse)
        self.takes_out = "out" in inspect.signature(model.unembed).parameters

    def __call__(self, task: tuple[list[int], Chunk], scratch: dict[str, torch.Tensor]) -> None:
        rows, chunk = task
        layout, sel = self.layout, chunk.positions
        carried = torch.cat([self.lenses[layout.row_lens[r]].transport(self.resid[layout.row_layer[r]][sel],
                                                                       layout.row_layer[r])
                             for r in rows])  # [g * c, d_model]
        z = self._unembed(carried, scratch).float().view(len(rows), len(sel), -1)  # [g, c, vocab]
        self.results.write(rows, chunk, z, scratch)

    def _unembed(self, carried: torch.Tensor, scratch: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.takes_out:
            return transported_logits(self.model, carried)
        out = reused_array(scratch, "logits", (carried.shape[0], self.vocab), self.model.dtype, carried.device)
        return transported_logits(self.model, carried, out=out)


def read_rows(model: LensModel, reader: RowGroupReader) -> None:
    """Fill ``reader.results`` for every row of ``reader.layout`` at every read position.

    One logits array holds at most ``CHUNK_ELEMENTS``: ``c`` positions of a group of rows at a time,
    unembedded by one matmul (a few large products run far closer to the matmul peak than one per
    layer). The output row is the model's own distribution whatever the lens: read once per chunk
    (its KL exactly 0), copied to the other lenses' output rows.
    """
    layout, results, targets = reader.layout, reader.results, reader.results.targets
    top = model.n_layers - 1
    final_resid = reader.resid[top]
    rows_per_array = chunk_size(reader.vocab)
    top_rows = [r for r in range(layout.n_rows) if layout.row_layer[r] == top]
    lens_rows = [r for r in range(layout.n_rows) if layout.row_layer[r] != top]
    main_scratch: dict[str, torch.Tensor] = {}
    worker_scratch: list[dict[str, torch.Tensor]] = []
    with torch.no_grad():
        for start in range(0, len(targets.positions), rows_per_array):
            sl = slice(start, start + rows_per_array)
            sel = targets.positions[sl]  # [c]
            final_logits = model.unembed(final_resid[sel]).float()  # [c, vocab]
            final_p, final_neg_entropy = final_distribution(final_logits)
            chunk = Chunk(sl, sel, final_p, final_neg_entropy, targets.next_ids[sl], final_logits.argmax(-1))
            results.final_top1[sl] = chunk.final_top1.cpu().numpy()
            if top_rows:
                results.write(top_rows[:1], chunk, final_logits[None], main_scratch)
                results.kl[top_rows[0], sl] = 0.0
            group = max(1, rows_per_array // int(sel.numel()))
            tasks = [(lens_rows[g0: g0 + group], chunk) for g0 in range(0, len(lens_rows), group)]
            run_in_workers(tasks, reader, worker_scratch, final_resid.device)
    for r in top_rows[1:]:
        results.copy_row(top_rows[0], r)


__all__ = ["Chunk", "ReadingArrays", "RowGroupReader", "RowLayout", "Targets", "read_rows", "reused_array"]
