"""Make it say X, the real half: build a candidate's edits and replay the model with them (docs/method.md §7.1).

A replay runs the model's own forward over the prompt and, for a multi-token target, the target's tokens but
its last (teacher forcing), with the edits hooked by :class:`~jlens_core.reading.edit_hooks.EditRunner` on the
prompt positions. The edit is **verified** when the greedy choice at the readout spells the target (a
single-token target: any of its spellings) or, for a multi-token target, when the greedy choice at every step
of the teacher-forced run is the target's next token: exactly when greedy decoding writes the whole target.
Positions before the first edited one do not change (the model is causal), so their keys and values come from
a cache of the clean prefix, computed once per first position: a readout-only replay runs one token.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..models.recorder import ActivationRecorder
from ..reading.edit_hooks import EditRunner
from .lens_edits import Ablate, Steer, Swap
from .say_ranking import Candidate, Directions, SayTarget

LN2 = math.log(2.0)


@dataclass
class Outcome:
    """What one replay gave.

    Attributes:
        verified: the edited greedy decoding writes the target.
        next_id: the edited greedy token at the readout.
        target_prob: the teacher-forced probability of the target's full tokenisation under the edit.
        kl_bits: ``KL(edited || clean)`` of the next-token distribution averaged over the prompt positions other
            than the readout (bits; 0 for a readout-only edit: the model is causal); kl_max_bits: the largest.
    """

    verified: bool
    next_id: int
    target_prob: float
    kl_bits: float
    kl_max_bits: float


def edited_positions(candidate: Candidate, n: int, from_position: int) -> list[int]:
    """The absolute prompt positions a candidate edits: the readout, or every one from ``from_position``."""
    return [n - 1] if candidate.positions == "readout" else list(range(int(from_position), n))


def build_edits(model: LensModel, lens: Lens, candidate: Candidate, target: SayTarget, directions: Directions,
                sources: dict[int, int], competitors: Sequence[int], positions: Sequence[int]) -> list[Any]:
    """The :class:`~jlens_core.interventions.lens_edits.Steer`, ``Swap`` or ``Ablate`` edits of a candidate.

    Steer: one edit over the band. Swap: one per layer (each layer swaps out its own top lens token for the
    target). Ablate: one per competitor (the ``strength`` best). With random ``directions`` the lens only checks
    the layers; the vectors are the provider's.
    """
    band = list(candidate.layers)
    x = target.ids[0]

    def given(token: int) -> dict[int, torch.Tensor] | None:
        return {layer: directions(layer, token) for layer in band} if directions.random else None

    where = list(positions)
    if candidate.op == "steer":
        return [Steer(model, lens, x, candidate.strength, layers=band, positions=where, directions=given(x))]
    if candidate.op == "swap":
        out: list[Any] = []
        for layer in band:
            source = sources[layer]
            pair = {layer: (directions(layer, source), directions(layer, x))} if directions.random else None
            out.append(Swap(model, lens, source, x, candidate.strength, layers=[layer], positions=where,
                            directions=pair))
        return out
    if candidate.op == "ablate":
        k = max(1, round(candidate.strength))
        return [Ablate(model, lens, t, layers=band, positions=where, directions=given(t)) for t in competitors[:k]]
    raise ValueError(f"Unknown edit {candidate.op!r}: use steer, swap or ablate.")


class Replayer:
    """Replays of one prompt (and target) with edits; the clean run once.

    Args:
        model: the model. ids: the prompt ``[1, n]``. target: the :class:`SayTarget`.
        layers: every layer an edit may touch (their clean residuals are kept for swaps).
    """

    def __init__(self, model: LensModel, ids: torch.Tensor, target: SayTarget, layers: Sequence[int]) -> None:
        self.model = model
        self.n = int(ids.shape[1])
        tail = torch.tensor([list(target.ids[:-1])], dtype=torch.long, device=ids.device)
        self.full = torch.cat([ids, tail], dim=1)  # [1, T]: prompt, then the target but its last token
        self.target = target
        self.layers = sorted({int(x) for x in layers})
        with torch.no_grad(), ActivationRecorder(model.layers, self.layers) as rec:
            logits = model.hf_model(input_ids=self.full).logits[0].float()  # [T, vocab]
        self.clean_residuals = {layer: rec.activations[layer].detach() for layer in self.layers}
        self.clean_logp = logits.log_softmax(-1)  # [T, vocab]
        self._prefixes: dict[int, Any] = {}
        self.n_forwards = 1
        params = inspect.signature(model.hf_model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def clean(self) -> Outcome:
        """The clean run's outcome (does the model already say it?)."""
        return self._outcome(self.clean_logp, 0)

    def _prefix(self, start: int) -> Any:
        """The key/value cache of the clean tokens before ``start`` (the model's own cached forward)."""
        if start not in self._prefixes:
            with torch.no_grad():
                out = self.model.hf_model(input_ids=self.full[:, :start], use_cache=True)
            self._prefixes[start] = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            self.n_forwards += 1
        return self._prefixes[start]

    def run(self, edits: Sequence[Any], start: int) -> Outcome:
        """Replay with ``edits`` (none before prompt position ``start``) and score it."""
        start = max(0, min(int(start), self.n - 1))
        runner = EditRunner(self.model, edits, self.n)
        hf = self.model.hf_model
        prefix = self._prefix(start) if start >= 2 else None
        if prefix is None:
            start = 0
        cache = copy.deepcopy(prefix)  # the forward appends to it
        positions = torch.arange(start, int(self.full.shape[1]))
        clean = {layer: r[:, start:] for layer, r in self.clean_residuals.items()} if runner.needs_clean else None

        def forward() -> torch.Tensor:
            if cache is None:
                return hf(input_ids=self.full).logits[0]
            kwargs = {self._cache_kwarg: cache, "use_cache": True}
            return hf(input_ids=self.full[:, start:], **kwargs).logits[0]

        with torch.no_grad():
            logits = runner.run(forward, positions, clean=clean).float()  # [T - start, vocab]
        self.n_forwards += 1
        return self._outcome(logits.log_softmax(-1), start)

    def _outcome(self, logp: torch.Tensor, start: int) -> Outcome:
        """Score edited log-probabilities ``[T - start, vocab]`` of positions ``start..T-1``."""
        r = self.n - 1 - start  # the readout's row
        ids = self.target.ids
        steps = logp[r:r + len(ids)]  # [m, vocab]
        greedy = steps.argmax(-1).tolist()
        verified = greedy[0] in self.target.accepted if self.target.single else greedy == list(ids)
        target_prob = math.exp(float(sum(steps[i, t] for i, t in enumerate(ids))))
        if r > 0:  # the prompt positions before the readout that this run computed
            edited, clean = logp[:r], self.clean_logp[start:self.n - 1]
            kl = (edited.exp() * (edited - clean)).sum(-1).clamp_min(0) / LN2  # [r] bits
            kl_mean = float(kl.sum()) / max(1, self.n - 1)  # the positions before start did not change: 0
            kl_max = float(kl.max())
        else:
            kl_mean = kl_max = 0.0
        return Outcome(verified=bool(verified), next_id=int(greedy[0]), target_prob=target_prob, kl_bits=kl_mean,
                       kl_max_bits=kl_max)


__all__ = ["Outcome", "Replayer", "build_edits", "edited_positions"]
