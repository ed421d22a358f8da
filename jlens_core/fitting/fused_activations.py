"""The MLP activations of the fused backward (docs/method.md §2.2): value and backward coefficient.

SiLU and the GELUs (exact erf GELU; the tanh approximation as ``gelu_new``, ``gelu_pytorch_tanh``,
``gelu_fast``), recognised by the activation module's class. The value comes from the model's own
activation module; the derivative is written out here:

* SiLU: ``s (1 + z (1 - s))``, ``s = sigmoid(z)``;
* GELU (erf): ``Phi(z) + z phi(z)``;
* GELU (tanh): ``0.5 (1 + t) + 0.5 z (1 - t^2) c (1 + 3 k z^2)``, ``t = tanh(c (z + k z^3))``,
  ``c = sqrt(2 / pi)``, ``k = 0.044715``.

``relevance=True`` (docs/method.md §9.1, identity rule): ``f(z) / z`` instead, ``f'(0) = 0.5`` at
``z = 0`` for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# the activation module's class -> the function it computes (transformers' ACT2FN and torch.nn classes)
ACTIVATION_CLASSES = {
    "SiLUActivation": "silu", "SiLU": "silu",
    "GELUActivation": "gelu_erf",
    "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
}
ACTIVATIONS = ("silu", "gelu_erf", "gelu_tanh")


def activation_kind(module: object) -> str | None:
    """Which of :data:`ACTIVATIONS` the activation ``module`` computes (``None``: another one)."""
    name = type(module).__name__
    if name == "GELU":  # torch.nn.GELU
        return "gelu_tanh" if getattr(module, "approximate", "none") == "tanh" else "gelu_erf"
    return ACTIVATION_CLASSES.get(name)


_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


def _silu_derivative(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def _gelu_erf_derivative(z: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return cdf + z * pdf


def _gelu_tanh_derivative(z: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_C * (z + _K * z.pow(3)))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _C * (1 + 3 * _K * z * z)


def _derivative(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    derivatives = {"silu": _silu_derivative, "gelu_erf": _gelu_erf_derivative, "gelu_tanh": _gelu_tanh_derivative}
    if kind not in derivatives:
        raise ValueError(f"activation {kind!r} is not one of {ACTIVATIONS}")
    return derivatives[kind]


def activation_coefficients(act: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor,
                            relevance: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f(z), backward coefficient)`` in fp32 for pre-activations ``z`` [n, ff].

    ``act`` is the model's activation module (its value is the forward; its class says which
    derivative, :func:`activation_kind`); the coefficient is ``f'(z)``, or ``f(z) / z`` (``0.5`` at 0)
    with ``relevance``.
    """
    kind = activation_kind(act)
    derivative = _derivative(kind or repr(act))
    zf = z.float()
    value = act(zf)  # [n, ff]
    if relevance:
        coefficient = torch.where(zf == 0, torch.full_like(value, 0.5), value / zf)
    else:
        coefficient = derivative(zf)
    return value, coefficient
