"""Make it say X, the real half: build a candidate's edits and replay the model with them (docs/method.md §7.1).

A replay runs the model's own forward over the prompt and, for a multi-token target, the target's tokens but
its last (teacher forcing), with the edits hooked by :class:`~jlens_core.reading.edit_hooks.EditRunner` on the
prompt positions. The edit is **verified** when the greedy choice at the readout spells the target (a
single-token target: any of its spellings) or, for a multi-token target, when the greedy choice at every step
of the teacher-forced run is the target's next token: exactly when greedy decoding writes the whole target.
Positions before the first edited one do not change (the model is causal), so their keys and values come from
a cache of the clean prefix, computed once per first position: a readout-only replay runs one token.

Side effects (docs/method.md §7.2, :mod:`~jlens_core.interventions.side_effects`): every replay gives the readout
divergence over the tokens other than the target's; :meth:`Replayer.downstream` replays the clean continuation
teacher-forced with the edit (one more forward, the same prefix cache); an edit that starts before the readout
also gets the divergence at the prompt positions it touches.
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
from .side_effects import divergence_stats, kl_bits, readout_divergence


@dataclass
class Outcome:
    """What one replay gave.

    Attributes:
        verified: the edited greedy decoding writes the target.
        next_id: the edited greedy token at the readout.
        target_prob: the teacher-forced probability of the target's full tokenisation under the edit.
        readout_kl_bits: ``KL(edited || clean)`` at the readout over the tokens other than the target's spellings,
            both renormalised without them (bits).
        prompt_kl_bits, prompt_kl_max_bits: the mean and the largest ``KL(edited || clean)`` over the prompt
            positions the edit touches before the readout, from its first edited one (bits; NaN for a
            readout-only edit, which touches none: the model is causal).
    """

    verified: bool
    next_id: int
    target_prob: float
    readout_kl_bits: float
    prompt_kl_bits: float
    prompt_kl_max_bits: float


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
    """Replays of one prompt (and target) with edits; the clean runs once.

    Args:
        model: the model. ids: the prompt ``[1, n]``. target: the :class:`SayTarget`.
        layers: every layer an edit may touch (their clean residuals are kept for swaps).
        continuation: the clean greedy continuation (token ids) that :meth:`downstream` teacher-forces.
    """

    def __init__(self, model: LensModel, ids: torch.Tensor, target: SayTarget, layers: Sequence[int],
                 continuation: Sequence[int] = ()) -> None:
        self.model = model
        self.n = int(ids.shape[1])
        self.target = target
        self.exclude = set(target.accepted) | {int(target.ids[0])}  # left out of the readout divergence
        self.layers = sorted({int(x) for x in layers})
        tail = torch.tensor([list(target.ids[:-1])], dtype=torch.long, device=ids.device)
        self.full = torch.cat([ids, tail], dim=1)  # [1, T]: prompt, then the target but its last token
        self.clean_logp, self.clean_residuals = self._clean_run(self.full)
        self.continued = torch.cat([ids, torch.tensor([list(continuation)], dtype=torch.long, device=ids.device)],
                                   dim=1)  # [1, n + N]: prompt, then the clean continuation
        self.n_continuation = len(continuation)
        self.continued_logp: torch.Tensor | None = None
        self.continued_residuals: dict[int, torch.Tensor] = {}
        if continuation:
            self.continued_logp, self.continued_residuals = self._clean_run(self.continued)
        self._prefixes: dict[int, Any] = {}
        self.n_forwards = 2 if continuation else 1
        params = inspect.signature(model.hf_model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _clean_run(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The clean log-probabilities ``[T, vocab]`` of ``ids [1, T]`` and the kept layers' residuals."""
        with torch.no_grad(), ActivationRecorder(self.model.layers, self.layers) as rec:
            logits = self.model.hf_model(input_ids=ids).logits[0].float()  # [T, vocab]
        return logits.log_softmax(-1), {layer: rec.activations[layer].detach() for layer in self.layers}

    def clean(self) -> Outcome:
        """The clean run's outcome (does the model already say it?)."""
        return self._outcome(self.clean_logp, 0, 0)

    def _prefix(self, start: int) -> Any:
        """The key/value cache of the clean tokens before ``start`` (the model's own cached forward)."""
        if start not in self._prefixes:
            with torch.no_grad():
                out = self.model.hf_model(input_ids=self.full[:, :start], use_cache=True)
            self._prefixes[start] = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            self.n_forwards += 1
        return self._prefixes[start]

    def _replay(self, ids: torch.Tensor, residuals: dict[int, torch.Tensor], edits: Sequence[Any],
                start: int) -> tuple[torch.Tensor, int]:
        """Edited log-probabilities ``[T - start', vocab]`` of ``ids [1, T]`` (the prompt, then anything) from
        position ``start'`` on, and ``start'``: ``start``, or 0 when there is no prefix cache to reuse."""
        start = max(0, min(int(start), self.n - 1))
        runner = EditRunner(self.model, edits, self.n)
        hf = self.model.hf_model
        prefix = self._prefix(start) if start >= 2 else None
        if prefix is None:
            start = 0
        cache = copy.deepcopy(prefix)  # the forward appends to it
        positions = torch.arange(start, int(ids.shape[1]))
        clean = {layer: r[:, start:] for layer, r in residuals.items()} if runner.needs_clean else None

        def forward() -> torch.Tensor:
            if cache is None:
                return hf(input_ids=ids).logits[0]
            kwargs = {self._cache_kwarg: cache, "use_cache": True}
            return hf(input_ids=ids[:, start:], **kwargs).logits[0]

        with torch.no_grad():
            logits = runner.run(forward, positions, clean=clean).float()  # [T - start, vocab]
        self.n_forwards += 1
        return logits.log_softmax(-1), start

    def run(self, edits: Sequence[Any], start: int) -> Outcome:
        """Replay with ``edits`` (none before prompt position ``start``) and score it."""
        logp, computed = self._replay(self.full, self.clean_residuals, edits, start)
        return self._outcome(logp, computed, max(0, min(int(start), self.n - 1)))

    def downstream(self, edits: Sequence[Any], start: int) -> tuple[float, float]:
        """``(mean, max)`` ``KL(edited || clean)`` in bits over the clean continuation's positions, teacher-forced
        with ``edits`` (none before prompt position ``start``); ``(nan, nan)`` without a continuation."""
        if not self.n_continuation or self.continued_logp is None:
            return math.nan, math.nan
        logp, computed = self._replay(self.continued, self.continued_residuals, edits, start)
        return divergence_stats(logp[self.n - computed:], self.continued_logp[self.n:])

    def _outcome(self, logp: torch.Tensor, start: int, first: int) -> Outcome:
        """Score edited log-probabilities ``[T - start, vocab]`` of positions ``start..T-1`` of an edit whose first
        edited position is ``first``."""
        r = self.n - 1 - start  # the readout's row
        ids = self.target.ids
        steps = logp[r:r + len(ids)]  # [m, vocab]
        greedy = steps.argmax(-1).tolist()
        verified = greedy[0] in self.target.accepted if self.target.single else greedy == list(ids)
        target_prob = math.exp(float(sum(steps[i, t] for i, t in enumerate(ids))))
        readout = readout_divergence(logp[r], self.clean_logp[self.n - 1], self.exclude)
        touched = max(first, start)
        if touched < self.n - 1:  # the prompt positions from the first edited one to before the readout
            kl = kl_bits(logp[touched - start:r], self.clean_logp[touched:self.n - 1])  # [n - 1 - touched] bits
            prompt_mean, prompt_max = float(kl.mean()), float(kl.max())
        else:
            prompt_mean = prompt_max = math.nan
        return Outcome(verified=bool(verified), next_id=int(greedy[0]), target_prob=target_prob,
                       readout_kl_bits=readout, prompt_kl_bits=prompt_mean, prompt_kl_max_bits=prompt_max)


__all__ = ["Outcome", "Replayer", "build_edits", "edited_positions"]
