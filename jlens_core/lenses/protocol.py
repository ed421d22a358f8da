"""The lens interface every reading, edit and app view is typed against (docs/method.md §4).

:class:`Lens` is what :func:`~jlens_core.read_prompt`, :func:`~jlens_core.evaluate`,
:func:`~jlens_core.pass_at_k`, the interventions and the app need of a lens: its kind, the layers it
reads, its transport ``M_l`` (``h -> M_l h``, linear or affine) and the linear part of it as a matrix.
:class:`~jlens_core.LogitLens` (``M_l = I``), :class:`~jlens_core.JacobianLens` (``M_l = J_l``) and
:class:`~jlens_core.TunedLens` (``h -> h + A_l h + b_l``) implement it; :class:`FittedLens` adds what a
lens learned from a model has (its model's identity and a file).

Structural (``typing.Protocol``), as :class:`~jlens_core.LensModel` is for models: a lens need not
inherit from anything, and ``isinstance(x, Lens)`` checks the members are there (not their types).
This module imports neither torch nor the lens classes at run time, so ``jlens_core.Lens`` stays light.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from jaxtyping import Float

    from ..models.model import LensModel
    from .fit_settings import FitRecord, FitSettings


@runtime_checkable
class Lens(Protocol):
    """A lens: read layer ``l``'s residual ``h`` as ``unembed(transport(h, l))`` (:meth:`logits`).

    Attributes (read-only here; a plain attribute implements each):
        kind: ``"logit"``, ``"jacobian"`` or ``"tuned"`` (names the lens in readings and tables).
        d_model: residual width ``d``.
        n_layers: decoder layers of the model it belongs to.
        target_layer: the layer it carries residuals to (the model's output; the transport is the
            identity there).
        skip_first: the first position a reading counts as ``fitted`` (the leading positions its fit or
            training left out); ``None`` when it records none (the logit lens, a lens built by hand).

    A lens fitted by ``jlens fit`` (:class:`~jlens_core.JacobianLens`, the expert lens) also carries its types:
    ``fit_settings`` (:class:`~jlens_core.lenses.fit_settings.FitSettings`, what shaped it) and ``record``
    (:class:`~jlens_core.lenses.fit_settings.FitRecord`, what its fit recorded): :class:`FitRecordLens`.
    """

    @property
    def kind(self) -> str: ...

    @property
    def d_model(self) -> int: ...

    @property
    def n_layers(self) -> int: ...

    @property
    def target_layer(self) -> int: ...

    @property
    def skip_first(self) -> int | None: ...

    @property
    def layers(self) -> list[int]:
        """Readable layers, ascending: the source layers and the target."""
        ...

    @property
    def source_layers(self) -> list[int]:
        """The layers below the target the lens reads (where its transport is not the identity)."""
        ...

    def transport(self, h: Float[torch.Tensor, "*batch d_model"],
                  layer: int) -> Float[torch.Tensor, "*batch d_model"]:
        """``M_layer h`` over the last axis: ``[..., d_model] -> [..., d_model]``, in ``h``'s dtype and device.

        Raises:
            KeyError: ``layer`` is not one of :attr:`layers`.
        """
        ...

    def matrix(self, layer: int) -> Float[torch.Tensor, "d_model d_model"]:
        """The linear part of the transport at ``layer``: fp32 ``[d_model, d_model]`` (CPU).

        Raises:
            KeyError: ``layer`` is not one of :attr:`layers`.
        """
        ...

    def logits(self, model: LensModel, h: Float[torch.Tensor, "*batch d_model"],
               layer: int) -> Float[torch.Tensor, "*batch vocab"]:
        """The readout: ``model.unembed(self.transport(h, layer))``, ``[..., d_model] -> [..., vocab]`` in the
        model's dtype (its output row: final norm and unembedding). Every caller reads through it; the lens
        classes inherit it from :class:`~jlens_core.lenses.readout.ReadoutMixin` (one implementation for every
        kind).

        Raises:
            KeyError: ``layer`` is not one of :attr:`layers`.
        """
        ...

    def check_model(self, model: LensModel) -> None:
        """Raise :class:`~jlens_core.LensFileError` if the lens does not belong to ``model``."""
        ...


@runtime_checkable
class FittedLens(Lens, Protocol):
    """A lens learned from a model (Jacobian, tuned): the model's identity, its metadata and a file."""

    @property
    def model_name(self) -> str | None: ...

    @property
    def model_fingerprint(self) -> dict | None: ...

    def metadata(self) -> dict[str, Any]:
        """The JSON metadata its file's header holds."""
        ...

    def save(self, path: str | os.PathLike, *, dtype: str | torch.dtype = "float32") -> Path:
        """Write the lens as safetensors, atomically; returns the path written."""
        ...


def recorded_skip_first(lens: object) -> int | None:
    """``lens.skip_first``: the first position its fit or training counted (``None``: it records none). A lens
    written to this protocol before it had ``skip_first`` (a ``settings`` dict only) gives its dict's entry."""
    if hasattr(lens, "skip_first"):
        value = lens.skip_first
    else:  # the protocol before 0.2: a plain settings dict
        value = (getattr(lens, "settings", None) or {}).get("skip_first")
    return None if value is None else int(value)


@runtime_checkable
class FitRecordLens(FittedLens, Protocol):
    """A lens fitted by ``jlens fit`` (Jacobian or expert lens): its settings and its fit's record, as types."""

    @property
    def fit_settings(self) -> FitSettings: ...

    @property
    def record(self) -> FitRecord: ...


__all__ = ["FitRecordLens", "FittedLens", "Lens", "recorded_skip_first"]
