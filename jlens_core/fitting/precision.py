"""The fit's compute dtype (docs/fitting.md, "Precision"): which one ``"auto"`` is, and the bf16 model it runs.

A bf16 fit runs the model's forward and the analytic (or autograd) backward in bf16, as the reference does on
GPUs; each prompt's Jacobian is summed over positions in fp32 (``fused_backward``, ``_autograd_jacobians``)
and the running sums are fp64, so only the per-position products carry bf16 rounding. On a CPU that is
worth it only where bf16 matmuls run in hardware (AMX-BF16, AVX512-BF16: :mod:`jlens_core.models.cpu_features`);
elsewhere they are emulated and far slower than fp32, so ``"auto"`` never picks bf16 there.
"""

from __future__ import annotations

import copy
import logging
import os

import torch
from torch import nn

from ..lenses.fit_settings import FIT_DTYPES
from ..models.cpu_features import bf16_flag, cpu_bf16_flag
from ..models.model import HFLensModel, LensModel

log = logging.getLogger(__name__)

# What "auto" takes on a CPU with hardware bf16 and an fp32 model. Decided by bench/bf16_fit.py against the
# rule of issue 52: bf16 only where its lens differs from the fp32 lens by less than a fifth of the split-half
# predicted sampling error at every layer (docs/fitting.md, "Precision", has the figures: 20 prompts, at most
# 0.102 of the SE, at layer 28).
CPU_BF16_DEFAULT = True
# "0" / "1" in this environment variable overrides CPU_BF16_DEFAULT (for this process and the fits it starts):
# a user who wants fp32 fits everywhere, and the test suite, whose checks against fp32 computations pin it.
CPU_BF16_ENV = "JLENS_CPU_BF16"

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def cpu_bf16_default() -> bool:
    """Whether ``"auto"`` picks bf16 on a CPU with hardware bf16: ``$JLENS_CPU_BF16`` (``0`` or ``1``) where set,
    else :data:`CPU_BF16_DEFAULT`.

    Raises:
        ValueError: the variable set to anything but ``0`` or ``1``.
    """
    value = os.environ.get(CPU_BF16_ENV, "").strip()
    if not value:
        return CPU_BF16_DEFAULT
    if value not in ("0", "1"):
        raise ValueError(f"{CPU_BF16_ENV}={value!r} is neither 0 nor 1: set it to 0 (fp32 fits on this CPU) or 1 "
                         "(bf16 where the CPU has it), or unset it for the default.")
    return value == "1"


def resolve_fit_dtype(requested: str, model: LensModel, *, cpuinfo: str | None = None,
                      cpu_default: bool | None = None) -> str:
    """The concrete compute dtype (``"float32"`` or ``"bfloat16"``) a fit of ``model`` runs in.

    ``"auto"``: a model loaded in bf16 (a GPU's default) fits in bf16; an fp32 model on a CPU whose flags
    (those of ``cpuinfo``, a ``/proc/cpuinfo`` text, when given; else this CPU's,
    :func:`~jlens_core.models.cpu_features.cpu_bf16_flag`) give hardware bf16 fits in bf16
    when ``cpu_default`` (default :func:`cpu_bf16_default`) says the bench found it within bounds; anything
    else in fp32. An explicit ``"bfloat16"`` on a CPU without those flags runs (slowly) with a warning.

    Raises:
        ValueError: ``requested`` is not one of ``FIT_DTYPES``; ``"float32"`` asked of a model loaded in
            another dtype; or a model whose dtype is neither fp32 nor bf16 (fp16) asked for bf16.
    """
    if requested not in FIT_DTYPES:
        raise ValueError(f"dtype={requested!r} is not one of {FIT_DTYPES}: use 'float32', 'bfloat16' or 'auto'.")
    own = _NAMES.get(model.dtype)
    on_cpu = model.device.type == "cpu"
    flag = (bf16_flag(cpuinfo) if cpuinfo is not None else cpu_bf16_flag()) if on_cpu else None
    if requested == "auto":
        if own is None:
            raise ValueError(f"The model is loaded in {model.dtype}, which a fit does not compute in: load it in "
                             "float32 or bfloat16 (--dtype).")
        if own == "float32" and on_cpu and flag is not None and (cpu_bf16_default() if cpu_default is None
                                                                 else cpu_default):
            return "bfloat16"
        return own
    if requested != own and own != "float32":
        raise ValueError(f"dtype={requested!r} asks for a {requested} fit of a model loaded in {model.dtype}: load "
                         f"the model in float32 (--dtype float32) to fit in {requested}.")
    if requested == "bfloat16" and on_cpu and flag is None:
        log.warning("Fitting in bfloat16 on a CPU without AMX-BF16 or AVX512-BF16: its bf16 matmuls are emulated "
                    "and run far slower than float32.")
    return requested


def compute_model(model: LensModel, dtype: str) -> LensModel:
    """``model`` itself when it computes in ``dtype`` already; else (an fp32 :class:`HFLensModel` and
    ``"bfloat16"``) a bf16 twin sharing its tokenizer and config: its own bf16 copy of every floating
    parameter (half the fp32 weights' memory more while it lives), buffers such as rotary frequencies kept as
    they are. The twin is kept on ``model`` for the next fit.

    Raises:
        ValueError: a model that is no :class:`HFLensModel` asked for another dtype than its own.
    """
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if model.dtype == want:
        return model
    cached = getattr(model, "_jlens_compute_twin", None)
    if cached is not None and cached.dtype == want:
        return cached
    if not isinstance(model, HFLensModel):
        raise ValueError(f"A {type(model).__name__} computes in {model.dtype}; fitting it in {dtype} needs an "  # noqa: TRY004 - a setting's error
                         "HFLensModel (or load the model in that dtype).")
    hf: nn.Module = model.hf_model
    # deepcopy with each parameter pre-mapped to its cast: no fp32 copy of the weights is ever made
    memo: dict[int, object] = {id(p): nn.Parameter(p.detach().to(want), requires_grad=False)
                               for p in hf.parameters() if p.is_floating_point()}
    memo[id(model.tokenizer)] = model.tokenizer
    twin_hf = copy.deepcopy(hf, memo)
    twin = HFLensModel(twin_hf, model.tokenizer, layout=model.layout, name=model.name)
    try:
        model._jlens_compute_twin = twin  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return twin


__all__ = ["CPU_BF16_DEFAULT", "CPU_BF16_ENV", "compute_model", "cpu_bf16_default", "resolve_fit_dtype"]
