"""Relevance rules for the autograd estimator: the backward of the R-lens (docs/method.md §9.1).

``rules="relevance"`` computes the §2 quantity (same positions, ``skip_first``, sums over target and
source positions) with the backward changed and the forward values unchanged:

* **residual-path norms** (the norms that are direct children of a decoder layer: its input norms,
  and Gemma's sandwich norms): the denominator (``rsqrt`` of the mean square, or of the variance,
  plus ``eps``) is a constant. Norms inside attention (q/k norms) keep ordinary gradients;
* **elementwise activations** (every ``ACT2FN`` or ``torch.nn`` activation module outside attention):
  the identity rule, backward ``grad * f(z) / z`` with ``f'(0)`` at ``z = 0``;
* **gated products** (an activation's output times another tensor that carries gradient,
  ``act(gate) * up``): the half rule ``p -> 0.5 p + 0.5 p.detach()``;
* **MoE**: router outputs (``*Router`` modules, the ``gate``/``router`` beside ``experts``) and
  ``shared_expert_gate`` outputs are constants; the rules above apply inside experts;
* attention, softmax and linear maps: ordinary gradients.

Each rule is a surrogate: the module's own forward runs without a graph and gives the value, and a
surrogate with the rule's gradient adds ``s - s.detach()`` (exactly zero) to it. So the forward
values are bit-identical and the backward is plain autograd (``is_grads_batched`` works).

:func:`relevance_unsupported_reason` refuses, in one sentence, a model whose decoder layers have a
part the rules do not name: a recurrent, convolutional or indexer state (SSMs, linear attention), a
norm that is neither an RMSNorm nor a LayerNorm, a module or a nonlinear function outside attention
that is none of the above.

The patches live on the module instances for the duration of :func:`relevance_rules`: another
thread running the same model meanwhile sees the same forward values, and the rules' gradients.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..models.model import LensModel, kv_cache_problem
from ..models.placement import execution_device, materialised, own_forward_attribute
from ..models.recorder import ActivationRecorder
from ..seeds import generator

log = logging.getLogger(__name__)

# Nonlinear elementwise functions the probe looks for outside attention, activations, norms and routers.
_NONLINEAR = frozenset({
    "silu", "gelu", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "softplus", "mish", "hardswish",
    "hardsigmoid", "sigmoid", "tanh", "exp", "log", "erf", "rsqrt", "sqrt", "pow", "__pow__", "square",
    "softmax", "log_softmax", "sin", "cos", "abs", "glu", "logsigmoid",
})
_PRODUCTS = frozenset({"mul", "__mul__", "__rmul__", "multiply"})
# Methods through which an activation's output stays "an activation's output" for the half rule.
_KEEPS_MARK = frozenset({"to", "float", "half", "bfloat16", "type_as", "contiguous", "clone"})
_MLP_LEAVES: tuple[type, ...] = (nn.Linear, nn.Dropout, nn.Identity)


class _ActivationOutput(torch.Tensor):
    """An activation's output: a product of it with a tensor that carries gradient gets the half rule
    (docs/method.md §9.1); any other operation returns a plain tensor."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        plain = [a.as_subclass(torch.Tensor) if isinstance(a, _ActivationOutput) else a for a in args]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*plain, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _PRODUCTS and isinstance(out, torch.Tensor) and len(plain) == 2:
            other = plain[1] if isinstance(args[0], _ActivationOutput) else plain[0]
            if isinstance(other, torch.Tensor) and other.requires_grad and out.requires_grad:
                return 0.5 * out + 0.5 * out.detach()  # each factor gets half its ordinary gradient
        if name in _KEEPS_MARK and isinstance(out, torch.Tensor):
            return out.as_subclass(cls)
        return out


def _with_gradient_of(value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """``value`` in the forward (bit-identical), ``surrogate``'s gradient in the backward."""
    surrogate = surrogate.to(value.dtype)
    return value + (surrogate - surrogate.detach())


@dataclass(frozen=True)
class NormRule:
    """A residual-path norm recognised as ``w_eff * centre(x) * r(x) + b`` (``r`` held constant).

    Attributes:
        centred: LayerNorm (the mean is subtracted) rather than RMSNorm.
        one_plus: the gain is ``1 + weight`` (Gemma's RMSNorm).
        eps: added to the mean square (or variance) under the root.
    """

    centred: bool
    one_plus: bool
    eps: float

    def surrogate(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` [..., d] with its denominator detached, in fp32."""
        xf = x.float()
        if self.centred:
            xf = xf - xf.mean(-1, keepdim=True)
        r = torch.rsqrt(xf.detach().pow(2).mean(-1, keepdim=True) + self.eps)
        out = xf * r
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            out = out * (1.0 + weight.float() if self.one_plus else weight.float())
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            out = out + bias.float()
        return out


def _norm_eps(module: nn.Module) -> float:
    for attr in ("variance_epsilon", "eps", "epsilon", "layer_norm_eps"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return float(torch.finfo(torch.float32).eps)  # nn.RMSNorm(eps=None)


def recognise_norm(module: nn.Module, d: int) -> NormRule | None:
    """The :class:`NormRule` whose full forward (denominator included) reproduces ``module`` on a random
    input (relative 1e-4 in fp32, 2e-2 in lower precision), or ``None``."""
    weight = getattr(module, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    gen = generator(0)
    x = (torch.randn(2, 3, d, generator=gen) * 3 + 0.5).to(device=execution_device(module), dtype=dtype)
    with torch.no_grad():
        try:
            want = module(x).float()
        except Exception:  # noqa: BLE001 - a norm that cannot run on [2, 3, d] is not one the rules know
            return None
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        eps = _norm_eps(module)
        with materialised(module):  # the surrogate reads the gain directly (offloaded: a meta tensor)
            for centred in (False, True):
                for one_plus in (False, True):
                    rule = NormRule(centred, one_plus, eps)
                    got = rule.surrogate(module, x)
                    if got.shape == want.shape and float((got - want).norm() / want.norm().clamp_min(1e-30)) <= tol:
                        return rule
    return None


def _is_norm(name: str, module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def _is_attention(name: str, module: nn.Module) -> bool:
    text = (name + " " + type(module).__name__).lower()
    return "attn" in text or "attention" in text


def _activation_classes() -> tuple[type, ...]:
    from transformers.activations import ACT2CLS

    classes: set[type] = {cast(type, entry[0] if isinstance(entry, tuple) else entry) for entry in ACT2CLS.values()}
    classes |= {nn.SiLU, nn.GELU, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Mish,
                nn.Hardswish, nn.Tanh, nn.Softplus}
    return tuple(sorted(classes, key=lambda c: c.__name__))


def _zero_slope(module: nn.Module) -> tuple[float, float]:
    """``(f(0), f'(0))`` of an activation module, in fp32."""
    z = torch.zeros(1, requires_grad=True)
    with torch.enable_grad():
        value = module(z)
        (slope,) = torch.autograd.grad(value.sum(), z)
    return float(value.detach()), float(slope)


def _is_router(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    cls = type(module).__name__.lower()
    if "router" in cls or "topk" in cls or name == "shared_expert_gate":
        return True
    beside_experts = parent is not None and hasattr(parent, "experts")
    return beside_experts and name in ("gate", "router", "gating", "gate_proj_router")


@dataclass
class RulePlan:
    """The modules :func:`relevance_rules` patches, found by :func:`plan_rules`."""

    norms: list[tuple[nn.Module, NormRule]] = field(default_factory=list)
    activations: list[tuple[nn.Module, float]] = field(default_factory=list)  # (module, f'(0))
    routers: list[nn.Module] = field(default_factory=list)
    skip: list[nn.Module] = field(default_factory=list)  # attention blocks: ordinary gradients


def _walk_mlp(i: int, name: str, module: nn.Module, parent: nn.Module | None, plan: RulePlan,
              acts: tuple[type, ...]) -> str | None:
    """Plan the rules inside a non-attention part of layer ``i``; the reason it cannot, or ``None``."""
    if _is_router(name.rsplit(".", 1)[-1], module, parent):
        plan.routers.append(module)
        return None
    if isinstance(module, acts):
        f0, slope = _zero_slope(module)
        if f0 != 0.0:
            return (f"layer {i}'s activation {name!r} ({type(module).__name__}) is {f0:g} at 0, so the identity "
                    "rule f(z)/z is undefined there")
        plan.activations.append((module, slope))
        return None
    if _is_norm(name, module):
        return f"layer {i} has a norm inside its {name.split('.')[0]!r} part ({type(module).__name__}), which the rules do not name"
    if _is_attention(name.rsplit(".", 1)[-1], module):
        return f"layer {i} has attention inside its {name.split('.')[0]!r} part ({type(module).__name__})"
    children = list(module.named_children())
    if not children:
        own = [p for p in module.parameters(recurse=False)]
        if isinstance(module, _MLP_LEAVES) or type(module).__name__ == "Conv1D" or not own:
            return None
        if "expert" in type(module).__name__.lower():  # fused expert weights (3-D parameters), activation inside
            return None
        return f"layer {i}'s part {name!r} ({type(module).__name__}) is none that the rules name"
    for child_name, child in children:
        reason = _walk_mlp(i, f"{name}.{child_name}", child, module, plan, acts)
        if reason is not None:
            return reason
    return None


def plan_rules(model: LensModel) -> tuple[RulePlan, str | None]:
    """Find the modules each rule applies to, structurally (no forward pass).

    Returns:
        ``(plan, reason)``: ``reason`` says in a few words which part of which layer no rule names
        (``None`` when every part is named).
    """
    plan = RulePlan()
    acts = _activation_classes()
    d = model.d_model
    for i, layer in enumerate(model.layers):
        for name, child in layer.named_children():
            if _is_norm(name, child):
                rule = recognise_norm(child, d)
                if rule is None:
                    return plan, (f"layer {i}'s norm {name!r} ({type(child).__name__}) is neither an RMSNorm nor "
                                  "a LayerNorm the rules know")
                plan.norms.append((child, rule))
            elif _is_attention(name, child):
                plan.skip.append(child)
            else:
                reason = _walk_mlp(i, name, child, layer, plan, acts)
                if reason is not None:
                    return plan, reason
    return plan, None


def _patch(module: nn.Module, forward: Callable[..., Any]) -> tuple[nn.Module, str, Any]:
    """Replace the module's own forward (under an accelerate hook, the one the hook calls with the weights
    loaded); returns what :func:`_unpatch` restores."""
    attr = own_forward_attribute(module)
    before = module.__dict__.get(attr)
    setattr(module, attr, forward)  # an instance attribute, restored on exit
    return module, attr, before


def _unpatch(patched: tuple[nn.Module, str, Any]) -> None:
    module, attr, before = patched
    if before is None:
        module.__dict__.pop(attr, None)
    else:
        module.__dict__[attr] = before


def _own_forward(module: nn.Module) -> Callable[..., Any]:
    return getattr(module, own_forward_attribute(module))


def _rule_forward(module: nn.Module, backward: Callable[[torch.Tensor, torch.Tensor], Any]) -> Callable[..., Any]:
    """``module``'s own forward, except that where a gradient is taken its value (computed without one) gets
    the gradient ``backward(x, value)`` gives it."""
    original = _own_forward(module)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return original(x, *args, **kwargs)
        with torch.no_grad():
            value = original(x, *args, **kwargs)
        return backward(x, value)
    return forward


def _norm_forward(module: nn.Module, rule: NormRule) -> Callable[..., Any]:
    return _rule_forward(module, lambda x, value: _with_gradient_of(value, rule.surrogate(module, x)))


def _activation_forward(module: nn.Module, slope: float) -> Callable[..., Any]:
    def backward(z: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            ratio = torch.where(z == 0, torch.full_like(value, slope), value / z)  # f(z)/z, f'(0) at 0
        out = _with_gradient_of(value, z * ratio)
        return out.as_subclass(_ActivationOutput)
    return _rule_forward(module, backward)


def _detach_outputs(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detach_outputs(o) for o in out)
    return out


def _router_forward(module: nn.Module) -> Callable[..., Any]:
    original = _own_forward(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return _detach_outputs(original(*args, **kwargs))
    return forward


@contextlib.contextmanager
def relevance_rules(model: LensModel, plan: RulePlan | None = None) -> Iterator[RulePlan]:
    """Patch ``model``'s modules to the relevance rules for the duration of the block.

    Raises:
        ValueError: the model has a part the rules do not name (:func:`relevance_unsupported_reason`).
    """
    if plan is None:
        reason = relevance_unsupported_reason(model)
        if reason is not None:
            raise ValueError(unsupported_message(model, reason))
        plan, _ = plan_rules(model)
    patched: list[tuple[nn.Module, str, Any]] = []
    try:
        for module, rule in plan.norms:
            patched.append(_patch(module, _norm_forward(module, rule)))
        for module, slope in plan.activations:
            patched.append(_patch(module, _activation_forward(module, slope)))
        for module in plan.routers:
            patched.append(_patch(module, _router_forward(module)))
        yield plan
    finally:
        for entry in reversed(patched):
            _unpatch(entry)


class _NonlinearCalls(TorchFunctionMode):
    """Records nonlinear functions applied to tensors that carry gradient outside the modules whose
    rule is known (attention, norms, activations, routers): parts the rules do not name."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known
        self.depth = 0  # > 0 inside a known module
        self.stack: list[str] = []
        self.found: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # outside every decoder layer (embeddings, the final norm) is not the estimator's business
        if (self.depth == 0 and self.stack and name in _NONLINEAR and not self.found
                and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            self.found.append(f"{name} in {self.stack[-1]}")
        return func(*args, **kwargs)


def _probe_functions(model: LensModel, plan: RulePlan) -> str | None:
    """Run a short forward with the rules on; the first nonlinear function no rule covers, or ``None``."""
    known = {id(m) for m, _ in plan.norms} | {id(m) for m, _ in plan.activations}
    known |= {id(m) for m in plan.routers} | {id(m) for m in plan.skip}
    mode = _NonlinearCalls(known)
    handles = []
    for layer in model.layers:
        for module in layer.modules():
            def pre(mod: nn.Module, args: Any) -> None:
                mode.stack.append(type(mod).__name__)
                if id(mod) in known:
                    mode.depth += 1

            def post(mod: nn.Module, args: Any, out: Any) -> None:
                mode.stack.pop()
                if id(mod) in known:
                    mode.depth -= 1
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    vocab = int(getattr(model.config, "vocab_size", 0) or 2)
    ids = (torch.arange(8, device=model.device) % vocab)[None]
    try:
        with relevance_rules(model, plan), torch.enable_grad(), \
                ActivationRecorder(model.layers, [0, model.n_layers - 1], start_graph_at=0,
                                   stop_after=model.n_layers - 1), mode:
            model.run_with_cache(ids)
    finally:
        for handle in handles:
            handle.remove()
    return mode.found[0] if mode.found else None


def relevance_unsupported_reason(model: LensModel) -> str | None:
    """Why the relevance rules cannot run on ``model`` (``None`` when they can); decided once per model.

    Refused: a cache that is not plain attention keys/values (state-space, linear-attention,
    convolution or indexer state), a layer-level norm that is neither an RMSNorm nor a LayerNorm,
    a module outside attention that is no linear map, activation or router, and a nonlinear function
    applied outside those (found by a short forward pass with the rules on).
    """
    memo = getattr(model, "_jlens_relevance_reason", False)  # memo set on the object, if any
    if memo is None or isinstance(memo, str):
        return memo
    reason: str | None
    try:
        vocab = int(getattr(model.config, "vocab_size", 0) or 2)
        with torch.no_grad():
            cache = model.run_with_cache((torch.arange(4, device=model.device) % vocab)[None], use_cache=True)
        reason = kv_cache_problem(cache)
        if reason is None:
            plan, reason = plan_rules(model)
            if reason is None:
                found = _probe_functions(model, plan)
                if found is not None:
                    reason = f"it applies {found}, outside the parts the rules name"
    except Exception as exc:  # noqa: BLE001 - any failure means: the rules cannot be applied here
        reason = f"applying them fails ({type(exc).__name__}: {exc})"
    try:
        model._jlens_relevance_reason = reason  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return reason


def unsupported_message(model: LensModel, reason: str) -> str:
    """One sentence: the model, why, and where the rules are stated."""
    return (f"The relevance rules (docs/method.md §9.1) do not cover {model.name!r}: {reason}; "
            "fit it with rules='jacobian'.")
