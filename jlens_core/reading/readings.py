"""Reading a prompt through a lens: per layer x position statistics (SPEC §6).

For every readable layer ``l`` and position ``p`` of a prompt, the lens distribution is
``softmax(unembed(J_l @ h_l[p]))`` (``J_l = I`` for the logit lens) and the model's final
distribution is ``softmax(unembed(h_{L-1}[p]))``, the model's own output. From them:

* ``top_ids`` / ``top_tokens`` / ``top_probs``: the ``top_k`` most probable tokens of the lens;
* ``entropy_bits``: entropy of the lens distribution, in bits;
* ``kl_bits``: ``KL(final || lens)`` in bits (0 at the model's output layer);
* ``ce_bits``: cross-entropy of the actual next token ``-log2 p_lens(x[p+1])`` (NaN at the last
  position, which has no next token);
* ``next_token_rank``: rank of the actual next token (missing at the last position);
* ``final_top1_rank``: rank of the model's final top-1 token at that position;
* ``rank_<token>``: rank of each pinned token.

**Ranks** are 1-based over the full vocabulary: ``rank = 1 + #{v : logit_v > logit_t}``, so the
top-1 token has rank 1 and ``rank <= k`` means "in the top k". Ties share the best rank. Ranks are
computed from fp32 logits (cast from the model's dtype).

Memory: residuals are recorded once (``layers x seq x d_model``); logits are computed for a chunk of
positions and a group of layers at a time (at most ``CHUNK_ELEMENTS`` logits per array, one array per
reading thread: on the CPU one per core, at most ``MAX_READING_WORKERS``; the statistics then pass over
``STATS_BLOCK_ELEMENTS`` of them at a time, a block that stays in the CPU's cache), and only the
returned statistics are kept, so ``layers x positions x vocab`` is never held.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..layerspec import wrap_index
from ..lenses.lens import LensFileError
from ..models.recorder import ActivationRecorder
from .edits import EditRunner, check_edits
from .generation import Generation
from .tokens import TokenDisplay, display_ids, encode_plain, is_word_like, token_id_for

log = logging.getLogger(__name__)

LN2 = math.log(2.0)
# Logits held per array while reading (positions per chunk = CHUNK_ELEMENTS // vocab, at least 1).
CHUNK_ELEMENTS = 1 << 24
# Logits the statistics pass over at a time (about 8 MB of fp32): a block and its scratch stay in the
# CPU's cache across the dozen passes, instead of streaming a CHUNK_ELEMENTS array from memory each time.
STATS_BLOCK_ELEMENTS = 1 << 21
FRAME_COLUMNS = ("layer", "position", "token", "segment", "top_ids", "top_tokens", "top_probs", "entropy_bits",
                 "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank")
GRID_STATS = ("entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank", "top1_prob")


# -- shared helpers (also used by jlens_core.evaluation) ---------------------------------------
def check_lens(model: Any, lens: Any) -> None:
    """Raise :class:`LensFileError` if ``lens`` does not belong to ``model``.

    A :class:`JacobianLens` checks its width, target layer and unembedding fingerprint
    (``lens.check_model``); a :class:`LogitLens` must have the model's width and layer count.
    """
    if hasattr(lens, "check_model"):
        lens.check_model(model)
        return
    n_layers = getattr(lens, "n_layers", model.n_layers)
    if getattr(lens, "d_model", model.d_model) != model.d_model or n_layers != model.n_layers:
        raise LensFileError(f"This {getattr(lens, 'kind', 'logit')} lens is for a model with "
                            f"d_model={lens.d_model} and {n_layers} layers; {model.name!r} has "
                            f"d_model={model.d_model} and {model.n_layers} layers. Use "
                            "LogitLens.for_model(model).")


def as_lens_dict(lenses: Any) -> dict[str, Any]:
    """``{name: lens}`` from a dict or a single lens (named by its kind); a clear error when empty."""
    if isinstance(lenses, Mapping):
        out = {str(name): lens for name, lens in lenses.items()}
    elif hasattr(lenses, "transport"):
        out = {str(getattr(lenses, "kind", "lens")): lenses}
    else:
        raise ValueError("lenses must be a dict {name: lens}, e.g. {'jacobian': lens, 'logit': "
                         "LogitLens.for_model(model)}.")
    if not out:
        raise ValueError("lenses is empty: give at least one lens, e.g. {'logit': LogitLens.for_model(model)}.")
    return out


def readable_layers(model: Any, lens: Any, layers: Iterable[int] | None = None) -> list[int]:
    """The layers to read: ``lens.layers`` (all of them, or those of ``layers`` the lens has), sorted.

    Negative indices in ``layers`` count from the end. Layers the lens was not fitted at are left
    out (logged), never read as a logit lens.

    Raises:
        ValueError: an index outside ``[-n_layers, n_layers)``, or no readable layer remains.
    """
    n = model.n_layers
    available = [layer for layer in lens.layers if 0 <= layer < n]
    if layers is None:
        chosen = available
    else:
        wanted = set()
        for layer in layers:
            wanted.add(wrap_index(layer, n, f"layer {layer}"))
        chosen = [layer for layer in available if layer in wanted]
        missing = sorted(wanted - set(chosen))
        if missing:
            log.info("the %s lens has no layers %s; they are left out", getattr(lens, "kind", "?"), missing)
    if not chosen:
        raise ValueError(f"None of the requested layers {sorted(set(layers or []))} is readable with this "
                         f"lens, which reads layers {available}.")
    return sorted(chosen)


def record_residuals(model: Any, input_ids: torch.Tensor, layers: Iterable[int], *,
                     edits: Iterable[Any] | None = None, n_prompt: int | None = None) -> dict[int, torch.Tensor]:
    """One forward pass (no gradients) recording decoder-layer outputs.

    Records ``layers`` and the last layer (the model's output is ``unembed`` of it); the pass
    stops right after the last layer. With ``edits`` (:mod:`jlens_core.reading.edits`) the
    recorded residuals are those of the edited run (positions ``>= n_prompt`` count as generated).

    Returns:
        ``{layer: Tensor[seq, d_model]}`` for batch row 0, on the model's device, model dtype.
    """
    top = model.n_layers - 1
    wanted = sorted({int(layer) for layer in layers} | {top})
    seq = int(input_ids.shape[-1])
    runner = EditRunner(model, edits, seq if n_prompt is None else n_prompt)
    recorded: dict[int, torch.Tensor] = {}

    def forward() -> None:
        # entered inside the runner, so its hooks run after the edits and record the edited stream
        with ActivationRecorder(model.layers, wanted, stop_after=top) as rec:
            model.forward(input_ids)
        recorded.update(rec.activations)

    with torch.no_grad():
        runner.run(forward, torch.arange(seq), clean_forward=lambda: model.forward(input_ids))
    return {layer: recorded[layer][0].detach() for layer in wanted}  # [seq, d_model] each


def rank_of(logits: torch.Tensor, ids: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """1-based rank of ``ids`` among ``logits``: ``1 + #{v : logits[..., v] > logits[..., id]}``.

    The count runs as a matrix product (:func:`row_sums`), several times faster on the CPU than
    summing a bool array.

    Args:
        logits: ``[..., vocab]`` floats.
        ids: ``LongTensor[...]``, one id per row.
        scratch: overwritten if given (same shape and dtype as ``logits``), saving an array (and its
            page faults) per call.

    Returns:
        ``LongTensor[...]``.
    """
    value = logits.gather(-1, ids.unsqueeze(-1))  # [..., 1]
    above = torch.gt(logits, value, out=scratch) if scratch is not None else (logits > value).to(logits.dtype)
    return row_sums(above).long() + 1


def distribution_stats(logits: torch.Tensor, final_logp: torch.Tensor, final_p: torch.Tensor,
                       next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy, KL(final || lens) and next-token CE of a lens distribution, all in bits.

    Args:
        logits: ``[n, vocab]`` lens logits (fp32).
        final_logp / final_p: ``[n, vocab]`` the model's final log-probabilities / probabilities.
        next_ids: ``LongTensor[n]``; a negative id means "no next token" (CE is NaN there).

    Returns:
        ``(log_probs [n, vocab], entropy_bits [n], kl_bits [n], ce_bits [n])``; KL is clamped at 0
        (rounding can leave it a hair below).
    """
    logp = logits.log_softmax(-1)  # [n, vocab]
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros((), device=p.device)).sum(-1) / LN2
    kl = torch.where(final_p > 0, final_p * (final_logp - logp), torch.zeros((), device=p.device)).sum(-1)
    kl = kl.clamp_min(0.0) / LN2
    has_next = next_ids >= 0
    ce = -logp.gather(-1, next_ids.clamp_min(0)[:, None])[:, 0] / LN2
    ce = torch.where(has_next, ce, torch.full_like(ce, float("nan")))
    return logp, entropy, kl, ce


def final_distribution(final_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's final distribution, as :func:`centred_logit_stats` needs it.

    Computed like the lens statistics, from centred fp32 logits ``z`` (row maximum 0): with
    ``S = sum exp(z)``, ``p = exp(z) / S`` and ``sum p log p = sum p z - log S``, so no float64 pass
    over the vocabulary is needed; the sums accumulate in float64.

    Args:
        final_logits: ``[c, vocab]``, any float dtype (not modified).

    Returns:
        ``(final_p [c, vocab] fp32, final_neg_entropy [c] float64)``: probabilities and
        ``sum p log p`` in nats.
    """
    z = final_logits.float()
    z = z - z.amax(dim=-1, keepdim=True)  # [c, vocab] max 0 per row
    z.clamp_min_(-1e30)  # a ruled-out (-inf) token: p = 0 and p * z = 0, not NaN
    p = z.exp()  # [c, vocab] unnormalised
    # float64 accumulators: sum p log p is the large term KL cancels against (~1e-9 nats, not ~1e-6)
    total = p.sum(dim=-1, dtype=torch.float64)  # [c] >= 1
    neg_entropy = torch.mul(p, z).sum(dim=-1, dtype=torch.float64) / total - total.log()  # [c]
    return p.div_(total.float()[:, None]), neg_entropy


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1)`` of 0/1 values as a matrix-vector product: ``[..., vocab] -> [...]``.

    Several times faster on the CPU than a reduction over a bool array, and exact for counts below
    2**24; not for general floats (a BLAS sum accumulates in sequence).
    """
    ones = torch.ones(x.shape[-1], 1, dtype=x.dtype, device=x.device)
    return (x.reshape(-1, x.shape[-1]) @ ones).view(x.shape[:-1])


def centred_logit_stats(z: torch.Tensor, final_p: torch.Tensor, final_neg_entropy: torch.Tensor,
                        next_ids: torch.Tensor, scratch: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy, KL(final || lens) and next-token CE from lens logits, in bits, centring ``z`` in place.

    Each row of ``z`` has its maximum subtracted (ranks and top-k are unchanged by it). With
    ``s = log sum exp(z)`` of the centred logits and ``p`` the lens distribution: ``H = s - sum p z``,
    ``KL = sum q log q - sum q z + s`` (``q`` the final distribution), ``CE = s - z[next]``. Centring
    keeps the cancelling terms small, so fp32 holds them to ~1e-5 bits. A few passes over the logits
    instead of materialising ``log_softmax``.

    Args:
        z: ``[..., c, vocab]`` lens logits, fp32; centred in place (``-inf`` becomes ``-1e30``).
        final_p / final_neg_entropy: from :func:`final_distribution`, ``[c, vocab]`` / ``[c]``.
        next_ids: ``LongTensor[c]``; a negative id means "no next token" (CE is NaN there).
        scratch: overwritten; same shape and dtype as ``z``. Reusing one buffer across calls saves
            the page faults of a fresh array per call, which on the CPU cost more than the arithmetic.

    Returns:
        ``(log_norm [..., c], entropy_bits, kl_bits, ce_bits)``, each ``[..., c]``; ``log_norm`` is
        ``s``, so ``log p_v = z_v - log_norm``. KL and entropy are clamped at 0 (rounding).
    """
    if scratch is None:
        scratch = torch.empty_like(z)
    z.sub_(z.amax(dim=-1, keepdim=True)).clamp_min_(-1e30)  # max 0 per row; no -inf left to make 0 * inf
    # The float sums use torch's own reductions (pairwise, ~1e-7 relative over a 50k vocabulary): a
    # BLAS dot product or matrix-vector sum is faster but accumulates in sequence (1e-5..1e-4 here).
    p = torch.exp(z, out=scratch)  # [..., c, vocab] unnormalised, <= 1
    total = p.sum(dim=-1)  # [..., c] >= 1
    p_z = p.mul_(z).sum(dim=-1) / total  # sum p z, p normalised
    log_norm = total.log()
    entropy = (log_norm - p_z).clamp_min(0.0) / LN2
    q_z = torch.mul(z, final_p, out=scratch).sum(dim=-1)  # [..., c]
    kl = (final_neg_entropy.to(z.dtype) - q_z + log_norm).clamp_min(0.0) / LN2
    kl = torch.where(kl < 1e20, kl, torch.full_like(kl, float("inf")))  # final mass on a ruled-out (-inf) token
    picked = z.gather(-1, next_ids.clamp_min(0).expand(total.shape).unsqueeze(-1))[..., 0]
    picked = torch.where(picked > -1e30, picked, torch.full_like(picked, float("-inf")))  # a ruled-out token
    ce = torch.where(next_ids >= 0, (log_norm - picked) / LN2, torch.full_like(log_norm, float("nan")))
    return log_norm, entropy, kl, ce


def chunk_size(vocab_size: int) -> int:
    """Rows (positions, or layer x position pairs) per ``[rows, vocab]`` array of at most ``CHUNK_ELEMENTS``."""
    return max(1, CHUNK_ELEMENTS // max(1, int(vocab_size)))


def resolve_positions(seq_len: int, positions: Iterable[int] | None) -> list[int]:
    """Positions to read (all by default); negatives count from the end; de-duplicated, sorted.

    Raises:
        ValueError: a position outside ``[-seq_len, seq_len)`` or an empty list.
    """
    if positions is None:
        return list(range(seq_len))
    out = set()
    for position in positions:
        out.add(wrap_index(position, seq_len, f"position {position}", what="tokens", owner="the prompt"))
    if not out:
        raise ValueError("positions is empty: give at least one position, or None for all.")
    return sorted(out)


def encode_prompt(model: Any, text: str | Sequence[int] | torch.Tensor, max_seq_len: int | None) -> torch.Tensor:
    """``LongTensor[1, seq]`` on the model's device, from text (``model.encode``) or token ids."""
    if isinstance(text, str):
        if not text:
            raise ValueError("The prompt is empty: give some text to read.")
        return model.encode(text, max_length=max_seq_len)
    ids = torch.as_tensor(text, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"Token ids must be a non-empty [seq] or [1, seq] sequence, got shape {tuple(ids.shape)}.")
    if max_seq_len is not None:
        ids = ids[:, :max_seq_len]
    device = getattr(model, "device", None)
    return ids.to(device) if device is not None else ids


def model_vocab_size(model: Any) -> int:
    size = getattr(model, "vocab_size", None)
    if size is None:
        raise ValueError(f"The model {getattr(model, 'name', model)!r} does not tell its vocab_size.")
    return int(size)


# -- the reading -------------------------------------------------------------------------------
@dataclass(eq=False)
class PromptReading:
    """What :func:`read_prompt` returns: statistics for every readable layer x read position.

    Array attributes are indexed ``[layer_index, position_index]`` along :attr:`layers` and
    :attr:`positions` (``n_layers`` rows, ``n_positions`` columns).

    Attributes:
        text: the prompt text (decoded from the ids when ids were given).
        model_name: the model's name.
        lens_kind: ``"jacobian"`` or ``"logit"``.
        input_ids: ``int64[seq]`` the prompt's token ids (after truncation).
        tokens: ``list[str]`` of length ``seq``: display strings of the input tokens.
        layers: readable layers, ascending; the last is the lens's target layer.
        positions: ``int64[n_positions]`` the positions read.
        output_layer: the model's last layer (whose reading is the model's own output).
        top_k: tokens kept per cell.
        show_whitespace: whether display strings show whitespace as glyphs.
        word_like: whether the top-k lists were restricted to word-like tokens (ranks never are).
        pinned: ``{name: token id}``; ``name`` is the pinned token as given (``rank_<name>``).
        top_ids: ``int64[n_layers, n_positions, top_k]``, most probable first.
        top_probs: ``float32[n_layers, n_positions, top_k]``, lens probabilities (full softmax).
        entropy_bits, kl_bits, ce_bits: ``float64[n_layers, n_positions]`` (bits); ``ce_bits`` is
            NaN at the last position.
        next_token_rank: ``float64[n_layers, n_positions]``, 1-based; NaN at the last position.
        final_top1_rank: ``int64[n_layers, n_positions]``, 1-based (1 at the model's output layer).
        pinned_ranks: ``{name: int64[n_layers, n_positions]}``, 1-based.
        next_ids: ``int64[n_positions]`` the actual next token (``-1`` at the last position).
        final_top1_ids: ``int64[n_positions]`` the model's own top-1 token.
        n_prompt: how many of ``input_ids`` are the prompt; the rest were generated (a reading of a
            :class:`~jlens_core.reading.generation.Generation`).
        edits: ``repr`` of the residual edits the reading was taken under (empty: the clean model).
    """

    text: str
    model_name: str
    lens_kind: str
    input_ids: np.ndarray
    tokens: list[str]
    layers: list[int]
    positions: np.ndarray
    output_layer: int
    top_k: int
    show_whitespace: bool
    word_like: bool
    pinned: dict[str, int]
    top_ids: np.ndarray
    top_probs: np.ndarray
    entropy_bits: np.ndarray
    kl_bits: np.ndarray
    ce_bits: np.ndarray
    next_token_rank: np.ndarray
    final_top1_rank: np.ndarray
    pinned_ranks: dict[str, np.ndarray]
    next_ids: np.ndarray
    final_top1_ids: np.ndarray
    vocab_strings: list[str] = field(repr=False, default_factory=list)
    n_prompt: int | None = None
    edits: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n_prompt is None:
            self.n_prompt = len(self.input_ids)

    # -- shape -----------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_positions(self) -> int:
        return len(self.positions)

    def layer_index(self, layer: int) -> int:
        """Row of ``layer`` in the arrays (negative layers count from the model's end).

        Raises:
            KeyError: the layer was not read.
        """
        i = int(layer) % (self.output_layer + 1) if layer < 0 else int(layer)
        try:
            return self.layers.index(i)
        except ValueError:
            raise KeyError(f"Layer {layer} was not read; this reading has layers {self.layers}.") from None

    @property
    def n_generated(self) -> int:
        """Tokens of the reading that the model generated (after the prompt)."""
        return len(self.input_ids) - int(self.n_prompt)

    @property
    def segments(self) -> list[str]:
        """``"prompt"`` or ``"generated"`` for each read position."""
        return ["generated" if p >= self.n_prompt else "prompt" for p in self.positions.tolist()]

    def position_index(self, position: int) -> int:
        """Column of ``position`` in the arrays (negative positions count from the prompt's end).

        Raises:
            KeyError: the position was not read.
        """
        i = int(position) % len(self.input_ids) if position < 0 else int(position)
        hits = np.flatnonzero(self.positions == i)
        if not len(hits):
            raise KeyError(f"Position {position} was not read; this reading has positions "
                           f"{self.positions.tolist()}.")
        return int(hits[0])

    # -- strings -----------------------------------------------------------------------------------
    def _names(self, ids: Iterable[int]) -> list[str]:
        n = len(self.vocab_strings)
        return [self.vocab_strings[i] if 0 <= i < n else f"<id:{i}>" for i in (int(j) for j in ids)]

    @property
    def position_tokens(self) -> list[str]:
        """Display strings of the input token at each read position (``n_positions``)."""
        return [self.tokens[p] for p in self.positions.tolist()]

    @property
    def next_tokens(self) -> list[str]:
        """Display strings of the actual next token at each read position (``""`` at the last)."""
        return [self.tokens[p + 1] if p + 1 < len(self.tokens) else "" for p in self.positions.tolist()]

    @property
    def final_top1_tokens(self) -> list[str]:
        """Display strings of the model's own top-1 token at each read position."""
        return self._names(self.final_top1_ids)

    def top_tokens(self, layer: int, position: int) -> list[str]:
        """Display strings of the top-k tokens at one cell (``layer``, ``position`` are model indices)."""
        return self._names(self.top_ids[self.layer_index(layer), self.position_index(position)])

    def top1_grid(self) -> list[list[str]]:
        """``[n_layers][n_positions]`` display strings of the lens's top-1 token."""
        return [self._names(row) for row in self.top_ids[:, :, 0]]

    def cell(self, layer: int, position: int) -> dict:
        """Everything about one cell, as plain Python values (for tooltips and detail panes)."""
        li, pi = self.layer_index(layer), self.position_index(position)
        rank = self.next_token_rank[li, pi]
        return {"layer": self.layers[li], "position": int(self.positions[pi]),
                "token": self.tokens[int(self.positions[pi])], "next_token": self.next_tokens[pi],
                "segment": "generated" if int(self.positions[pi]) >= int(self.n_prompt) else "prompt",
                "top_ids": self.top_ids[li, pi].tolist(), "top_tokens": self._names(self.top_ids[li, pi]),
                "top_probs": [float(x) for x in self.top_probs[li, pi]],
                "entropy_bits": float(self.entropy_bits[li, pi]), "kl_bits": float(self.kl_bits[li, pi]),
                "ce_bits": float(self.ce_bits[li, pi]),
                "next_token_rank": None if np.isnan(rank) else int(rank),
                "final_top1_rank": int(self.final_top1_rank[li, pi]),
                **{f"rank_{name}": int(r[li, pi]) for name, r in self.pinned_ranks.items()}}

    # -- grids ---------------------------------------------------------------------------------------
    @property
    def stats(self) -> list[str]:
        """Names :meth:`grid` accepts."""
        return list(GRID_STATS) + [f"rank_{name}" for name in self.pinned]

    def grid(self, stat: str, *, layers: Sequence[int] | None = None) -> np.ndarray:
        """``float64[n_layers, n_positions]`` of one statistic, for heatmaps.

        Args:
            stat: one of :attr:`stats`: ``entropy_bits``, ``kl_bits``, ``ce_bits``,
                ``next_token_rank`` (NaN at the last position), ``final_top1_rank``, ``top1_prob``,
                or ``rank_<pinned>``.
            layers: rows to return, in that order (default :attr:`layers`); a layer this reading
                lacks is a row of NaN (so two readings can share one layer axis).

        Raises:
            ValueError: an unknown ``stat``.
        """
        if stat in ("entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank"):
            values = getattr(self, stat)
        elif stat == "top1_prob":
            values = self.top_probs[:, :, 0]
        elif stat.startswith("rank_") and stat[5:] in self.pinned_ranks:
            values = self.pinned_ranks[stat[5:]]
        else:
            raise ValueError(f"Unknown statistic {stat!r}: choose one of {self.stats}.")
        values = np.asarray(values, dtype=np.float64)
        if layers is None:
            return values.copy()
        out = np.full((len(layers), self.n_positions), np.nan)
        for row, layer in enumerate(layers):
            if layer in self.layers:
                out[row] = values[self.layers.index(layer)]
        return out

    # -- the long frame --------------------------------------------------------------------------------
    @cached_property
    def frame(self) -> pd.DataFrame:
        """One row per (layer, position), layers outer: the columns of :data:`FRAME_COLUMNS` plus
        ``rank_<token>`` per pinned token.

        ``top_ids`` / ``top_tokens`` / ``top_probs`` hold Python lists; ``next_token_rank`` is a
        nullable ``Int64`` column, missing (``<NA>``) at the last position; other ranks are ``int64``.
        """
        n_l, n_p = self.n_layers, self.n_positions
        layer_col = np.repeat(np.asarray(self.layers, dtype=np.int64), n_p)
        position_col = np.tile(self.positions.astype(np.int64), n_l)
        flat_ids = self.top_ids.reshape(n_l * n_p, -1)
        data: dict[str, Any] = {
            "layer": layer_col,
            "position": position_col,
            "token": [self.tokens[p] for p in position_col.tolist()],
            "segment": np.where(position_col >= int(self.n_prompt), "generated", "prompt"),
            "top_ids": flat_ids.tolist(),
            "top_tokens": [self._names(row) for row in flat_ids],
            "top_probs": self.top_probs.reshape(n_l * n_p, -1).astype(np.float64).tolist(),
            "entropy_bits": self.entropy_bits.reshape(-1),
            "kl_bits": self.kl_bits.reshape(-1),
            "ce_bits": self.ce_bits.reshape(-1),
            "next_token_rank": pd.array(
                [None if np.isnan(x) else int(x) for x in self.next_token_rank.reshape(-1)], dtype="Int64"),
            "final_top1_rank": self.final_top1_rank.reshape(-1).astype(np.int64),
        }
        for name, ranks in self.pinned_ranks.items():
            data[f"rank_{name}"] = ranks.reshape(-1).astype(np.int64)
        return pd.DataFrame(data)

    def __repr__(self) -> str:
        return (f"PromptReading(model={self.model_name!r}, lens={self.lens_kind!r}, layers={self.layers}, "
                f"positions={self.n_positions} of {len(self.input_ids)}, top_k={self.top_k}, "
                f"pinned={list(self.pinned)})")


def _resolve_pinned(model: Any, display: TokenDisplay, pinned: Iterable[str | int]) -> dict[str, int]:
    out: dict[str, int] = {}
    if isinstance(pinned, (str, int)):
        pinned = [pinned]
    for token in pinned:
        name = str(token)
        try:
            out[name] = token_id_for(model.tokenizer, token, vocab_size=display.vocab_size)
        except ValueError as exc:
            raise ValueError(f"Unknown pinned token {token!r}: {exc}") from None
        if isinstance(token, str) and token not in display.token_to_id:
            n_tokens = len(encode_plain(model.tokenizer, token))
            if n_tokens > 1:
                log.info("pinned %r spans %d tokens; its rank is that of its first token %r", token, n_tokens,
                         display.texts[out[name]])
    return out


# Most reading threads on the CPU (each holds its own CHUNK_ELEMENTS logits array).
MAX_READING_WORKERS = 8


@functools.cache
def _thread_openmp_setter() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch runs on, or None where it cannot be found.

    It sets the calling thread's own OpenMP thread count. ``torch.set_num_threads`` would also set
    the process-wide count that every thread started later begins with (a Streamlit server starts one
    per script run), so a worker must not call it.
    """
    try:
        with open("/proc/self/maps") as maps:  # Linux: the runtime torch loaded, not another copy
            paths = sorted({line.split()[-1] for line in maps if any(
                name in line for name in ("libgomp", "libiomp", "libomp"))})
        return ctypes.CDLL(paths[0]).omp_set_num_threads if paths else None
    except (OSError, AttributeError):
        return None


def reading_workers(device: torch.device, n_tasks: int) -> int:
    """Threads that read row groups side by side: 1 off the CPU; on the CPU one per intra-op thread.

    Each worker runs its matrix products and statistics on ``torch.get_num_threads() // workers``
    threads. Two single-threaded workers keep two cores busy where one two-threaded product waits at
    every step for its slower half: whenever another process (the app's browser) takes a core, only
    one worker slows down. 1 where the calling thread's OpenMP count cannot be set on its own.
    """
    if device.type != "cpu" or _thread_openmp_setter() is None:
        return 1
    return max(1, min(torch.get_num_threads(), n_tasks, MAX_READING_WORKERS))


def run_in_workers(tasks: list[Any], work: Callable[[Any, dict[str, torch.Tensor]], None],
                   worker_arrays: list[dict[str, torch.Tensor]], device: torch.device) -> None:
    """``work(task, arrays)`` for every task, in :func:`reading_workers` threads taking the next task in turn.

    ``worker_arrays[i]`` is worker ``i``'s own scratch (created here if missing, kept for the next call).
    Gradients are off in every worker. The first exception raised by ``work`` is re-raised here once
    every worker has stopped.
    """
    n_workers = reading_workers(device, len(tasks))
    while len(worker_arrays) < n_workers:
        worker_arrays.append({})
    if n_workers == 1:
        for task in tasks:
            work(task, worker_arrays[0])
        return
    threads_each = max(1, torch.get_num_threads() // n_workers)
    queue = iter(tasks)
    lock = threading.Lock()
    errors: list[BaseException] = []
    set_threads = _thread_openmp_setter()

    def worker(arrays: dict[str, torch.Tensor]) -> None:
        torch.get_num_threads()  # torch sets a new thread's OpenMP count on first use: before ours
        set_threads(threads_each)
        with torch.no_grad():
            while not errors:
                with lock:
                    task = next(queue, None)
                if task is None:
                    return
                try:
                    work(task, arrays)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                    errors.append(exc)

    threads = [threading.Thread(target=worker, args=(worker_arrays[i],), name=f"jlens-read-{i}", daemon=True)
               for i in range(n_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def read_prompt(model: Any, lens: Any, text: str | Sequence[int] | torch.Tensor | Generation, *, top_k: int = 10,
                layers: Iterable[int] | None = None, positions: Iterable[int] | None = None,
                pinned: Iterable[str | int] = (), show_whitespace: bool = False,
                max_seq_len: int | None = None, word_like: bool = False, n_prompt: int | None = None,
                edits: Iterable[Any] | None = None) -> PromptReading:
    """Read a prompt through a lens at every layer x position (SPEC §6).

    Args:
        model: an :class:`~jlens_core.HFLensModel` (or anything with its interface and a tokenizer).
        lens: a :class:`~jlens_core.JacobianLens` or :class:`~jlens_core.LogitLens` for ``model``.
        text: the prompt (or its token ids, ``[seq]`` or ``[1, seq]``), tokenized with the model's
            special tokens (e.g. BOS); or a :class:`~jlens_core.reading.generation.Generation`, read as
            prompt + continuation in one pass.
        top_k: tokens kept per cell (capped at the vocabulary size).
        layers: layers to read (default all of ``lens.layers``; negatives count from the end).
            Layers a Jacobian lens was not fitted at are absent, never read as a logit lens.
        positions: positions to read (default all; negatives count from the end).
        pinned: tokens whose rank to track in a ``rank_<token>`` column each: an id, a raw vocabulary
            entry (``"ĠParis"``), or a string whose first token is used (``" Paris"``, see
            :func:`jlens_core.reading.tokens.token_id_for`).
        show_whitespace: display whitespace as glyphs (``·`` ``↵`` ``→``) in token strings.
        max_seq_len: truncate the prompt to this many tokens (default: no truncation).
        word_like: restrict the top-k lists to word-like tokens (:func:`~jlens_core.reading.tokens.is_word_like`);
            probabilities stay those of the full softmax and ranks stay over the full vocabulary.
        n_prompt: with token ids, how many of them are the prompt (the rest are marked ``generated``);
            taken from a ``Generation``; default: all of them.
        edits: residual edits (:mod:`jlens_core.reading.edits`) applied during the forward pass: the
            reading is of the edited stream, and "final" means the edited model's own output.

    Returns:
        A :class:`PromptReading` (its ``.frame`` is the long DataFrame).

    Raises:
        ValueError: empty text, ``top_k < 1``, bad layers or positions, an unknown pinned token.
        LensFileError: the lens belongs to another model.
    """
    return read_prompts(model, {"lens": lens}, text, top_k=top_k, layers=layers, positions=positions,
                        pinned=pinned, show_whitespace=show_whitespace, max_seq_len=max_seq_len,
                        word_like=word_like, n_prompt=n_prompt, edits=edits)["lens"]


def read_prompts(model: Any, lenses: Mapping[str, Any] | Any, text: str | Sequence[int] | torch.Tensor | Generation,
                 *, top_k: int = 10, layers: Iterable[int] | None = None, positions: Iterable[int] | None = None,
                 pinned: Iterable[str | int] = (), show_whitespace: bool = False,
                 max_seq_len: int | None = None, word_like: bool = False, n_prompt: int | None = None,
                 edits: Iterable[Any] | None = None) -> dict[str, PromptReading]:
    """Read one prompt through several lenses at once: :func:`read_prompt` for each, sharing the work.

    The lenses share one forward pass, the model's final distribution and its output row (the same
    for every lens), and their layers are unembedded together, several lenses' rows per matrix
    product. Each reading equals :func:`read_prompt` of that lens alone (the same arithmetic, row by
    row). The arguments are :func:`read_prompt`'s; ``layers`` applies to every lens.

    Args:
        lenses: ``{name: lens}`` (or one lens, named by its kind), e.g. ``{"logit": LogitLens.for_model(model),
            "jacobian": lens}``.

    Returns:
        ``{name: PromptReading}`` in the order of ``lenses``.

    Raises:
        ValueError: no lens, empty text, ``top_k < 1``, bad layers or positions, an unknown pinned token.
        LensFileError: a lens belongs to another model.
    """
    lens_map = as_lens_dict(lenses)
    if isinstance(text, Generation):
        if n_prompt is not None and int(n_prompt) != text.n_prompt:
            raise ValueError(f"n_prompt={n_prompt} contradicts the generation's {text.n_prompt} prompt tokens.")
        n_prompt, text = text.n_prompt, text.ids
    if isinstance(text, str) and not text:
        raise ValueError("The prompt is empty: give some text to read.")
    if n_prompt is not None and int(n_prompt) < 0:
        raise ValueError(f"n_prompt={n_prompt} must be >= 0.")
    if int(top_k) < 1:
        raise ValueError(f"top_k={top_k} must be at least 1.")
    if max_seq_len is not None and int(max_seq_len) < 1:
        raise ValueError(f"max_seq_len={max_seq_len} must be at least 1 (or None for no truncation).")
    for lens in lens_map.values():
        check_lens(model, lens)
    vocab = model_vocab_size(model)
    display = TokenDisplay.for_model(model)
    pins = _resolve_pinned(model, display, pinned)
    ids = encode_prompt(model, text, max_seq_len)  # [1, seq]
    seq_len = int(ids.shape[1])
    pos_list = resolve_positions(seq_len, positions)
    layer_lists = {name: readable_layers(model, lens, layers) for name, lens in lens_map.items()}
    top = model.n_layers - 1
    k = min(int(top_k), vocab)

    n_prompt = seq_len if n_prompt is None else min(int(n_prompt), seq_len)
    edit_list = check_edits(model, edits)
    all_layers = sorted(set().union(*layer_lists.values()))
    resid = record_residuals(model, ids, all_layers, edits=edit_list, n_prompt=n_prompt)  # {layer: [seq, d]}
    device = resid[top].device
    ids_row = ids[0].to(device)  # [seq]
    pos_t = torch.tensor(pos_list, dtype=torch.long, device=device)  # [n_pos]
    next_t = torch.where(pos_t + 1 < seq_len, ids_row[(pos_t + 1).clamp_max(seq_len - 1)],
                         torch.full_like(pos_t, -1))  # [n_pos]
    pin_names = list(pins)
    pin_t = torch.tensor([pins[n] for n in pin_names], dtype=torch.long, device=device)  # [n_pinned]
    mask = None
    if word_like:
        mask_np = display.word_like_mask()[:vocab]
        mask = torch.as_tensor(np.pad(mask_np, (0, vocab - len(mask_np))), device=device)  # [vocab] bool
        k = max(1, min(k, int(mask.sum())))

    # Every lens's layers are rows of one set of arrays (lens after lens); each reading gets its slice.
    row_lens: list[str] = []  # [n_rows] the lens of each row
    row_layer: list[int] = []  # [n_rows] the layer of each row
    first_row: dict[str, int] = {}
    for name, layer_list in layer_lists.items():
        first_row[name] = len(row_lens)
        row_lens += [name] * len(layer_list)
        row_layer += layer_list
    n_rows, n_p = len(row_lens), len(pos_list)
    top_ids = np.zeros((n_rows, n_p, k), dtype=np.int64)
    top_probs = np.zeros((n_rows, n_p, k), dtype=np.float32)
    entropy = np.zeros((n_rows, n_p))
    kl = np.zeros((n_rows, n_p))
    ce = np.zeros((n_rows, n_p))
    next_rank = np.zeros((n_rows, n_p))
    final_rank = np.zeros((n_rows, n_p), dtype=np.int64)
    pin_ranks = {name: np.zeros((n_rows, n_p), dtype=np.int64) for name in pin_names}
    final_top1 = np.zeros(n_p, dtype=np.int64)
    per_row_arrays = [top_ids, top_probs, entropy, kl, ce, next_rank, final_rank, *pin_ranks.values()]

    block = max(1, STATS_BLOCK_ELEMENTS // vocab)  # logit rows per statistics block

    def write_stats(rows: list[int], sl: slice, z: torch.Tensor, final_p: torch.Tensor,
                    final_neg_entropy: torch.Tensor, nxt: torch.Tensor, f_top1: torch.Tensor,
                    arrays: dict[str, torch.Tensor]) -> None:
        # z: [g, c, vocab] fp32 logits of the rows ``rows`` at positions sl, passed to write_block in
        # blocks of at most STATS_BLOCK_ELEMENTS logits: several rows of all c positions, or (c past a
        # block) one row's run of positions
        c = z.shape[1]
        n_pos, n_layers = min(c, block), max(1, block // c)
        for b0 in range(0, len(rows), n_layers):
            for p0 in range(0, c, n_pos):
                p1 = min(c, p0 + n_pos)
                write_block(rows[b0: b0 + n_layers], slice(sl.start + p0, sl.start + p1), z[b0: b0 + n_layers, p0:p1],
                            final_p[p0:p1], final_neg_entropy[p0:p1], nxt[p0:p1], f_top1[p0:p1], arrays)

    def write_block(rows: list[int], sl: slice, z: torch.Tensor, final_p: torch.Tensor,
                    final_neg_entropy: torch.Tensor, nxt: torch.Tensor, f_top1: torch.Tensor,
                    arrays: dict[str, torch.Tensor]) -> None:
        # the rows are disjoint between workers, so their writes into the result arrays never meet
        g = z.shape[0]
        scratch = reused(arrays, "scratch", z.shape, z.dtype, z.device)
        log_norm, ent, kld, cel = centred_logit_stats(z, final_p, final_neg_entropy, nxt, scratch)  # z centred
        entropy[rows, sl] = ent.double().cpu().numpy()
        kl[rows, sl] = kld.double().cpu().numpy()
        ce[rows, sl] = cel.double().cpu().numpy()
        nr = rank_of(z, nxt.clamp_min(0).expand(g, -1), scratch).double()
        next_rank[rows, sl] = torch.where(nxt >= 0, nr, torch.full_like(nr, float("nan"))).cpu().numpy()
        final_rank[rows, sl] = rank_of(z, f_top1.expand(g, -1), scratch).cpu().numpy()
        for j, name in enumerate(pin_names):
            pin_ranks[name][rows, sl] = rank_of(z, pin_t[j].expand(g, z.shape[1]), scratch).cpu().numpy()
        if mask is None:
            top_z, indices = z.topk(k, dim=-1)  # [g, c, k]
        else:
            indices = torch.where(mask, z, scratch.fill_(float("-inf"))).topk(k, dim=-1)[1]
            top_z = z.gather(-1, indices)
        top_ids[rows, sl] = indices.cpu().numpy()
        top_probs[rows, sl] = (top_z - log_norm[..., None]).exp().cpu().numpy()

    # One logits array holds at most CHUNK_ELEMENTS: ``c`` positions of ``group`` rows at a time,
    # unembedded by one matmul (a few large products run far closer to the matmul peak than one per layer).
    rows_per_array = chunk_size(vocab)
    takes_out = "out" in inspect.signature(model.unembed).parameters  # HFLensModel does; a protocol model may not

    def reused(arrays: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        # One array per role and worker for every group (grown when needed): a fresh 64 MB array per
        # group costs more in page faults than its arithmetic.
        n = math.prod(shape)
        array = arrays.get(name)
        if array is None or array.numel() < n or array.dtype != dtype or array.device != device:
            array = arrays[name] = torch.empty(n, dtype=dtype, device=device)
        return array[:n].view(shape)

    def unembed_into_reused(carried: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        if not takes_out:
            return model.unembed(carried)
        dtype = getattr(model, "dtype", carried.dtype)
        return model.unembed(carried, out=reused(arrays, "logits", (carried.shape[0], vocab), dtype, carried.device))

    def read_group(task: tuple, arrays: dict[str, torch.Tensor]) -> None:
        # one group of rows at one chunk of positions: transported, unembedded by one matmul, its statistics
        rows, (sl, sel, final_p, final_neg_entropy, nxt, f_top1) = task
        carried = torch.cat([lens_map[row_lens[r]].transport(resid[row_layer[r]][sel], row_layer[r])
                             for r in rows])  # [g * c, d_model]
        z = unembed_into_reused(carried, arrays).float().view(len(rows), len(sel), -1)  # [g, c, vocab]
        write_stats(rows, sl, z, final_p, final_neg_entropy, nxt, f_top1, arrays)

    # The output row is the model's own distribution whatever the lens: read once, copied to the others.
    top_rows = [r for r in range(n_rows) if row_layer[r] == top]
    lens_rows = [r for r in range(n_rows) if row_layer[r] != top]
    main_arrays: dict[str, torch.Tensor] = {}
    worker_arrays: list[dict[str, torch.Tensor]] = []
    with torch.no_grad():
        for start in range(0, n_p, rows_per_array):
            sl = slice(start, start + rows_per_array)
            sel = pos_t[sl]  # [c]
            nxt = next_t[sl]  # [c]
            c = int(sel.numel())
            final_logits = model.unembed(resid[top][sel]).float()  # [c, vocab]
            final_p, final_neg_entropy = final_distribution(final_logits)
            f_top1 = final_logits.argmax(-1)  # [c]
            final_top1[sl] = f_top1.cpu().numpy()
            if top_rows:  # KL exactly 0
                write_stats(top_rows[:1], sl, final_logits[None], final_p, final_neg_entropy, nxt, f_top1, main_arrays)
                kl[top_rows[0], sl] = 0.0
            group = max(1, rows_per_array // c)
            chunk = (sl, sel, final_p, final_neg_entropy, nxt, f_top1)
            tasks = [(lens_rows[g0: g0 + group], chunk) for g0 in range(0, len(lens_rows), group)]
            run_in_workers(tasks, read_group, worker_arrays, device)
    for r in top_rows[1:]:
        for array in per_row_arrays:
            array[r] = array[top_rows[0]]

    input_ids = ids[0].cpu().numpy().astype(np.int64)
    strings = display.strings(show_whitespace)
    tokens = display_ids(display, input_ids, show_whitespace=show_whitespace)
    shown_text = text if isinstance(text, str) else model.decode(input_ids.tolist())
    readings = {}
    for name, lens in lens_map.items():
        rs = slice(first_row[name], first_row[name] + len(layer_lists[name]))
        readings[name] = PromptReading(
            text=shown_text, model_name=str(getattr(model, "name", "")),
            lens_kind=str(getattr(lens, "kind", type(lens).__name__)), input_ids=input_ids, tokens=list(tokens),
            layers=list(layer_lists[name]), positions=np.asarray(pos_list, dtype=np.int64), output_layer=top,
            top_k=k, show_whitespace=bool(show_whitespace), word_like=bool(word_like), pinned=dict(pins),
            top_ids=top_ids[rs].copy(), top_probs=top_probs[rs].copy(), entropy_bits=entropy[rs].copy(),
            kl_bits=kl[rs].copy(), ce_bits=ce[rs].copy(), next_token_rank=next_rank[rs].copy(),
            final_top1_rank=final_rank[rs].copy(), pinned_ranks={n: a[rs].copy() for n, a in pin_ranks.items()},
            next_ids=next_t.cpu().numpy().astype(np.int64), final_top1_ids=final_top1.copy(), vocab_strings=strings,
            n_prompt=n_prompt, edits=[repr(e) for e in edit_list])
    return readings


# -- most common tokens -------------------------------------------------------------------------------
MOST_COMMON_COLUMNS = ("token_id", "token", "count", "n_layers", "per_layer")


def band_layers(reading: PromptReading, band: tuple[int, int] | Sequence[int] | None = None, *,
                include_output: bool = False) -> list[int]:
    """The reading's layers inside ``band``: ``(lo, hi)`` inclusive, or a list of layers.

    ``None`` is every layer of the reading below the model's output row (``include_output`` keeps it).

    Raises:
        ValueError: a band that holds none of the reading's layers.
    """
    if band is None:
        chosen = [layer for layer in reading.layers if include_output or layer != reading.output_layer]
    elif isinstance(band, tuple) and len(band) == 2:
        lo, hi = sorted(int(x) for x in band)
        chosen = [layer for layer in reading.layers if lo <= layer <= hi]
    else:
        wanted = {int(x) for x in band}
        chosen = [layer for layer in reading.layers if layer in wanted]
    if not chosen:
        raise ValueError(f"The layer band {band} holds none of the reading's layers {reading.layers}.")
    return chosen


def most_common_tokens(reading: PromptReading, *, layers: tuple[int, int] | Sequence[int] | None = None,
                       positions: Iterable[int] | None = None, word_like: bool = False,
                       top_n: int = 20) -> pd.DataFrame:
    """The tokens that are a lens's top-1 most often across positions, within a band of layers.

    Each (layer, position) cell of the band contributes its top-1 token. With ``word_like`` a cell
    contributes its most probable *word-like* token among its top-k (:func:`~jlens_core.reading.tokens.is_word_like`)
    and nothing when its top-k holds none.

    Args:
        reading: a :class:`PromptReading`.
        layers: a band ``(lo, hi)`` (inclusive) or a list of layers; default every layer below the
            model's output row (what the middle layers hold, not the model's own answer).
        positions: positions to count over (default all of the reading's).
        word_like: count word-like tokens only.
        top_n: rows returned (the most frequent first; ties by token id).

    Returns:
        DataFrame with columns :data:`MOST_COMMON_COLUMNS`: ``count`` (cells where it is top-1),
        ``n_layers`` (layers where it is top-1 at least once) and ``per_layer`` (``{layer: count}``).
    """
    chosen = band_layers(reading, layers)
    pos = reading.positions.tolist() if positions is None else [int(p) for p in positions]
    cols = [reading.position_index(p) for p in pos]
    word: dict[int, bool] | None = {} if word_like else None
    counts: dict[int, dict[int, int]] = {}
    for layer in chosen:
        li = reading.layer_index(layer)
        for pi in cols:
            row = reading.top_ids[li, pi]  # [top_k]
            token = int(row[0])
            if word is not None:
                token = -1
                for candidate in row.tolist():
                    if candidate not in word:
                        name = reading.vocab_strings[candidate] if candidate < len(reading.vocab_strings) else ""
                        word[candidate] = is_word_like(name)
                    if word[candidate]:
                        token = int(candidate)
                        break
                if token < 0:
                    continue
            per_layer = counts.setdefault(token, {})
            per_layer[layer] = per_layer.get(layer, 0) + 1
    rows = [{"token_id": tid, "token": reading._names([tid])[0], "count": sum(per.values()),
             "n_layers": len(per), "per_layer": dict(sorted(per.items()))} for tid, per in counts.items()]
    rows.sort(key=lambda r: (-r["count"], r["token_id"]))
    return pd.DataFrame(rows[: max(0, int(top_n))], columns=list(MOST_COMMON_COLUMNS))


# -- comparing two readings ------------------------------------------------------------------------
COMPARE_STATS = ("entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank")


def _check_comparable(a: PromptReading, b: PromptReading) -> None:
    if not np.array_equal(a.input_ids, b.input_ids):
        raise ValueError("The two readings are of different prompts (their token ids differ): read the same "
                         "prompt with both lenses.")
    if not np.array_equal(a.positions, b.positions):
        raise ValueError(f"The two readings read different positions ({a.positions.tolist()} vs "
                         f"{b.positions.tolist()}): read the same positions.")


def difference(a: PromptReading, b: PromptReading, stat: str = "kl_bits") -> pd.DataFrame:
    """``a - b`` of one statistic over the layers both readings have, for the app's difference mode.

    Returns:
        DataFrame indexed by layer (the common layers, ascending), one column per position.

    Raises:
        ValueError: different prompts or positions, no common layer, or an unknown ``stat``.
    """
    _check_comparable(a, b)
    common = [layer for layer in a.layers if layer in b.layers]
    if not common:
        raise ValueError(f"The readings share no layer ({a.layers} vs {b.layers}).")
    values = a.grid(stat, layers=common) - b.grid(stat, layers=common)
    return pd.DataFrame(values, index=pd.Index(common, name="layer"),
                        columns=pd.Index(a.positions.tolist(), name="position"))


def compare_readings(a: PromptReading, b: PromptReading, *, names: tuple[str, str] = ("a", "b")) -> pd.DataFrame:
    """Long frame over the (layer, position) cells both readings have, side by side.

    Columns: ``layer, position, token``, then for each of ``entropy_bits, kl_bits, ce_bits,
    next_token_rank, final_top1_rank``: ``<stat>_<name_a>``, ``<stat>_<name_b>`` and
    ``<stat>_diff`` (= a - b), then ``top1_<name_a>``, ``top1_<name_b>`` and ``same_top1``.

    Raises:
        ValueError: different prompts or positions, no common layer, or equal names.
    """
    _check_comparable(a, b)
    na, nb = names
    if na == nb:
        raise ValueError(f"names must differ, got {names}.")
    common = [layer for layer in a.layers if layer in b.layers]
    if not common:
        raise ValueError(f"The readings share no layer ({a.layers} vs {b.layers}).")
    rows_a = [a.layers.index(layer) for layer in common]
    rows_b = [b.layers.index(layer) for layer in common]
    n_p = a.n_positions
    data: dict[str, Any] = {"layer": np.repeat(np.asarray(common, dtype=np.int64), n_p),
                            "position": np.tile(a.positions, len(common)),
                            "token": [a.tokens[p] for p in np.tile(a.positions, len(common)).tolist()]}
    for stat in COMPARE_STATS:
        va = a.grid(stat)[rows_a].reshape(-1)
        vb = b.grid(stat)[rows_b].reshape(-1)
        data[f"{stat}_{na}"], data[f"{stat}_{nb}"], data[f"{stat}_diff"] = va, vb, va - vb
    top_a = a.top_ids[rows_a, :, 0].reshape(-1)
    top_b = b.top_ids[rows_b, :, 0].reshape(-1)
    data[f"top1_{na}"] = a._names(top_a)
    data[f"top1_{nb}"] = b._names(top_b)
    data["same_top1"] = top_a == top_b
    return pd.DataFrame(data)


__all__ = [
    "CHUNK_ELEMENTS",
    "COMPARE_STATS",
    "FRAME_COLUMNS",
    "GRID_STATS",
    "MOST_COMMON_COLUMNS",
    "STATS_BLOCK_ELEMENTS",
    "PromptReading",
    "as_lens_dict",
    "band_layers",
    "check_lens",
    "chunk_size",
    "compare_readings",
    "difference",
    "distribution_stats",
    "encode_prompt",
    "model_vocab_size",
    "most_common_tokens",
    "rank_of",
    "read_prompt",
    "read_prompts",
    "readable_layers",
    "record_residuals",
    "resolve_positions",
]
