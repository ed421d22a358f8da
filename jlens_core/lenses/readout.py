"""The readout: a lens's logits for a residual, ``unembed(transport(h, l))`` (docs/method.md §4).

Every reading, evaluation, intervention and training loop goes through here, so a change of readout (a
vocabulary filter, a faster dtype, a dictionary) is made once: :meth:`ReadoutMixin.logits` (the
:class:`~jlens_core.Lens` method every lens class inherits), :func:`layer_logits` (several layers at one
position, one unembedding) and :func:`transported_logits` (states a caller has already transported, such as a
reading's rows of several lenses or a tuned lens's translator while it trains).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float

if TYPE_CHECKING:
    from ..models.model import LensModel
    from .protocol import Lens


def transported_logits(model: LensModel, carried: Float[torch.Tensor, "*batch d_model"], *,
                       out: torch.Tensor | None = None) -> Float[torch.Tensor, "*batch vocab"]:
    """``model.unembed(carried)`` for states already carried to the output layer: ``[..., d_model] ->
    [..., vocab]`` in the model's dtype; ``out`` (a ``[n, vocab]`` buffer of a 2-D ``carried``) is reused when
    given (the model's ``unembed`` must take ``out=`` then)."""
    return model.unembed(carried) if out is None else model.unembed(carried, out=out)


def lens_logits(lens: Lens, model: LensModel, h: Float[torch.Tensor, "*batch d_model"],
                layer: int) -> Float[torch.Tensor, "*batch vocab"]:
    """``unembed(lens.transport(h, layer))``: ``[..., d_model] -> [..., vocab]`` in the model's dtype.

    Raises:
        KeyError: ``layer`` is not one of ``lens.layers``.
    """
    return transported_logits(model, lens.transport(h, layer))


def layer_logits(lens: Lens, model: LensModel, resid: Mapping[int, torch.Tensor], layers: Sequence[int],
                 index: Any) -> Float[torch.Tensor, "n_layers *batch vocab"]:
    """The readout at several layers of one forward: ``resid[layer][index]`` transported at each of ``layers``,
    stacked and unembedded by one matmul (``[n_layers, *batch, vocab]``, the model's dtype).

    Args:
        resid: ``{layer: Tensor[seq, d_model]}`` the recorded residuals.
        index: the positions read (an int, a list or a slice of the sequence axis).
    """
    return transported_logits(model, torch.stack([lens.transport(resid[layer][index], layer) for layer in layers]))


class ReadoutMixin:
    """:meth:`logits` for a lens class: one readout for every kind (this module's :func:`lens_logits`)."""

    def logits(self, model: LensModel, h: Float[torch.Tensor, "*batch d_model"],
               layer: int) -> Float[torch.Tensor, "*batch vocab"]:
        """The lens's logits of residuals ``h [..., d_model]`` of ``layer``: ``unembed(transport(h, layer))``
        with the model's output row (final norm and unembedding), ``[..., vocab]`` in the model's dtype.

        Raises:
            KeyError: ``layer`` is not one of :attr:`layers`.
        """
        return lens_logits(self, model, h, layer)  # type: ignore[arg-type]


__all__ = ["ReadoutMixin", "layer_logits", "lens_logits", "transported_logits"]
