"""Make it say X, the cheap half: the target's spelling, the candidate edits and their first-order
ranking (docs/method.md §7.1).

One forward and one backward pass of the clean prompt give, at every searched layer ``l`` and prompt
position ``p``, the clean residual ``h_l[p]`` and the gradient ``g_l[p]`` of the readout's margin
``m = z_X - z_c`` (``X`` the target's first token, ``c`` the clean model's best other token). An edit
adds ``Δ_l[p]`` to the residuals it touches, so to first order it moves the margin by
``Σ_l Σ_p g_l[p] · Δ_l[p]``:

* steer ``s``: ``Δ = s ||h|| v̂_X``, linear in ``s``;
* swap ``A_l -> X``, scale ``α``: ``Δ = α V (swap(c) - c)`` with ``V = [v̂_A v̂_X]`` and ``c = V⁺ h`` (``A_l`` the
  lens's top token at layer ``l`` and the readout, other than ``X``), linear in ``α``;
* ablate the ``k`` best competitors ``t`` (the clean model's top tokens other than ``X``): ``Δ = -(h · v̂_t) v̂_t``
  summed over them.

The read directions ``v̂`` come from a :class:`Directions` provider: the lens's (:class:`LensDirections`) or
seeded random unit vectors (:class:`RandomDirections`, the control). The gradients do not depend on the lens,
so every arm of a search (the lens, the logit lens, the random control) ranks from the same backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.edit_hooks import EditRunner, PositionRule
from ..reading.tokens import encode_plain, spellings
from ..seeds import generator, unit_directions
from .lens_edits import swap_basis, swap_step
from .read_directions import token_directions

OPS = ("steer", "swap", "ablate")
POSITION_MODES = ("readout", "from")
DEFAULT_GRIDS: dict[str, tuple[float, ...]] = {"steer": (0.25, 0.5, 1.0, 2.0, 4.0), "swap": (1.0, 2.0, 4.0, 8.0, 16.0),
                                               "ablate": (1.0, 2.0, 4.0, 8.0)}
MAX_TARGET_TOKENS = 8  # a longer target is a sentence, not a word


@dataclass(frozen=True)
class SayTarget:
    """The word the model should say, as token ids.

    Attributes:
        word: as given. text: the text spelled (leading-space form after a prompt that does not end in
        whitespace). ids: its tokenisation (one id when a single token spells it). accepted: the first-token
        ids that count as saying it (every single-token spelling: as written, lower-cased, capitalised, with
        and without a leading space; for a multi-token word only ``ids[0]``).
    """

    word: str
    text: str
    ids: tuple[int, ...]
    accepted: frozenset[int]

    @property
    def single(self) -> bool:
        return len(self.ids) == 1


def spell_target(model: LensModel, target: str, prompt: str) -> SayTarget:
    """The target's token ids (see :class:`SayTarget`).

    Raises:
        ValueError: an empty target, one the tokenizer cannot spell (unknown characters, or tokens that do not
            read back as the word), or one longer than :data:`MAX_TARGET_TOKENS` tokens.
    """
    if not isinstance(target, str) or not target.strip():
        raise ValueError("The target is empty: give the word the model should say.")
    core = target.strip()
    if target[:1].isspace():  # spelled as given
        lead = target[: len(target) - len(target.lstrip())]
    else:  # a word after a prompt that ends mid-line starts with a space
        lead = "" if prompt[-1:].isspace() else " "
    table = spellings(model.tokenizer, core, vocab_size=model.vocab_size)
    if table:
        wanted = lead + core
        primary = table.get(wanted, next(iter(table.values())))
        return SayTarget(target, model.decode([primary]), (int(primary),), frozenset(int(i) for i in table.values()))
    text = lead + core
    ids = encode_plain(model.tokenizer, text)
    unk = getattr(model.tokenizer, "unk_token_id", None)
    back = model.decode(ids) if ids else ""
    if not ids or (unk is not None and unk in ids) or back != text or max(ids) >= int(model.vocab_size):
        raise ValueError(f"The tokenizer cannot spell the target {target!r}: its tokens read back as {back!r}; "
                         "give a word made of characters the tokenizer knows.")
    if len(ids) > MAX_TARGET_TOKENS:
        raise ValueError(f"The target {target!r} is {len(ids)} tokens long: give a word or a short phrase of at most "
                         f"{MAX_TARGET_TOKENS} tokens.")
    return SayTarget(target, text, tuple(int(i) for i in ids), frozenset({int(ids[0])}))


# -- directions ---------------------------------------------------------------------------------------
class Directions:
    """Unit directions ``[d_model]`` fp32 by ``(layer, token id)``; cached."""

    random = False

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, layer: int, tid: int) -> torch.Tensor:
        key = (int(layer), int(tid))
        if key not in self._cache:
            self._cache[key] = self._make(*key)
        return self._cache[key]

    def many(self, layer: int, ids: Sequence[int]) -> torch.Tensor:
        """``[k, d_model]``: the directions of ``ids`` at ``layer``."""
        return torch.stack([self(layer, t) for t in ids])

    def _make(self, layer: int, tid: int) -> torch.Tensor:
        raise NotImplementedError


class LensDirections(Directions):
    """The lens's unit read directions ``v̂_t`` (:func:`~jlens_core.interventions.read_directions.token_direction`)."""

    def __init__(self, model: LensModel, lens: Lens) -> None:
        super().__init__()
        self.model, self.lens = model, lens

    def many(self, layer: int, ids: Sequence[int]) -> torch.Tensor:
        return token_directions(self.model, self.lens, layer, ids)  # one vector-Jacobian product, cached there

    def __call__(self, layer: int, tid: int) -> torch.Tensor:
        return self.many(layer, [tid])[0]


class RandomDirections(Directions):
    """Seeded Gaussian directions normalised to unit length, one per ``(layer, token)``: norm-matched stand-ins for
    the unit read directions ``v̂_t`` (every edit uses unit vectors, so the edit's size is the same)."""

    random = True

    def __init__(self, d_model: int, seed: int = 0) -> None:
        super().__init__()
        self.d_model, self.seed = int(d_model), int(seed)

    def _make(self, layer: int, tid: int) -> torch.Tensor:
        return unit_directions(1, self.d_model, generator(self.seed, layer, tid))[0]


# -- the clean pass -------------------------------------------------------------------------------------
class _GradientProbe:
    """A residual edit that adds a zero leaf at every position of its layers (the identity), so that the leaf's
    gradient is the gradient with respect to the layer's output; it keeps the clean residuals too."""

    needs_clean = False

    def __init__(self, layers: Sequence[int], n: int) -> None:
        self.layers = list(layers)
        self.rule = PositionRule(tuple(range(n)))
        self.zeros: dict[int, torch.Tensor] = {}
        self.h: dict[int, torch.Tensor] = {}

    def selects(self, positions: torch.Tensor, n_prompt: int) -> torch.Tensor:
        return self.rule.selects(positions, n_prompt)

    def apply(self, layer: int, h: torch.Tensor, clean: torch.Tensor | None) -> torch.Tensor:
        self.h[layer] = h.detach().float()  # [n, d]
        zero = torch.zeros(h.shape, dtype=torch.float32, device=h.device, requires_grad=True)
        self.zeros[layer] = zero
        return h.float() + zero


@dataclass
class CleanPass:
    """The clean prompt's residuals and margin gradients at the searched layers (one forward, one backward).

    Attributes:
        n: prompt length in tokens (the readout is position ``n - 1``).
        h, g: ``{layer: [n, d_model] fp32}``: residual (layer output) and ``d margin / d residual``.
        logits: ``[vocab]`` fp32, the clean readout logits.
        competitor: the best token that is not the target (``c``); margin: ``z_X - z_c`` (logits).
    """

    n: int
    h: dict[int, torch.Tensor]
    g: dict[int, torch.Tensor]
    logits: torch.Tensor
    competitor: int
    margin: float

    def competitors(self, target: SayTarget, k: int) -> list[int]:
        """The clean model's ``k`` most probable readout tokens that do not spell the target."""
        masked = self.logits.clone()
        masked[list(target.accepted)] = -math.inf
        return [int(i) for i in masked.topk(max(0, int(k))).indices]


def clean_pass(model: LensModel, ids: torch.Tensor, target: SayTarget, layers: Sequence[int]) -> CleanPass:
    """The clean forward of ``ids [1, n]`` and the backward of the readout margin (see :class:`CleanPass`)."""
    n = int(ids.shape[1])
    probe = _GradientProbe(layers, n)
    runner = EditRunner(model, [probe], n)
    with torch.enable_grad():
        logits = runner.run(lambda: model.hf_model(input_ids=ids).logits[0, -1].float(), torch.arange(n))
        masked = logits.detach().clone()
        masked[list(target.accepted)] = -math.inf
        competitor = int(masked.argmax())
        margin = logits[target.ids[0]] - logits[competitor]
        grads = torch.autograd.grad(margin, [probe.zeros[layer] for layer in probe.layers], allow_unused=True)
    g = {layer: (grad if grad is not None else torch.zeros_like(probe.zeros[layer])).detach().float().cpu()
         for layer, grad in zip(probe.layers, grads)}
    return CleanPass(n=n, h={layer: probe.h[layer].cpu() for layer in probe.layers}, g=g,
                     logits=logits.detach().float().cpu(), competitor=competitor, margin=float(margin.detach()))


def lens_top_tokens(model: LensModel, lens: Lens, state: CleanPass, layers: Sequence[int],
                    exclude: frozenset[int]) -> dict[int, int]:
    """``{layer: id}``: the lens's top token at the readout at each layer, leaving out ``exclude`` (the target)."""
    out = {}
    with torch.no_grad():
        for layer in layers:
            h = state.h[layer][-1:].to(model.device)  # [1, d]
            logits = lens.logits(model, h, int(layer))[0].float().cpu()  # [vocab]
            logits[list(exclude)] = -math.inf
            out[int(layer)] = int(logits.argmax())
    return out


# -- candidates -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One edit to try: ``op`` at ``layers`` (a band), at the readout or every position from ``from_position``
    (``positions``), with ``strength`` (steer ``s``, swap ``α``, ablate: the number of competitors); ``predicted``
    is the first-order margin ``z_X - z_c`` after the edit (logits; > 0 predicts X)."""

    op: str
    layers: tuple[int, ...]
    positions: str
    strength: float
    predicted: float


@dataclass
class Ranking:
    """The first-order effect of every candidate structure: per ``(op, positions)`` a ``[n_layers]`` vector of
    per-layer slopes (steer, swap: margin per unit strength; ablate: ``[k, n_layers]``, cumulative over the ``k``
    best competitors), and what the candidates ranked."""

    layers: list[int]
    margin: float
    slopes: dict[tuple[str, str], torch.Tensor]
    sources: dict[int, int] = field(default_factory=dict)
    competitors: list[int] = field(default_factory=list)
    n_positions: dict[str, int] = field(default_factory=dict)  # positions each mode edits

    def predict(self, op: str, band: Sequence[int], positions: str, strength: float) -> float:
        """The first-order margin after ``op`` at ``band`` with ``strength``."""
        idx = [self.layers.index(int(layer)) for layer in band]
        slopes = self.slopes[(op, positions)]
        if op == "ablate":
            k = max(1, min(round(strength), slopes.shape[0]))
            return self.margin + float(slopes[k - 1, idx].sum())
        return self.margin + float(strength) * float(slopes[idx].sum())


def _per_layer(state: CleanPass, layer: int, directions: Directions, target_id: int, source: int | None,
               competitors: Sequence[int]) -> dict[str, torch.Tensor]:
    """The first-order margin change per position ``[n]`` of each op at one layer (ablate: ``[k, n]``)."""
    h, g = state.h[layer], state.g[layer]  # [n, d]
    wanted = [target_id] + ([source] if source is not None else []) + list(competitors)
    table = directions.many(layer, wanted)  # [1 (+1) + k, d]
    u = table[0]
    out = {"steer": h.norm(dim=-1) * (g @ u)}
    if source is not None:
        a = table[1]
        pair = swap_basis(a, u)  # the Swap's own basis
        if pair is None:  # Swap skips such a layer
            out["swap"] = torch.zeros(state.n)
        else:
            basis, pinv = pair  # [d, 2], [2, d]
            c = h @ pinv.T  # [n, 2]
            out["swap"] = (g * (swap_step(c) @ basis.T)).sum(-1)
    rows = []
    for w in table[len(wanted) - len(competitors):]:
        rows.append(-(h @ w) * (g @ w))
    out["ablate"] = torch.stack(rows).cumsum(0) if rows else torch.zeros(1, state.n)
    return out


def rank(state: CleanPass, directions: Directions, target: SayTarget, layers: Sequence[int], ops: Sequence[str],
         position_modes: Sequence[str], from_position: int, sources: dict[int, int], competitors: Sequence[int]
         ) -> Ranking:
    """Per-layer first-order slopes of every op (see the module docstring); the candidates come from
    :func:`candidates`."""
    layers = [int(x) for x in layers]
    per = [_per_layer(state, layer, directions, target.ids[0], sources.get(layer) if "swap" in ops else None,
                      competitors if "ablate" in ops else []) for layer in layers]
    slopes: dict[tuple[str, str], torch.Tensor] = {}
    for op in ops:
        if any(op not in p for p in per):
            continue
        stacked = torch.stack([p[op] for p in per], dim=-2)  # [L, n] or [k, L, n]
        for mode in position_modes:
            part = stacked[..., state.n - 1] if mode == "readout" else stacked[..., from_position:].sum(-1)
            slopes[(op, mode)] = part
    return Ranking(layers=layers, margin=state.margin, slopes=slopes, sources=dict(sources),
                   competitors=list(competitors), n_positions={"readout": 1, "from": max(1, state.n - from_position)})


def bands(layers: Sequence[int]) -> list[tuple[int, ...]]:
    """Contiguous runs of ``layers`` (sorted) to try: every single layer, runs of 2, 4, 8, ... layers starting
    every half run, and the whole list."""
    layers = list(layers)
    out: list[tuple[int, ...]] = []
    width = 1
    while width < len(layers):
        step = max(1, width // 2)
        out += [tuple(layers[i:i + width]) for i in range(0, len(layers) - width + 1, step)]
        width *= 2
    out.append(tuple(layers))
    return list(dict.fromkeys(out))


def candidates(ranking: Ranking, grids: Mapping[str, Sequence[float]]
               ) -> tuple[list[tuple[Candidate, tuple[Candidate, ...]]], int]:
    """``(queue, n_ranked)``: the candidates in the order to replay them, and how many were ranked.

    Every ``(op, band, positions, strength)`` is ranked by its first-order margin. Per structure
    ``(op, band, positions)`` the queue holds the smallest strength predicted to make X the top token (else the
    largest) and the stronger ones to escalate to, one after another, when it fails: every second grid step,
    then the largest. The structures predicted to work come first, the smallest edit first (its size: the
    strength as a fraction of the grid's largest, times the layers and positions it touches; a first-order
    prediction holds best for small edits, and an edit of one position is smaller than one of many), then the
    others, the best predicted first. The three edits take turns, so that each is tried within a small replay
    budget. Structures predicted to lower the margin at every strength come last (a first-order prediction can
    miss the sign: a budget as large as the queue replays every structure).
    """
    groups: dict[str, list[tuple[tuple[int, float], Candidate, tuple[Candidate, ...]]]] = {}
    n_ranked = 0
    for (op, mode) in ranking.slopes:
        grid = sorted(float(s) for s in grids[op])
        n_positions = ranking.n_positions.get(mode, 1)
        rows: list[tuple[tuple[int, float], Candidate, tuple[Candidate, ...]]] = []
        for band in bands(ranking.layers):
            preds = [ranking.predict(op, band, mode, s) for s in grid]
            n_ranked += len(grid)
            i = next((j for j, p in enumerate(preds) if p > 0), None)
            if i is None:  # predicted to fall short; last of all when predicted to lower the margin
                key: tuple[int, float] = (1 if max(preds) > ranking.margin else 2, -max(preds))
                i = len(grid) - 1
            else:
                key = (0, grid[i] / grid[-1] * len(band) * n_positions)
            steps = sorted(set(range(i + 2, len(grid), 2)) | ({len(grid) - 1} if i < len(grid) - 1 else set()))
            rows.append((key, Candidate(op, band, mode, grid[i], preds[i]),
                         tuple(Candidate(op, band, mode, grid[j], preds[j]) for j in steps)))
        groups.setdefault(op, []).extend(rows)
    for rows in groups.values():
        rows.sort(key=lambda r: r[0])
    order = sorted(groups, key=lambda group: groups[group][0][0])  # the group with the best candidate first
    queue: list[tuple[Candidate, tuple[Candidate, ...]]] = []
    for tier in (0, 1, 2):  # predicted to work, to fall short, to lower the margin: the groups take turns in each
        rows_of = {group: [r for r in groups[group] if r[0][0] == tier] for group in order}
        depth = 0
        while any(depth < len(rows) for rows in rows_of.values()):
            for group in order:
                if depth < len(rows_of[group]):
                    _, first, stronger = rows_of[group][depth]
                    queue.append((first, stronger))
            depth += 1
    return queue, n_ranked


__all__ = ["DEFAULT_GRIDS", "MAX_TARGET_TOKENS", "OPS", "POSITION_MODES", "Candidate", "CleanPass", "Directions",
           "LensDirections", "RandomDirections", "Ranking", "SayTarget", "bands", "candidates", "clean_pass",
           "lens_top_tokens", "rank", "spell_target"]
