"""The J-space dictionary of one layer (docs/method.md §11.1): the lens's read vectors of every vocabulary token.

At layer ``l`` the atom of token ``t`` is its read vector ``v_t = M_l^T C (gamma * P^T u_t)``
(:func:`~jlens_core.interventions.read_directions.read_vector`; ``M_l = J_l`` for the Jacobian lens), in the
centred gauge ``v_t - m_l`` with ``m_l`` the mean over the vocabulary (``read_vector(..., centred=True)``,
docs/method.md §9.1). The block ``[vocab, d_model]`` is never formed: the correlation of ``x`` with every atom is

    <v_t, x> = u_t . (gamma * C (M_l x))   (minus <m_l, x> in the centred gauge)

one product of ``x`` with the head matrix ``[d_model, vocab]`` (which :func:`head_matrix` keeps once per model,
shared by every layer); the atom norms are computed once per layer in vocabulary chunks
(:func:`~jlens_core.interventions.read_directions.read_vector_norms`) and kept per lens and layer (``[vocab]``
floats). A few atoms (the selected ones) are built on demand.
"""

from __future__ import annotations

import hashlib
import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from jaxtyping import Float, Int

from ..interventions.read_directions import (
    check_layers,
    head_matrix,
    mean_read_vector,
    norm_gain,
    read_vector_norms,
)
from ..lenses.protocol import Lens
from ..models.cpu_features import cpu_bf16_flag
from ..models.model import LensModel
from ..reading.tokens import TokenDisplay
from ..reading.word_readout import word_mask
from .pursuit import Bf16Atoms, bounded_best, bounded_best_blocks, fp16_selection_available

log = logging.getLogger(__name__)

GAUGES = ("centred", "raw")
CHUNK = 8192  # vocabulary columns per product when the head is not fp32 or a sub-vocabulary is used

# Select atoms from bf16 products (exact under a bound, docs/method.md §11.2): None asks the CPU (AMX-BF16 or
# AVX512-BF16 run them fast; elsewhere bf16 is emulated and slower than fp32), True / False force it.
BF16_SELECTION: bool | None = None
# Below this many rows the bf16 product does not win (measured: torch has no fast bf16 matrix-vector kernel on the CPU;
# one row is 4.5 ms in fp32 against 7-9 ms in bf16 over SmolLM2-135M's head on one thread; from four rows bf16 wins).
BF16_MIN_ROWS = 4
# Fewer rows select from fp16 products where torch's fp16 matrix-vector kernel runs with fp32 sums (one row over that
# head: 1.9 ms against 4.8 ms in fp32, two threads): None asks torch, True / False force it.
FP16_SELECTION: bool | None = None
# model -> (the head's data pointer, {dtype: its rows in bf16 / fp16 with their bound terms and a contiguous fp32 copy})
_HEAD_LOW: weakref.WeakKeyDictionary[LensModel, tuple[int, dict[torch.dtype, Bf16Atoms]]] = weakref.WeakKeyDictionary()
# lens -> {(id(model), layer, gauge): atom norms [vocab] fp32}: computing them is one [vocab, d] x [d, d] pass
_NORMS: weakref.WeakKeyDictionary[Lens, dict[tuple[int, int, str], torch.Tensor]] = weakref.WeakKeyDictionary()


def check_gauge(gauge: str) -> str:
    if gauge not in GAUGES:
        raise ValueError(f"gauge={gauge!r} is not a J-space gauge: use 'centred' (read vectors minus their mean over "
                         "the vocabulary) or 'raw'.")
    return gauge


def _matrix(lens: Lens, layer: int) -> torch.Tensor:
    """``M_l`` fp32 ``[d, d]`` (CPU), the linear part of the lens's transport.

    Raises:
        ValueError: a lens with no matrix at ``layer`` (its transport is not linear or affine).
    """
    try:
        return lens.matrix(int(layer)).detach().float().cpu()
    except (NotImplementedError, AttributeError):
        raise ValueError(f"The {getattr(lens, 'kind', type(lens).__name__)} lens has no matrix at layer {layer}, so "
                         "it has no J-space dictionary: the J-space is defined for lenses whose transport is linear "
                         "or affine (logit, Jacobian, R, J++/R++ and expert, tuned).") from None


def _all_norms(model: LensModel, lens: Lens, layer: int, gauge: str) -> torch.Tensor:
    key = (id(model), int(layer), gauge)
    try:
        cache = _NORMS.setdefault(lens, {})
    except TypeError:  # a lens that cannot be weakly referenced is not cached
        cache = {}
    if key not in cache:
        cache[key] = _stored_norms(model, lens, layer, gauge)
    return cache[key]


# Atom norms cost vocab x d^2 multiply-adds per layer (33 GFLOP for SmolLM2-135M, ~0.2 s at this CPU's fp32 peak);
# from this many up they are kept on disk, keyed by what they depend on, so a later process reads them.
STORE_NORMS_FROM_FLOP = 1e9
_HEAD_DIGEST: weakref.WeakKeyDictionary[LensModel, str] = weakref.WeakKeyDictionary()


def _head_digest(model: LensModel, head: torch.Tensor) -> str:
    try:
        cached = _HEAD_DIGEST.get(model)
    except TypeError:
        cached = None
    if cached is None:
        cached = hashlib.sha256(head.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()
        try:
            _HEAD_DIGEST[model] = cached
        except TypeError:
            pass
    return cached


def _stored_norms(model: LensModel, lens: Lens, layer: int, gauge: str) -> torch.Tensor:
    """The atom norms ``[vocab]`` fp32 of ``layer``: computed (:func:`read_vector_norms`), and for a large
    vocabulary kept in ``<jlens cache>/jspace-norms/<sha256>.npy``, the key hashing the lens's matrix at the
    layer, the head matrix, the final norm's gain, the gauge and the vocabulary size. An unreadable file is
    recomputed; the file is written atomically."""
    import numpy as np

    from .._atomic import atomic_write
    from ..models.loading import cache_dir

    d, vocab = int(model.d_model), int(model.vocab_size)
    centred = gauge == "centred"
    if 2.0 * vocab * d * d < STORE_NORMS_FROM_FLOP:
        return read_vector_norms(model, lens, layer, centred=centred).float()
    gamma, centres = norm_gain(model)
    digest = hashlib.sha256()
    for part in (_matrix(lens, layer), gamma.float()):
        digest.update(part.contiguous().numpy().tobytes())
    digest.update(f"{_head_digest(model, head_matrix(model))}|{bool(centres)}|{gauge}|{vocab}|{d}".encode())
    path = cache_dir() / "jspace-norms" / (digest.hexdigest()[:32] + ".npy")
    if path.is_file():
        try:
            stored = np.load(path, allow_pickle=False)
            if stored.shape == (vocab,) and stored.dtype == np.float32:
                return torch.from_numpy(stored)
        except (OSError, ValueError):
            pass
        log.info("recomputing the unreadable stored atom norms %s", path)
    norms = read_vector_norms(model, lens, layer, centred=centred).float()
    try:
        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:  # a file object: np.save would add ".npy" to a temporary name
                np.save(f, norms.numpy())

        atomic_write(path, write)
    except OSError as err:  # a read-only cache only costs the recomputation next time
        log.info("could not store the atom norms in %s: %s", path, err)
    return norms


def fp16_selection() -> bool:
    """Whether J-space pursuits of fewer than :data:`BF16_MIN_ROWS` rows select atoms from fp16 products:
    :data:`FP16_SELECTION`, or when it is ``None`` whether torch's fp16 matrix-vector kernel runs here with fp32
    sums (:func:`~jlens_core.jspace.pursuit.fp16_selection_available`)."""
    return fp16_selection_available() if FP16_SELECTION is None else bool(FP16_SELECTION)


def bf16_selection() -> bool:
    """Whether J-space pursuits select atoms from bf16 products: :data:`BF16_SELECTION`, or when it is ``None``
    whether this CPU has a bf16 matmul flag (:func:`~jlens_core.models.cpu_features.cpu_bf16_flag`)."""
    return cpu_bf16_flag() is not None if BF16_SELECTION is None else bool(BF16_SELECTION)


def _head_low(model: LensModel, head: torch.Tensor, dtype: torch.dtype) -> Bf16Atoms | None:
    """The head's rows ``[vocab, d]`` in ``dtype`` (bf16 or fp16, :class:`~jlens_core.jspace.pursuit.Bf16Atoms`)
    when the head matrix is fp32 on the CPU; ``None`` otherwise. Kept per model (the newest model only), both dtypes
    sharing one contiguous fp32 copy of the rows."""
    if head.dtype != torch.float32 or head.device.type != "cpu":
        return None
    try:
        cached = _HEAD_LOW.get(model)
    except TypeError:
        cached = None
    if cached is None or cached[0] != head.data_ptr():  # built from another head (the parts hold copies)
        cached = (head.data_ptr(), {})
    parts = cached[1].get(dtype)
    if parts is None:
        shared = next(iter(cached[1].values()), None)
        parts = Bf16Atoms.of(head.T if shared is None else shared.weight, dtype=dtype)
        cached[1][dtype] = parts
        try:
            if model not in _HEAD_LOW:
                _HEAD_LOW.clear()  # one model at a time, as the head matrix
            _HEAD_LOW[model] = cached
        except TypeError:
            pass
    return parts


def vocabulary_ids(model: LensModel, vocab: str | Sequence[int] | None) -> torch.Tensor | None:
    """The dictionary's token ids: ``None`` for the whole vocabulary, the word tokens for ``"word"``
    (docs/method.md §9.1), or the given ids (sorted, unique).

    Raises:
        ValueError: an unknown readout name, an empty list or an id outside the vocabulary.
    """
    size = int(model.vocab_size)
    if vocab is None or (isinstance(vocab, str) and vocab == "all"):
        return None
    if isinstance(vocab, str):
        if vocab != "word":
            raise ValueError(f"vocab={vocab!r} is not a vocabulary: use None (all tokens), 'word' or a list of ids.")
        mask = torch.from_numpy(word_mask(TokenDisplay.for_tokenizer(model.tokenizer, vocab_size=size)).copy())
        ids = torch.nonzero(mask[:size]).reshape(-1)
    else:
        ids = torch.tensor(sorted({int(t) for t in vocab}), dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("The dictionary's vocabulary is empty: give at least one token id.")
    if int(ids.min()) < 0 or int(ids.max()) >= size:
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"Token id {bad} is outside the vocabulary (0..{size - 1}).")
    return ids


@dataclass(frozen=True)
class JSpace:
    """The J-space dictionary of one layer: one atom per token, never stored as a block (module docstring).

    Attributes:
        layer: the source layer.
        gauge: ``"centred"`` (atoms ``v_t - m_l``) or ``"raw"`` (``v_t``).
        token_ids: ``LongTensor[n_atoms]``: the token of each atom (all ids ``< vocab_size``, or a sub-vocabulary).
        norms: ``float32[n_atoms]``: ``||atom||``.
        d_model: the residual width.
        lens_kind: the lens's kind.
    """

    layer: int
    gauge: str
    token_ids: Int[torch.Tensor, " n_atoms"]
    norms: Float[torch.Tensor, " n_atoms"]
    d_model: int
    lens_kind: str
    _transport: torch.Tensor = field(repr=False)  # M_l [d, d] fp32
    _gamma: torch.Tensor = field(repr=False)  # [d] fp32
    _centres: bool = field(repr=False)
    _mean: torch.Tensor | None = field(repr=False)  # m_l [d] fp32 in the centred gauge
    _head: torch.Tensor = field(repr=False)  # [d, vocab] head matrix (shared, not a copy)
    _subset: torch.Tensor | None = field(repr=False)  # token ids of a sub-vocabulary
    _inv_norms: torch.Tensor = field(repr=False)  # 1 / norms (0 for a zero atom)
    _bf16: Bf16Atoms | None = field(default=None, repr=False)  # the head in bf16, to select from (full vocabulary)
    _fp16: Bf16Atoms | None = field(default=None, repr=False)  # the head in fp16, to select for a few rows

    @property
    def n_atoms(self) -> int:
        return int(self.token_ids.numel())

    def _pre_head(self, x: torch.Tensor) -> torch.Tensor:
        """``gamma * C (M_l x)`` for rows ``x [n, d]`` (fp32): what the head rows meet."""
        z = x.float() @ self._transport.T
        if self._centres:
            z = z - z.mean(dim=-1, keepdim=True)
        return z * self._gamma

    def _products(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        x = x.detach().float().cpu().reshape(-1, self.d_model)
        z = self._pre_head(x).to(self._head.device)
        head = self._head
        offset = (-(x @ self._mean))[:, None].to(head.device) if self._mean is not None else None
        if self._subset is None and head.dtype == torch.float32:
            # one pass over the head: the centring offset and the norms folded into the product's output
            out = torch.addmm(offset, z, head) if offset is not None else z @ head
        else:
            cols = self._subset if self._subset is not None else torch.arange(head.shape[1])
            out = torch.cat([z @ head[:, cols[s:s + CHUNK].to(head.device)].float()
                             for s in range(0, int(cols.numel()), CHUNK)], dim=1)
            if offset is not None:
                out += offset
        if scale is not None:
            out *= scale.to(out.device)
        return out.float().cpu()

    def inner_products(self, x: Float[torch.Tensor, "n d_model"]) -> Float[torch.Tensor, "n n_atoms"]:
        """``<atom_t, x>`` fp32 ``[n, n_atoms]`` for rows ``x [n, d_model]`` (not normalised)."""
        return self._products(x, None)

    def correlations(self, x: Float[torch.Tensor, "n d_model"]) -> Float[torch.Tensor, "n n_atoms"]:
        """``<atom_t / ||atom_t||, x>`` fp32 ``[n, n_atoms]``: inner products with the unit atoms (0 for an atom
        whose norm is 0)."""
        return self._products(x, self._inv_norms)

    def select(self, x: Float[torch.Tensor, "m d_model"], chosen: Int[torch.Tensor, "m s"]
               ) -> tuple[Float[torch.Tensor, " m"], Int[torch.Tensor, " m"]]:
        """The largest correlation with a unit atom per row of ``x`` and its atom index, among atoms not in
        ``chosen`` (``int64[m, s]``): from low-precision products re-scored in fp32 where this dictionary keeps the
        head so (:func:`~jlens_core.jspace.pursuit.bounded_best`: the same atom as the fp32 correlations up to
        rounding ties): bf16 from :data:`BF16_MIN_ROWS` rows, fp16 below; else from :meth:`correlations`."""
        low = self._bf16 if x.shape[0] >= BF16_MIN_ROWS else self._fp16
        if low is None:
            corr = self.correlations(x)
            if chosen.numel():
                corr.scatter_(1, chosen, -math.inf)
            return corr.max(-1)
        x = x.detach().float().cpu().reshape(-1, self.d_model)
        offset = -(x @ self._mean) if self._mean is not None else None
        best, pick, _ = bounded_best(self._pre_head(x), offset, low, self._inv_norms, chosen)
        return best, pick

    def atoms(self, ids: Sequence[int] | Int[torch.Tensor, " m"]) -> Float[torch.Tensor, "m d_model"]:
        """The atoms of token ids ``ids`` as rows ``[m, d_model]`` fp32 (not normalised): ``read_vector`` of each
        (centred in the centred gauge).

        Raises:
            ValueError: an id that is not an atom of this dictionary.
        """
        ids_t = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if self._subset is not None and ids_t.numel():
            missing = ~torch.isin(ids_t, self._subset)
            if bool(missing.any()):
                raise ValueError(f"Token id {int(ids_t[missing][0])} is not in this dictionary's vocabulary.")
        vocab = int(self._head.shape[1])
        if ids_t.numel() and (int(ids_t.min()) < 0 or int(ids_t.max()) >= vocab):
            bad = ids_t[(ids_t < 0) | (ids_t >= vocab)][0]
            raise ValueError(f"Token id {int(bad)} is outside the vocabulary (0..{vocab - 1}).")
        low = self._bf16 or self._fp16
        if low is not None:  # the same fp32 rows, contiguous: a row gather, not a strided column gather
            rows = low.weight.index_select(0, ids_t) * self._gamma  # gamma * P^T u_t
        else:
            rows = self._head[:, ids_t.to(self._head.device)].T.float().cpu() * self._gamma
        if self._centres:
            rows = rows - rows.mean(dim=-1, keepdim=True)
        v = rows @ self._transport  # (M^T r)^T
        return v - self._mean if self._mean is not None else v

    def positions(self, ids: Int[torch.Tensor, " m"]) -> Int[torch.Tensor, " m"]:
        """The atom index (row of :meth:`correlations`) of each token id (all must be atoms)."""
        if self._subset is None:
            return ids.long()
        return torch.searchsorted(self._subset, ids.long())

    def unit_atoms_at(self, positions: Int[torch.Tensor, " m"]) -> Float[torch.Tensor, "m d_model"]:
        """The unit atoms ``[m, d_model]`` at atom indices ``positions``."""
        ids = self.token_ids[positions]
        v = self.atoms(ids)
        n = v.norm(dim=-1, keepdim=True)
        return torch.where(n > 0, v / n.clamp_min(1e-30), 0.0)


def _offset(x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """``-(x . m_l)`` per row (the centred gauge's offset), zeros in the raw gauge."""
    return -(x @ mean) if mean is not None else torch.zeros(x.shape[0])


def row_blocks(groups: Int[torch.Tensor, " m"]) -> list[tuple[int, int, int]]:
    """``[(group, start, end), ...]``: the runs of equal values in ``groups`` (nondecreasing)."""
    values, counts = torch.unique_consecutive(groups, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0, *ends[:-1]]
    return [(int(g), a, b) for g, a, b in zip(values.tolist(), starts, ends)]


@dataclass(frozen=True)
class LayerStack:
    """The J-spaces of several layers in one pursuit (``greedy_pursuit(groups=...)``): a row of group ``g`` is
    decomposed over ``spaces[g]``. The layers share the head, so every row's low-precision scores come from one
    larger matrix product (faster per row: docs/method.md §11.2); each block of rows is then bounded and re-scored
    with its own layer's atom norms, so a row selects exactly as it would alone."""

    spaces: tuple[JSpace, ...]

    def select(self, x: Float[torch.Tensor, "m d_model"], chosen: Int[torch.Tensor, "m s"],
               groups: Int[torch.Tensor, " m"]) -> tuple[Float[torch.Tensor, " m"], Int[torch.Tensor, " m"]]:
        """As :meth:`JSpace.select`, row blocks by ``groups``."""
        blocks = row_blocks(groups)
        low = self.spaces[blocks[0][0]]._bf16
        shared = low is not None and all(self.spaces[g]._bf16 is low for g, _, _ in blocks)
        if not shared or x.shape[0] < BF16_MIN_ROWS or len(blocks) == 1:
            best, pick = torch.empty(x.shape[0]), torch.empty(x.shape[0], dtype=torch.long)
            for g, a, b in blocks:
                best[a:b], pick[a:b] = self.spaces[g].select(x[a:b], chosen[a:b])
            return best, pick
        x = x.detach().float().cpu()
        z = torch.cat([self.spaces[g]._pre_head(x[a:b]) for g, a, b in blocks])
        offset = torch.cat([_offset(x[a:b], self.spaces[g]._mean) for g, a, b in blocks])
        best, pick, _ = bounded_best_blocks(z, offset, cast(Bf16Atoms, low),  # shared, so not None
                                            [(a, b, self.spaces[g]._inv_norms) for g, a, b in blocks], chosen)
        return best, pick

    def fetch(self, positions: Int[torch.Tensor, " m"], groups: Int[torch.Tensor, " m"]
              ) -> Float[torch.Tensor, "m d_model"]:
        """As :meth:`JSpace.unit_atoms_at`, row blocks by ``groups``."""
        out = torch.empty(int(positions.shape[0]), self.spaces[0].d_model)
        for g, a, b in row_blocks(groups):
            out[a:b] = self.spaces[g].unit_atoms_at(positions[a:b])
        return out


def jspace(model: LensModel, lens: Lens, layer: int, *, gauge: str = "centred",
           vocab: str | Sequence[int] | None = None) -> JSpace:
    """The J-space dictionary of ``layer`` under ``lens`` (module docstring; docs/method.md §11.1).

    Args:
        model: the model the lens reads.
        lens: any lens with a matrix per layer: logit (``M = I``), Jacobian, R, J++ / R++ and the expert lenses
            (their one combined matrix per layer), tuned (``I + A_l``, its bias plays no part).
        layer: a source layer the lens reads.
        gauge: ``"centred"`` (atoms ``v_t - m_l``) or ``"raw"`` (``v_t``).
        vocab: ``None`` (every token ``< vocab_size``), ``"word"`` (the word tokens) or a list of token ids.

    Memory: the head matrix ``[d_model, vocab]`` once per model (in the head's dtype; 113 MB fp32 for
    SmolLM2-135M), ``M_l`` ``[d, d]`` and the norms ``[vocab]`` per layer; no ``[vocab, d]`` block per layer. With
    bf16 selection (:func:`bf16_selection`) the head once more in bf16, ``[vocab, d + 1]`` (57 MB).

    Raises:
        ValueError: a layer outside the lens, an unknown gauge or vocabulary, or a lens with no matrices.
    """
    check_gauge(gauge)
    layer = check_layers(model, lens, [layer])[0]
    transport = _matrix(lens, layer)
    subset = vocabulary_ids(model, vocab)
    gamma, centres = norm_gain(model)
    all_norms = _all_norms(model, lens, layer, gauge)
    ids = torch.arange(int(model.vocab_size)) if subset is None else subset
    norms = all_norms if subset is None else all_norms[subset]
    if not bool((norms > 0).any()) or not math.isfinite(float(norms.max())):
        raise ValueError(f"The J-space of layer {layer} has no nonzero finite atom under this {lens.kind} lens.")
    mean = mean_read_vector(model, lens, layer).float().cpu() if gauge == "centred" else None
    head = head_matrix(model)
    low = _head_low(model, head, torch.bfloat16) if subset is None and bf16_selection() else None
    few = _head_low(model, head, torch.float16) if subset is None and fp16_selection() else None
    return JSpace(layer=layer, gauge=gauge, token_ids=ids, norms=norms, d_model=int(model.d_model),
                  lens_kind=str(lens.kind), _transport=transport, _gamma=gamma.float(), _centres=bool(centres),
                  _mean=mean, _head=head, _subset=subset,
                  _inv_norms=torch.where(norms > 0, 1.0 / norms.clamp_min(1e-30), 0.0), _bf16=low,
                  _fp16=few)


def clear_cache() -> None:
    """Forget the atom norms kept per lens and layer, and the bf16 / fp16 heads."""
    _NORMS.clear()
    _HEAD_LOW.clear()


__all__ = ["BF16_SELECTION", "FP16_SELECTION", "GAUGES", "JSpace", "LayerStack", "bf16_selection", "check_gauge",
           "clear_cache", "fp16_selection", "jspace", "row_blocks", "vocabulary_ids"]
