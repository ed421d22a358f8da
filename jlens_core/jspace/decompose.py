"""Decompose residuals into the J-space and a remainder, with controls (docs/method.md §11.2-§11.4).

:func:`decompose` runs the greedy nonnegative pursuit (:mod:`jlens_core.jspace.pursuit`) of ``x`` over the
J-space dictionary of one layer (:func:`~jlens_core.jspace.dictionary.jspace`) and, beside it, two controls:

* **random dictionary**: as many unit atoms as the J dictionary, Gaussian, seeded (the selection and the fit use
  unit atoms, so matching the atom norms changes nothing); what any dictionary of that size explains;
* **shuffled**: the same J dictionary with its ``d_model`` coordinates permuted (seeded; equivalently ``x``'s
  coordinates permuted): the dictionary keeps its geometry (norms, coherence, its few dominant directions), only its
  alignment with ``x`` is broken. For token-level claims, ``shuffled_token_ids`` are the selected atoms' labels
  under a seeded permutation of the dictionary's tokens (the explained fraction does not depend on labels).

:func:`split` is the same for one vector (a concept or steering vector): its J part and non-J part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from jaxtyping import Bool, Float, Int

from .._keywords import checked_options
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.tokens import TokenDisplay
from ..seeds import generator, unit_directions
from .dictionary import BF16_MIN_ROWS, JSpace, LayerStack, bf16_selection, check_gauge, jspace
from .pursuit import Bf16Atoms, Pursuit, Select, bounded_best, check_method, greedy_pursuit

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

TARGETS = ("raw", "mean-subtracted")
DEFAULT_K = 25

# one random dictionary kept (the last one asked for): (n_atoms, d, seed) -> unit atoms [n_atoms, d] fp32
_RANDOM: dict[tuple[int, int, int], torch.Tensor] = {}
# and its bf16 rows to select from (bf16_selection), made on first use
_RANDOM_BF16: dict[tuple[int, int, int], Bf16Atoms] = {}


def random_dictionary(n_atoms: int, d_model: int, seed: int) -> Float[torch.Tensor, "n_atoms d_model"]:
    """``n_atoms`` unit Gaussian atoms ``[n_atoms, d_model]`` fp32 from a generator seeded with ``seed``: the random
    control's dictionary. The last one is kept (one block: 113 MB for SmolLM2-135M's vocabulary)."""
    key = (int(n_atoms), int(d_model), int(seed))
    if key not in _RANDOM:
        _RANDOM.clear()
        _RANDOM_BF16.clear()
        _RANDOM[key] = unit_directions(int(n_atoms), int(d_model), generator(seed))
    return _RANDOM[key]


def _random_select(n_atoms: int, d_model: int, seed: int) -> Select | None:
    """The random dictionary's exact selection from bf16 products where :func:`bf16_selection` holds."""
    if not bf16_selection():
        return None
    key = (int(n_atoms), int(d_model), int(seed))
    unit = random_dictionary(n_atoms, d_model, seed)
    if key not in _RANDOM_BF16:
        _RANDOM_BF16[key] = Bf16Atoms.of(unit)
    atoms = _RANDOM_BF16[key]

    def select(r: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if r.shape[0] < BF16_MIN_ROWS:
            corr = r @ unit.T
            if chosen.numel():
                corr.scatter_(1, chosen, -math.inf)
            return corr.max(-1)
        best, pick, _ = bounded_best(r, None, atoms, None, chosen)
        return best, pick

    return select


def check_k(k: int, limit: int) -> int:
    """``k`` as an int in ``1..limit``.

    Raises:
        ValueError: ``k`` not an integer, below 1, or above ``limit`` (the residual width: more atoms than dimensions
            fit anything).
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k={k!r} is not a whole number of atoms: give an integer from 1 to {limit}.")  # noqa: TRY004
    if not 1 <= k <= limit:
        raise ValueError(f"k={k} atoms is out of range: give 1..{limit} (the paper uses k <= 25; beyond the residual "
                         "width any vector is fitted).")
    return k


@dataclass(frozen=True)
class Decomposition:
    """A batch of residuals split into their J-space part and the rest (module docstring). Row ``i`` is ``x[i]``
    (a single vector gives ``n = 1``); atoms are in selection order, padded with ``-1`` after an early stop.

    Attributes:
        layer, gauge, method, target, k: how it was made.
        x: ``float32[n, d_model]``: what was decomposed (the target: ``x`` itself, or ``x`` minus a mean).
        token_ids: ``LongTensor[n, k]``: the selected atoms' tokens (``-1``: none).
        tokens: ``list[list[str]]``: their texts (selected atoms only).
        coefficients: ``float32[n, k]``, ``>= 0``: on the **unit** atoms (a length in residual units; divide by the
            atom's norm, :attr:`JSpace.norms`, for the coefficient on ``v_t``).
        active: ``bool[n, k]``: selected atoms whose coefficient is nonzero.
        j_part: ``float32[n, d_model]``: ``x_J = sum_j c_j v̂_j`` (with ``method="nnls"`` the projection of ``x`` onto
            the span of the active atoms).
        remainder: ``float32[n, d_model]``: ``x - x_J``.
        explained: ``float32[n]``: ``1 - ||x - x_J||^2 / ||x||^2``.
        explained_by_step: ``float32[n, k]``: the same after each greedy step.
        random_explained, random_explained_by_step: the random dictionary's (NaN without controls).
        shuffled_explained: the coordinate-shuffled J dictionary's (NaN without controls).
        shuffled_token_ids: ``LongTensor[n, k]``: the selected atoms' tokens under a seeded permutation of the
            dictionary's labels (``-1`` where none).
    """

    layer: int
    gauge: str
    method: str
    target: str
    k: int
    x: Float[torch.Tensor, "n d_model"]
    token_ids: Int[torch.Tensor, "n k"]
    tokens: list[list[str]]
    coefficients: Float[torch.Tensor, "n k"]
    active: Bool[torch.Tensor, "n k"]
    j_part: Float[torch.Tensor, "n d_model"]
    remainder: Float[torch.Tensor, "n d_model"]
    explained: Float[torch.Tensor, " n"]
    explained_by_step: Float[torch.Tensor, "n k"]
    random_explained: Float[torch.Tensor, " n"]
    random_explained_by_step: Float[torch.Tensor, "n k"]
    shuffled_explained: Float[torch.Tensor, " n"]
    shuffled_token_ids: Int[torch.Tensor, "n k"]

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    @property
    def occupancy(self) -> Int[torch.Tensor, " n"]:
        """Active atoms per row ``[n]``."""
        return self.active.sum(dim=-1)

    def steps_to(self, fraction: float = 0.9, *, control: bool = False) -> Int[torch.Tensor, " n"]:
        """The smallest number of greedy steps whose fit explains ``fraction`` of what all ``k`` explain, per row
        ``[n]`` (``control``: the random dictionary's). A row whose final fit explains nothing gives 0."""
        by_step = self.random_explained_by_step if control else self.explained_by_step
        final = by_step[:, -1:]
        reached = by_step >= fraction * final
        first = reached.float().argmax(dim=-1) + 1
        return torch.where(final[:, 0] > 0, first, torch.zeros_like(first))

    def atoms(self, row: int = 0) -> list[tuple[str, int, float]]:
        """``(token, id, coefficient)`` of row ``row``'s active atoms, largest coefficient first."""
        out = [(self.tokens[row][j], int(self.token_ids[row, j]), float(self.coefficients[row, j]))
               for j in range(self.k) if bool(self.active[row, j])]
        return sorted(out, key=lambda a: -a[2])


def _as_rows(x: torch.Tensor, d_model: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() not in (1, 2) or x.shape[-1] != d_model:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x has shape {shape}: give a tensor [d_model] or [n, d_model] with d_model={d_model}.")
    rows = x.detach().float().cpu().reshape(-1, d_model)
    if rows.shape[0] == 0:
        raise ValueError("x has no rows: give at least one vector.")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError("x has a NaN or infinite entry: give finite vectors.")
    return rows


def _explained(x: torch.Tensor, residual_by_step: torch.Tensor) -> torch.Tensor:
    total = x.double().pow(2).sum(-1, keepdim=True)
    return (1.0 - residual_by_step / total).float()


def jspace_pursuit(space: JSpace, x: Float[torch.Tensor, "n d_model"], k: int, method: str) -> Pursuit:
    """The greedy pursuit of rows ``x`` over ``space`` (its exact bf16 selection where it has one)."""
    return greedy_pursuit(x, k, correlate=space.correlations, fetch=space.unit_atoms_at, method=method,
                          select=space.select)


def random_pursuit(x: Float[torch.Tensor, "n d_model"], k: int, n_atoms: int, seed: int, method: str) -> Pursuit:
    """The greedy pursuit of rows ``x`` over the random control's dictionary (:func:`random_dictionary` of
    ``n_atoms`` atoms, ``seed``)."""
    d = int(x.shape[-1])
    unit = random_dictionary(n_atoms, d, seed)
    return greedy_pursuit(x, k, correlate=lambda r: r @ unit.T, fetch=lambda i: unit[i].double(), method=method,
                          select=_random_select(n_atoms, d, seed))


class DecomposeKeywords(TypedDict, total=False):
    """:func:`decompose`'s further keywords (its Args): the mean a mean-subtracted target subtracts, the
    dictionary's vocabulary, whether the controls run, their seed."""

    mean: torch.Tensor | None
    vocab: str | Sequence[int] | None
    controls: bool | str
    seed: int


def decompose(model: LensModel, lens: Lens, x: Float[torch.Tensor, "*n d_model"], layer: int, *,
              k: int = DEFAULT_K, method: str = "gradient_pursuit", gauge: str = "centred", target: str = "raw",
              **options: Unpack[DecomposeKeywords]) -> Decomposition:
    """Decompose ``x`` (``[d_model]`` or ``[n, d_model]``, layer-``layer`` residuals or any vectors there) into at most
    ``k`` nonnegative J-space atoms plus a remainder (module docstring; docs/method.md §11.2).

    Args:
        model, lens, layer: the dictionary (:func:`~jlens_core.jspace.dictionary.jspace`).
        k: greedy steps, ``1..d_model`` (the paper: at most 25).
        method: ``"gradient_pursuit"`` (the paper's) or ``"nnls"`` (exact on the selected atoms).
        gauge: ``"centred"`` or ``"raw"`` atoms.
        target: ``"raw"`` (``x`` itself) or ``"mean-subtracted"``: ``x - mean`` (``mean`` a ``[d_model]`` vector such as
            a corpus's mean residual at the layer; without it the mean of ``x``'s rows, which needs ``n >= 2``).
        vocab: the dictionary's tokens (``None``: all; ``"word"``; a list of ids).
        controls: also run the random-dictionary and shuffled controls (three pursuits instead of one); ``"random"``:
            the random dictionary only (two pursuits).
        seed: the controls' seed (random dictionary ``seed``, permutations ``derive_seed(seed, 1)``,
            :mod:`jlens_core.seeds`).
        mean, vocab, controls, seed: :class:`DecomposeKeywords`, by keyword.

    Raises:
        ValueError: a layer outside the lens, a lens with no matrices, ``k`` out of range, an unknown method, gauge
            or target, a zero row, or a mean-subtracted target of one row with no ``mean``.
        TypeError: a keyword that is none of these.
    """
    given = _checked("decompose", options, method, gauge, target)
    rows = _target_rows(model, x, target, given.get("mean"))
    space = jspace(model, lens, layer, gauge=gauge, vocab=given.get("vocab"))
    k = check_k(k, min(int(model.d_model), space.n_atoms))
    found = jspace_pursuit(space, rows, k, method)
    return _decomposition(model, space, rows, found, k, method, gauge, target, given)


def _checked(name: str, options: Mapping[str, Any], method: str, gauge: str, target: str) -> dict[str, Any]:
    """``options`` checked (:class:`DecomposeKeywords`), with the method, the gauge and the target."""
    given = checked_options(name, options, DecomposeKeywords)
    controls = given.get("controls", True)
    if controls not in (True, False, "random"):
        raise ValueError(f"controls={controls!r} is not a choice of controls: use True (the random dictionary and the "
                         "shuffled one), 'random' (the random dictionary only) or False.")
    check_method(method)
    check_gauge(gauge)
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not a decomposition target: use 'raw' or 'mean-subtracted'.")
    return dict(given)


def _target_rows(model: LensModel, x: torch.Tensor, target: str, mean: torch.Tensor | None) -> torch.Tensor:
    """The rows to decompose: ``x`` as ``[n, d]``, minus the mean for a mean-subtracted target; no zero row."""
    d = int(model.d_model)
    rows = _as_rows(x, d)
    if target == "mean-subtracted":
        if mean is None:
            if rows.shape[0] < 2:
                raise ValueError("target='mean-subtracted' of one vector needs its mean: pass mean= (e.g. the "
                                 "layer's mean residual over a corpus) or decompose several rows.")
            mean = rows.mean(dim=0)
        rows = rows - _as_rows(mean, d)[0]
    zero = rows.norm(dim=-1) == 0
    if bool(zero.any()):
        raise ValueError(f"Row {int(torch.nonzero(zero)[0])} of x is the zero vector: it has no decomposition "
                         "(its explained fraction is undefined).")
    return rows


def _decomposition(model: LensModel, space: JSpace, rows: torch.Tensor, found: Pursuit, k: int, method: str,
                   gauge: str, target: str, given: Mapping[str, Any]) -> Decomposition:
    """The :class:`Decomposition` of ``rows`` from their pursuit over ``space``, with the controls ``given`` asks."""
    controls: bool | str = given.get("controls", True)
    seed: int = given.get("seed", 0)
    d = int(model.d_model)
    n = rows.shape[0]
    has = found.indices >= 0
    token_ids = torch.where(has, space.token_ids[found.indices.clamp_min(0)], -1)
    texts = TokenDisplay.for_tokenizer(model.tokenizer, vocab_size=int(model.vocab_size)).texts
    tokens = [[texts[int(t)] if 0 <= int(t) < len(texts) else f"<id:{int(t)}>" for t in row if int(t) >= 0]
              for row in token_ids]
    explained_by_step = _explained(rows, found.residual_by_step)
    gen = generator(seed, 1)
    label_perm = torch.randperm(space.n_atoms, generator=gen)
    shuffled_ids = torch.where(has, space.token_ids[label_perm[found.indices.clamp_min(0)]], -1)
    nan = torch.full((n,), math.nan)
    random_by_step = torch.full((n, k), math.nan)
    shuffled = nan.clone()
    if controls:
        rnd = random_pursuit(rows, k, space.n_atoms, seed, method)
        random_by_step = _explained(rows, rnd.residual_by_step)
    if controls is True:
        coords = torch.randperm(d, generator=gen)
        shuf = jspace_pursuit(space, rows[:, coords], k, method)
        shuffled = _explained(rows, shuf.residual_by_step)[:, -1]
    j_part = found.fitted.float()
    return Decomposition(layer=space.layer, gauge=gauge, method=method, target=target, k=k, x=rows,
                         token_ids=token_ids, tokens=tokens, coefficients=found.coefficients.float(),
                         active=found.active, j_part=j_part, remainder=(rows.double() - found.fitted).float(),
                         explained=explained_by_step[:, -1].clone(), explained_by_step=explained_by_step,
                         random_explained=random_by_step[:, -1].clone(), random_explained_by_step=random_by_step,
                         shuffled_explained=shuffled, shuffled_token_ids=shuffled_ids)


STACK_ROWS = 256  # rows per stacked pursuit: the bf16 product's speed per row levels off about there (method §11.2)


def decompose_layers(model: LensModel, lens: Lens, xs: Mapping[int, Float[torch.Tensor, "*n d_model"]], *,
                     k: int = DEFAULT_K, method: str = "gradient_pursuit", gauge: str = "centred", target: str = "raw",
                     **options: Unpack[DecomposeKeywords]) -> dict[int, Decomposition]:
    """:func:`decompose` of several layers' rows (``{layer: x}``), the same decompositions, faster: layers are
    stacked into pursuits of up to :data:`STACK_ROWS` rows, whose atoms are selected from one low-precision product
    over the shared head (a larger product runs faster per row) and each row's block bounded with its own layer's
    atom norms (:class:`~jlens_core.jspace.dictionary.LayerStack`). The controls, where asked, run per layer.

    Raises:
        ValueError, TypeError: as :func:`decompose`, for the first layer that has one.
    """
    given = _checked("decompose_layers", options, method, gauge, target)
    prepared = []
    for layer, x in xs.items():
        rows = _target_rows(model, x, target, given.get("mean"))
        prepared.append((layer, jspace(model, lens, layer, gauge=gauge, vocab=given.get("vocab")), rows))
    if not prepared:
        return {}
    k = check_k(k, min(int(model.d_model), min(space.n_atoms for _, space, _ in prepared)))
    stacks: list[list[tuple[int, JSpace, torch.Tensor]]] = [[]]
    for item in prepared:  # consecutive layers, at most STACK_ROWS rows a stack (a layer larger than that alone)
        if stacks[-1] and sum(r.shape[0] for _, _, r in stacks[-1]) + item[2].shape[0] > STACK_ROWS:
            stacks.append([])
        stacks[-1].append(item)
    out: dict[int, Decomposition] = {}
    for stack in stacks:
        found = jspace_pursuits([space for _, space, _ in stack], [rows for _, _, rows in stack], k, method)
        for (layer, space, rows), one in zip(stack, found):
            out[layer] = _decomposition(model, space, rows, one, k, method, gauge, target, given)
    return out


def jspace_pursuits(spaces: Sequence[JSpace], xs: Sequence[torch.Tensor], k: int, method: str) -> list[Pursuit]:
    """One greedy pursuit of the rows ``xs[i]`` over ``spaces[i]`` together (:class:`LayerStack`); a
    :class:`Pursuit` per space."""
    if len(spaces) == 1:
        return [jspace_pursuit(spaces[0], xs[0], k, method)]
    sizes = [int(x.shape[0]) for x in xs]
    groups = torch.repeat_interleave(torch.arange(len(xs)), torch.tensor(sizes))
    stack = LayerStack(tuple(spaces))

    def no_correlate(r: torch.Tensor) -> torch.Tensor:  # the stack always selects
        raise RuntimeError("a layer stack selects through LayerStack.select")

    found = greedy_pursuit(torch.cat(list(xs)), k, correlate=no_correlate, fetch=stack.fetch,  # type: ignore[arg-type]
                           method=method, select=stack.select, groups=groups)  # type: ignore[arg-type]
    ends = torch.cumsum(torch.tensor(sizes), 0).tolist()
    return [Pursuit(found.indices[a:b], found.coefficients[a:b], found.fitted[a:b], found.residual_by_step[a:b],
                    found.method) for a, b in zip([0, *ends[:-1]], ends)]


@dataclass(frozen=True)
class Split:
    """One vector split into its J part and its non-J part (docs/method.md §11.4).

    Attributes:
        vector: ``float32[d_model]``: the vector split.
        j_part: ``float32[d_model]``: its J-space component (:attr:`Decomposition.j_part`).
        non_j_part: ``float32[d_model]``: ``vector - j_part``.
        j_share: ``1 - ||non_j||^2 / ||vector||^2`` (the explained fraction).
        non_j_share: ``||non_j||^2 / ||vector||^2`` (``j_share + non_j_share = 1``).
        decomposition: the :class:`Decomposition` (one row, with its controls).
    """

    vector: Float[torch.Tensor, " d_model"]
    j_part: Float[torch.Tensor, " d_model"]
    non_j_part: Float[torch.Tensor, " d_model"]
    j_share: float
    non_j_share: float
    decomposition: Decomposition


def split(model: LensModel, lens: Lens, vector: Float[torch.Tensor, " d_model"], layer: int, *, k: int = DEFAULT_K,
          gauge: str = "centred", method: str = "gradient_pursuit", controls: bool = True, seed: int = 0) -> Split:
    """Split ``vector [d_model]`` (a concept, probe or steering vector at ``layer``) into its J part and non-J part.

    Raises:
        ValueError: as :func:`decompose` (a zero vector, a layer outside the lens, ...), or a batch.
    """
    if not isinstance(vector, torch.Tensor) or vector.dim() != 1:
        shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
        raise ValueError(f"split takes one vector [d_model]; got {shape} (use decompose for a batch).")
    dec = decompose(model, lens, vector, layer, k=k, method=method, gauge=gauge, controls=controls, seed=seed)
    share = float(dec.explained[0])
    return Split(vector=dec.x[0], j_part=dec.j_part[0], non_j_part=dec.remainder[0], j_share=share,
                 non_j_share=1.0 - share, decomposition=dec)


__all__ = ["DEFAULT_K", "STACK_ROWS", "TARGETS", "DecomposeKeywords", "Decomposition", "Split", "check_k", "decompose",
           "decompose_layers", "jspace_pursuit", "jspace_pursuits", "random_dictionary", "random_pursuit", "split"]
