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


@runtime_checkable
class Lens(Protocol):
    """A lens: read layer ``l``'s residual ``h`` as ``unembed(transport(h, l))`` (:meth:`logits`).

    Attributes (read-only here; a plain attribute implements each):
        kind: ``"logit"``, ``"jacobian"`` or ``"tuned"`` (names the lens in readings and tables).
        d_model: residual width ``d``.
        n_layers: decoder layers of the model it belongs to.
        target_layer: the layer it carries residuals to (the model's output; the transport is the
            identity there).
        settings: how it was fitted or trained (``skip_first``, ``max_seq_len``, ...); ``{}`` for the
            logit lens. ``settings["skip_first"]``, when present, is the first position a reading
            counts as ``fitted``.
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
    def settings(self) -> dict[str, Any]: ...

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


__all__ = ["FittedLens", "Lens"]
