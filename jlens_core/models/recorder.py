"""Record decoder-layer outputs (the residual stream) with forward hooks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


class StopForward(Exception):
    """Raised from a hook to end a forward pass early, once the last needed layer has run."""


def block_output(output) -> torch.Tensor:
    """The residual tensor of a decoder layer's output (tensor, or first element of a tuple)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _replace_output(output, new: torch.Tensor):
    if isinstance(output, tuple):
        return (new,) + tuple(output[1:])
    if isinstance(output, list):
        return [new] + list(output[1:])
    return new


class ActivationRecorder:
    """Context manager recording the output residual of the listed decoder layers.

    Args:
        blocks: the decoder-layer modules, in order (``model.layers``).
        at: indices (into ``blocks``) whose outputs to record.
        start_graph_at: if given, that block's output is detached and made a leaf that requires
            grad, so a backward pass never runs below it. It must be in ``at``.
        stop_after: if given, the forward pass is ended (by :class:`StopForward`, which the
            context manager swallows) right after this block has run: nothing above it is computed.

    Attributes:
        activations: ``{index: Tensor[batch, seq, d_model]}`` after the forward pass.

    Hooks are removed on exit, on error as well.
    """

    def __init__(self, blocks: Sequence[nn.Module], at: Iterable[int], *, start_graph_at: int | None = None,
                 stop_after: int | None = None) -> None:
        self.blocks = list(blocks)
        self.at = sorted({int(i) for i in at})
        for i in self.at + [x for x in (start_graph_at, stop_after) if x is not None]:
            if not 0 <= i < len(self.blocks):
                raise ValueError(f"Layer index {i} is out of range for a model with {len(self.blocks)} layers.")
        if start_graph_at is not None and start_graph_at not in self.at:
            raise ValueError(f"start_graph_at={start_graph_at} must be one of the recorded layers {self.at}.")
        self.start_graph_at = start_graph_at
        self.stop_after = stop_after
        self.activations: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, index: int):
        def hook(module, args, output):
            h = block_output(output)
            replaced = None
            if index == self.start_graph_at:
                h = h.detach().requires_grad_(True)
                replaced = _replace_output(output, h)
            if index in self.at:
                self.activations[index] = h
            if index == self.stop_after:
                raise StopForward
            return replaced

        return hook

    def __enter__(self) -> ActivationRecorder:  # noqa: PYI034
        self.activations = {}
        wanted = set(self.at) | {x for x in (self.start_graph_at, self.stop_after) if x is not None}
        for i in sorted(wanted):
            self._handles.append(self.blocks[i].register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return exc_type is StopForward
