"""Where a model's modules run, and their weights when accelerate has offloaded them (docs/method.md §5).

A model loaded with a ``device_map`` (:func:`~jlens_core.models.loading.load_model`) carries
accelerate's hooks: each module runs on its hook's *execution device*, and a module whose weights
are offloaded (to the CPU from a GPU map, or to disk) holds meta tensors until its forward runs.
Code that runs a module needs nothing (the hook moves the input and loads the weights); code that
reads weights directly (the fingerprint, a LayerNorm's gain, the fused backward) reads them inside
:func:`materialised`, and code that makes an input for a module puts it on :func:`execution_device`.
Without hooks every function here reduces to the plain module: its parameters' device, no change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# The attribute accelerate's hooks keep the module's own forward in (``module.forward`` is the hook's).
HOOKED_FORWARD = "_old_forward"


def _hooks_of(module: nn.Module) -> list[Any]:
    """The accelerate hooks on ``module`` itself (a ``SequentialHook`` unpacked), none without accelerate."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def execution_device(module: nn.Module, default: torch.device | str = "cpu") -> torch.device:
    """The device ``module`` computes on: its accelerate hook's execution device, else that of its first
    parameter or buffer that is not a meta tensor, else ``default``."""
    for hook in _hooks_of(module):
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device(default)


def is_offloaded(module: nn.Module) -> bool:
    """Whether any weight of ``module`` (or of a module inside it) is a meta tensor: offloaded by
    accelerate until a forward needs it."""
    return any(p.device.type == "meta" for p in module.parameters())


def execution_devices(module: nn.Module) -> set[torch.device]:
    """The devices the parameters of ``module`` compute on (offloaded ones: their hook's execution device)."""
    return {execution_device(m) for m in module.modules() if any(True for _ in m.parameters(recurse=False))}


def is_dispatched(module: nn.Module) -> bool:
    """Whether ``module`` is spread over several devices or has offloaded weights (a ``device_map``)."""
    return len(execution_devices(module)) > 1 or is_offloaded(module)


@contextlib.contextmanager
def materialised(module: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every offloaded weight of ``module`` (and of the modules inside it) is a real
    tensor on its execution device; offloaded again on exit. A module without offloaded weights is
    yielded unchanged.

    Running a submodule inside the block is allowed, but its hook offloads its own weights again when
    its forward ends: read weights directly, or run modules, not both.
    """
    with contextlib.ExitStack() as stack:
        if is_offloaded(module):
            from accelerate.utils import align_module_device, has_offloaded_params

            for inner in module.modules():
                if has_offloaded_params(inner):
                    stack.enter_context(align_module_device(inner))
        yield module


def own_forward_attribute(module: nn.Module) -> str:
    """The instance attribute holding the module's own forward: accelerate's ``_old_forward`` under a hook
    (so a replacement runs with the weights loaded and the input moved), else ``forward``."""
    return HOOKED_FORWARD if HOOKED_FORWARD in module.__dict__ else "forward"
