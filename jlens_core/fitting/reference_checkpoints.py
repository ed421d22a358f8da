"""Continuing a reference fit: a checkpoint of the reference jlens library as a jlens checkpoint (docs/sharing.md).

The reference's checkpoint holds ``{"jacobian_sum": {layer: [d, d]}, "n_done", "next_idx", "source_layers",
"target_layer", "skip_first"}`` (:func:`jlens_core.lenses.foreign.read_reference_checkpoint`). Its sums are the
same sums a jlens fit keeps (docs/method.md §3), so :func:`checkpoint_from_reference` writes them as a jlens
checkpoint that :func:`~jlens_core.fitting.fit.fit` (``jlens fit --resume-from``) goes on from: the lens is the one
an uninterrupted fit of the same prompts gives. What the reference does not record stays unchecked or unknown: it
keeps no digest of its prompts (give the same corpus in the same order), no per-prompt diagnostics and no split
halves (the resumed lens has none, docs/method.md §3.3).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from ..lenses.fit_settings import FitSettings
from ..lenses.foreign import read_reference_checkpoint
from ..models.model import LensModel
from .fit import FitState, checkpoint_settings, write_checkpoint
from .resume import prompts_digest

log = logging.getLogger(__name__)


def checkpoint_from_reference(reference: str | os.PathLike, path: str | os.PathLike, model: LensModel,
                              prompts: Sequence, settings: FitSettings | None = None) -> int:
    """Write the reference checkpoint at ``reference`` as a jlens checkpoint at ``path``, for a fit of ``model`` on
    ``prompts`` with ``settings`` (default ``FitSettings()``; resolved for the model).

    Returns:
        The prompt index the fit goes on at (the reference's ``next_idx``).

    Raises:
        LensFileError: not a reference checkpoint (naming the keys found), or a pickle that needs code.
        ValueError: the checkpoint was made with other source layers, target layer, ``skip_first`` or
            ``max_seq_len`` (where it records one) than ``settings``, at another width than ``model``'s, or on
            more prompts than ``prompts`` holds (one sentence naming the value).
    """
    data = read_reference_checkpoint(reference)
    settings = (settings if settings is not None else FitSettings()).resolved(model.n_layers)
    sums: dict[int, torch.Tensor] = data["jacobian_sum"]
    wanted = {"source_layers": list(settings.source_layers or ()), "target_layer": settings.target_layer,
              "skip_first": settings.skip_first, "max_seq_len": settings.max_seq_len}
    recorded: dict[str, object] = {"source_layers": sorted(int(x) for x in data.get("source_layers", sums))}
    recorded.update({key: None if data.get(key) is None else int(data[key])
                     for key in ("target_layer", "skip_first", "max_seq_len")})
    for key, value in recorded.items():
        if value is not None and value != wanted[key]:
            raise ValueError(f"The reference checkpoint {str(reference)!r} was made with {key}={value}, this fit asks "
                             f"for {key}={wanted[key]}: give the same setting (--layers, --target-layer, --skip-first, "
                             "--max-seq-len) to continue it.")
    if sorted(sums) != wanted["source_layers"]:
        raise ValueError(f"The reference checkpoint {str(reference)!r} holds sums for layers {sorted(sums)}, not the "
                         f"source layers {wanted['source_layers']} it names.")
    bad = [layer for layer, s in sums.items() if tuple(s.shape) != (model.d_model, model.d_model)]
    if bad:
        raise ValueError(f"The reference checkpoint {str(reference)!r} has sums of shape {tuple(sums[bad[0]].shape)} "
                         f"at layer {bad[0]}; {model.name!r} has d_model={model.d_model}: it is another model's fit.")
    n_done, next_idx = int(data["n_done"]), int(data["next_idx"])
    if not 0 <= n_done <= next_idx <= len(prompts):
        raise ValueError(f"The reference checkpoint {str(reference)!r} went on at prompt {next_idx} ({n_done} counted); "
                         f"this fit has {len(prompts)} prompts: give the corpus it was made on, in the same order.")
    log.warning("The reference checkpoint %s records no digest of its prompts: the fit goes on at prompt %d of the "
                "prompts given, which must be the ones it was made on, in the same order.", reference, next_idx)
    state = FitState(sums, n_done=n_done, next_idx=next_idx, n_skipped=next_idx - n_done)
    write_checkpoint(path, state, checkpoint_settings(settings, model.name, model.fingerprint()),
                     prompts_digest(prompts, next_idx))
    return next_idx


__all__ = ["checkpoint_from_reference"]
