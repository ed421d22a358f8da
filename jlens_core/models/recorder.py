"""Record decoder-layer outputs (the residual stream) with forward hooks.

Multi-stream models (Gemma3n's AltUp, DeepSeek-V4 / HY-V4 / Qwen4-exp hyper-connections) pass
several copies of the residual between layers (a layer output of ``[streams, batch, seq, d]``,
``[batch, seq, streams, d]`` or ``[batch, seq, streams * d]``). For them, **the residual of a layer is the model's own final
collapse of the streams applied to that layer's output** (the function the model applies after its
last layer, before the final norm), registered per block with :func:`set_stream_readout`; so
``unembed(residual of the last layer)`` is the model's logits and every lens reads the same
quantity. A change ``delta`` of that residual is defined as ``delta`` added to every stream alike:
the Jacobian with respect to the residual is the sum over streams of the Jacobians with respect to
each stream. Blocks whose output is laid out otherwise use the same hook with their own ``lift``
(XLNet's time-major ``[seq, batch, d]``; ProphetNet, whose residual is the n-gram stream its
causal-LM logits read; CPM-Ant, whose residual is the positions after its learned prompt).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StreamReadout:
    """How a multi-stream block output becomes the residual.

    Attributes:
        collapse: the model's own stream collapse, stream tensor -> ``[batch, seq, d_model]``.
        stream_dim: the axis of the streams in a block's output tensor (``None`` with ``lift``).
        description: a few words for messages and docs.
        lift: ``(stream, delta) -> stream`` with ``delta`` added where the residual lives, when that is
            not "every stream alike" (ProphetNet: the read-out stream only; XLNet: time-major).
    """

    collapse: Callable[[torch.Tensor], torch.Tensor]
    stream_dim: int | None
    description: str = ""
    lift: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


_READOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_stream_readout(blocks: Iterable[nn.Module], readout: StreamReadout | None) -> None:
    """Declare ``blocks`` multi-stream (``readout``), or single-stream again (``None``)."""
    for block in blocks:
        if readout is None:
            _READOUTS.pop(block, None)
        else:
            _READOUTS[block] = readout


def residual_of(block: nn.Module, stream: torch.Tensor) -> torch.Tensor:
    """The residual ``[batch, seq, d_model]`` of ``block``'s output tensor (its streams collapsed)."""
    readout = _READOUTS.get(block)
    return stream if readout is None else readout.collapse(stream)


def add_to_streams(block: nn.Module, stream: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``stream + delta`` where ``delta`` (``[batch, seq, d_model]``) is added to every stream alike."""
    readout = _READOUTS.get(block)
    if readout is None:
        return stream + delta
    if readout.lift is not None:
        return readout.lift(stream, delta)
    return stream + delta.unsqueeze(readout.stream_dim)


def register_own_thread_hook(module: nn.Module, hook: Callable) -> torch.utils.hooks.RemovableHandle:
    """``module.register_forward_hook(hook)``, with ``hook`` run only for forward passes of the thread
    that registered it.

    A forward hook belongs to the module, not to the call: without this, two threads reading with
    one model at once (the app's warm-up and its first page, two browser sessions) would record,
    edit or stop each other's forward passes.
    """
    owner = threading.get_ident()

    def own_thread_only(module, args, output):
        if threading.get_ident() != owner:
            return None
        return hook(module, args, output)

    return module.register_forward_hook(own_thread_only)


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
        activations: ``{index: Tensor[batch, seq, d_model]}`` after the forward pass (for a
            multi-stream block, the collapsed residual; see the module docstring).

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
        block = self.blocks[index]

        def hook(module, args, output):
            raw = block_output(output)
            readout = _READOUTS.get(block)
            replaced = None
            if readout is None:
                h = raw
                if index == self.start_graph_at:
                    h = h.detach().requires_grad_(True)
                    # the model gets a copy: an in-place op after the block (XLM's padding mask) must
                    # not touch the leaf
                    replaced = _replace_output(output, h.clone())
            else:
                if index == self.start_graph_at:
                    raw = raw.detach()
                if index == self.start_graph_at or (index in self.at and index != self.stop_after
                                                    and torch.is_grad_enabled() and raw.requires_grad):
                    # a source layer: a leaf holding the collapsed residual, added (as zero) to every
                    # stream; the gradient at it is the sum over streams and nothing below flows
                    # through it. The last layer run (``stop_after``, the target) stays in the graph.
                    h = readout.collapse(raw.detach()).detach().requires_grad_(True)
                    replaced = _replace_output(output, add_to_streams(block, raw, h - h.detach()))
                else:
                    h = readout.collapse(raw)
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
            self._handles.append(register_own_thread_hook(self.blocks[i], self._hook(i)))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return exc_type is StopForward
