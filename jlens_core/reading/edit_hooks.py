"""Residual edits while the model runs: the protocol that generation and readings apply.

An edit changes the output of chosen decoder layers (the residual stream, docs/method.md §1) at chosen token
positions, during a forward pass. :func:`~jlens_core.reading.generation.generate` and
:func:`~jlens_core.reading.reader.read_prompt` take ``edits=[...]``; the concrete edits (steer,
ablate, swap along a lens's read directions, docs/method.md §7) live in :mod:`jlens_core.interventions`.

The protocol (:class:`ResidualEdit`) is small:

* ``layers``: the decoder layers whose output it edits;
* ``selects(positions, n_prompt)``: which of the absolute token positions of this forward pass it
  edits (a bool mask); :class:`PositionRule` gives the usual rule: every prompt position but the
  first (an attention sink), or a given set, and generated tokens only when asked;
* ``needs_clean``: whether it needs the *clean* residual (an unedited forward over the same tokens)
  at the positions it edits, e.g. a swap whose targets come from the clean run;
* ``apply(layer, h, clean)``: the edited residuals ``[n, d_model]`` of the selected positions.

:class:`EditRunner` installs the forward hooks for a list of edits, knows the absolute positions
of each forward pass (a key/value-cached generation runs one new token at a time) and, where an
edit needs it, runs the clean forward first. With no edits nothing is hooked: the run is the model's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float, Int

from ..models.model import LensModel
from ..models.recorder import ActivationRecorder, block_output, register_own_thread_hook


@runtime_checkable
class ResidualEdit(Protocol):
    """What an edit of decoder-layer outputs provides (see the module docstring)."""

    layers: Sequence[int]
    needs_clean: bool

    def selects(self, positions: Int[torch.Tensor, " seq"], n_prompt: int) -> Bool[torch.Tensor, " seq"]:
        """``BoolTensor[n]``: which of the absolute ``positions [n]`` this edit changes."""
        ...

    def apply(self, layer: int, h: Float[torch.Tensor, "rows d_model"],
              clean: Float[torch.Tensor, "rows d_model"] | None) -> Float[torch.Tensor, "rows d_model"]:
        """Edited residuals ``[n, d_model]`` from ``h [n, d_model]`` (and the clean ones, when needed)."""
        ...


@dataclass(frozen=True)
class PositionRule:
    """Which token positions an edit acts on.

    Attributes:
        positions: absolute positions to edit, or ``None`` for every prompt position but the first
            (position 0 is an attention sink with atypical statistics).
        on_generated: also edit generated tokens (positions ``>= n_prompt``).
    """

    positions: tuple[int, ...] | None = None
    on_generated: bool = False

    def selects(self, positions: Int[torch.Tensor, " seq"], n_prompt: int) -> Bool[torch.Tensor, " seq"]:
        in_prompt = positions < n_prompt
        if self.positions is None:
            chosen = in_prompt & (positions > 0)
        else:
            wanted = torch.tensor(sorted(self.positions), dtype=positions.dtype, device=positions.device)
            chosen = in_prompt & torch.isin(positions, wanted)
        if self.on_generated:
            chosen = chosen | ~in_prompt
        return chosen


def check_edits(model: LensModel, edits: Iterable[Any] | None) -> list[Any]:
    """The edits as a list, each checked against the protocol and the model's layer count.

    Raises:
        TypeError: an object that is not a :class:`ResidualEdit`.
        ValueError: an edit of a layer the model does not have, or edits on a model whose layers
            pass several streams (edits there are not defined yet).
    """
    out = list(edits or [])
    streams = model.stream_readout
    if out and streams is not None:
        raise ValueError(f"Residual edits are not supported on {model.name!r}: its layers "
                         f"pass {streams.description or 'several streams'}, and an edit of its residual (the "
                         "collapse of those streams) has no single place to go yet.")
    for edit in out:
        if not isinstance(edit, ResidualEdit):
            raise TypeError(f"{edit!r} is not a residual edit: it needs layers, needs_clean, selects() and apply().")
        for layer in edit.layers:
            if not 0 <= int(layer) < model.n_layers:
                raise ValueError(f"{type(edit).__name__} edits layer {layer}, but the model has layers "
                                 f"0..{model.n_layers - 1}.")
    return out


class EditRunner:
    """Runs forward passes of ``model`` with ``edits`` applied to decoder-layer outputs.

    Args:
        model: an :class:`~jlens_core.HFLensModel` (``layers``, ``n_layers``).
        edits: :class:`ResidualEdit` objects (empty: hooks are never installed).
        n_prompt: prompt length in tokens; positions from here on are generated tokens.

    Use :meth:`run` for each forward pass; it sets the absolute positions the hooks see and, when an
    edit needs the clean residuals, first runs ``clean_forward`` and records them.
    """

    def __init__(self, model: LensModel, edits: Iterable[Any] | None, n_prompt: int) -> None:
        self.model = model
        self.edits = check_edits(model, edits)
        self.n_prompt = int(n_prompt)
        self.layers = sorted({int(layer) for edit in self.edits for layer in edit.layers})
        self.needs_clean = any(edit.needs_clean for edit in self.edits)
        self._positions: torch.Tensor | None = None
        self._clean: dict[int, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.edits)

    def _hook(self, layer: int):
        def hook(module, args, output):
            h = block_output(output)  # [batch, seq, d_model]
            positions = self._positions
            if positions is None or h.shape[-2] != positions.shape[0]:
                raise RuntimeError(f"Edit hook at layer {layer}: the forward pass has {h.shape[-2]} positions, "
                                   f"the runner expected {None if positions is None else positions.shape[0]}.")
            new = h.clone()
            for edit in self.edits:
                if layer not in edit.layers:
                    continue
                mask = edit.selects(positions.to(h.device), self.n_prompt)  # [seq] bool
                if not bool(mask.any()):
                    continue
                clean = self._clean[layer][..., mask, :] if edit.needs_clean else None  # [batch, n, d]
                for b in range(new.shape[0]):
                    rows = new[b, mask]  # [n, d_model]
                    new[b, mask] = edit.apply(layer, rows, None if clean is None else clean[b]).to(new.dtype)
            if isinstance(output, tuple):
                return (new,) + tuple(output[1:])
            if isinstance(output, list):
                return [new] + list(output[1:])
            return new

        return hook

    def clean_residuals(self, clean_forward) -> dict[int, torch.Tensor]:
        """``{layer: [batch, seq, d_model]}``: the edited layers' outputs in an unedited ``clean_forward()``."""
        with torch.no_grad(), ActivationRecorder(self.model.layers, self.layers) as rec:
            clean_forward()
        return {layer: rec.activations[layer].detach() for layer in self.layers}

    def run(self, forward, positions: torch.Tensor, clean_forward=None,
            clean: dict[int, torch.Tensor] | None = None):
        """``forward()`` with the edits hooked, at the absolute ``positions [seq]`` of this pass.

        Args:
            forward: a zero-argument callable running the model on this pass's tokens.
            positions: ``LongTensor[seq]``, the absolute positions of the tokens ``forward`` runs.
            clean_forward: a zero-argument callable running the same tokens without edits (its own
                cache); required when an edit needs the clean residuals and ``clean`` is not given.
            clean: the clean residuals already recorded (:meth:`clean_residuals`), to reuse them.

        Returns:
            What ``forward()`` returns.
        """
        if not self.edits:
            return forward()
        if self.needs_clean:
            if clean is None and clean_forward is None:
                raise ValueError("An edit needs the clean residuals, but no clean forward was given.")
            self._clean = clean if clean is not None else self.clean_residuals(clean_forward)
        self._positions = positions
        handles = [register_own_thread_hook(self.model.layers[layer], self._hook(layer)) for layer in self.layers]
        try:
            return forward()
        finally:
            for handle in handles:
                handle.remove()
            self._positions = None
            self._clean = {}


__all__ = ["EditRunner", "PositionRule", "ResidualEdit", "check_edits"]
