"""What a reading reads: its lenses, layers, positions, prompt ids and residuals (docs/method.md §6).

Shared by :func:`~jlens_core.reading.reader.read_prompts`, :mod:`~jlens_core.evaluation.by_layer` and
:mod:`~jlens_core.evaluation.passk`: each checks its lenses, picks the readable layers, encodes the
prompt and records the residuals the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..layerspec import normalise_layers, wrap_index
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..models.recorder import ActivationRecorder
from .edit_hooks import EditRunner

log = logging.getLogger(__name__)


def check_lens(model: LensModel, lens: Lens) -> None:
    """Raise :class:`LensFileError` if ``lens`` does not belong to ``model`` (``lens.check_model``).

    A :class:`JacobianLens` or :class:`TunedLens` checks its width, target layer and unembedding
    fingerprint; a :class:`LogitLens` must have the model's width and layer count.
    """
    lens.check_model(model)


def as_lens_dict(lenses: Mapping[str, Lens] | Lens) -> dict[str, Lens]:
    """``{name: lens}`` from a dict or a single lens (named by its kind); a clear error when empty."""
    if isinstance(lenses, Mapping):
        out = {str(name): lens for name, lens in lenses.items()}
    elif hasattr(lenses, "transport"):  # a run-time guard: callers pass whatever they hold
        out = {str(lenses.kind): lenses}
    else:
        raise ValueError("lenses must be a dict {name: lens}, e.g. {'jacobian': lens, 'logit': "
                         "LogitLens.for_model(model)}.")
    if not out:
        raise ValueError("lenses is empty: give at least one lens, e.g. {'logit': LogitLens.for_model(model)}.")
    return out


def checked_lenses(model: LensModel, lenses: Mapping[str, Lens] | Lens,
                   layers: Iterable[int] | None = None) -> tuple[dict[str, Lens], dict[str, list[int]]]:
    """``({name: lens}, {name: the layers it reads})``: :func:`as_lens_dict`, each lens checked against
    ``model`` (:func:`check_lens`), and its :func:`readable_layers` of ``layers``.

    Raises:
        ValueError: no lens, or bad layers. LensFileError: a lens belongs to another model.
    """
    lens_map = as_lens_dict(lenses)
    for lens in lens_map.values():
        check_lens(model, lens)
    if layers is not None:
        layers = list(layers)
    return lens_map, {name: readable_layers(model, lens, layers) for name, lens in lens_map.items()}


def readable_layers(model: LensModel, lens: Lens, layers: Iterable[int] | None = None) -> list[int]:
    """The layers to read: ``lens.layers`` (all of them, or those of ``layers`` the lens has), sorted.

    Negative indices in ``layers`` count from the end. Layers the lens was not fitted at are left
    out (logged), never read as a logit lens.

    Raises:
        ValueError: an index outside ``[-n_layers, n_layers)``, an empty ``layers``, or no readable
            layer remains.
    """
    n = model.n_layers
    available = [layer for layer in lens.layers if 0 <= layer < n]
    if layers is None:
        chosen = available
    else:
        wanted = normalise_layers(layers, n, name="layer")
        chosen = [layer for layer in available if layer in wanted]
        missing = sorted(set(wanted) - set(chosen))
        if missing:
            log.info("the %s lens has no layers %s; they are left out", lens.kind, missing)
    if not chosen:
        raise ValueError(f"None of the requested layers {sorted(set(layers or []))} is readable with this "
                         f"lens, which reads layers {available}.")
    return sorted(chosen)


def record_residuals(model: LensModel, input_ids: torch.Tensor, layers: Iterable[int], *,
                     edits: Iterable[Any] | None = None, n_prompt: int | None = None) -> dict[int, torch.Tensor]:
    """One forward pass (no gradients) recording decoder-layer outputs.

    Records ``layers`` and the last layer (the model's output is ``unembed`` of it); the pass
    stops right after the last layer. With ``edits`` (:mod:`jlens_core.reading.edit_hooks`) the
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


def encode_prompt(model: LensModel, text: str | Sequence[int] | np.ndarray | torch.Tensor,
                  max_seq_len: int | None) -> torch.Tensor:
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
    return ids.to(model.device)


def model_vocab_size(model: LensModel) -> int:
    """``model.vocab_size`` as an int (the logits a reading keeps)."""
    return int(model.vocab_size)


__all__ = ["as_lens_dict", "check_lens", "encode_prompt", "model_vocab_size", "readable_layers", "record_residuals",
           "resolve_positions"]
