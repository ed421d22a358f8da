"""Shapes in the public API's annotations (jaxtyping): no bare ``torch.Tensor`` in what ``jlens_core`` exports
(static, from the annotations as written), and the shapes hold when a tiny model is fitted, read, edited and
generated from (run time: every annotated public callable wrapped with one jaxtyping memo per call)."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jaxtyping
import pytest
import torch
from conftest import LONG_TEXT
from helpers import random_lens

import jlens_core
from jlens_core import JacobianLens

DTYPES = {"Float", "Int", "Bool", "Shaped", "Num", "Real", "Integer", "Inexact", "UInt"}  # jaxtyping's, as used


# -- static: every tensor in the public API carries its shape ------------------------------------------------
def bare_tensor(annotation: str) -> bool:
    """Whether ``annotation`` (as written) names ``Tensor`` outside a jaxtyping ``Dtype[Tensor, "shape"]``."""
    def visit(node: ast.AST, shaped: bool) -> bool:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in DTYPES:
            shaped = True
        if isinstance(node, ast.Name) and node.id == "Tensor" or isinstance(node, ast.Attribute) and node.attr == "Tensor":
            return not shaped
        return any(visit(child, shaped) for child in ast.iter_child_nodes(node))

    return visit(ast.parse(annotation, mode="eval"), False)


def public_callables(obj: Any) -> Iterator[tuple[str, Any]]:
    """``(name, function or class)`` for a public name: a function itself; a class with its fields and the
    public methods (properties, class methods, ``__init__``) of it and its jlens_core bases."""
    if inspect.isfunction(obj):
        yield obj.__qualname__, obj
        return
    if not inspect.isclass(obj):
        return
    for klass in obj.__mro__:
        if not klass.__module__.startswith("jlens_core"):
            continue
        yield f"{klass.__qualname__} fields", klass
        for name, member in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            member = member.fget if isinstance(member, property) else member
            member = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
            if inspect.isfunction(member):
                yield f"{klass.__qualname__}.{name}", member


def bare_tensors(objects: Mapping[str, Any]) -> list[str]:
    found = set()
    for obj in objects.values():
        for where, fn in public_callables(obj):
            for param, annotation in inspect.get_annotations(fn).items():
                if not param.startswith("_") and isinstance(annotation, str) and bare_tensor(annotation):
                    found.add(f"{where}: {param}: {annotation}")
    return sorted(found)


def public_objects() -> dict[str, Any]:
    """Every public name: the top level's and those it moved to their subpackages (``jlens_core._MOVED``)."""
    return {name: getattr(importlib.import_module("jlens_core" + jlens_core._MOVED.get(name, "")), name)
            for name in [*jlens_core.__all__, *jlens_core._MOVED]}


def test_no_bare_tensor_in_the_public_api():
    objects = public_objects()
    assert bare_tensors(objects) == []
    shaped = sum(bool(ann) for obj in objects.values() for _, fn in public_callables(obj)
                 for ann in inspect.get_annotations(fn).values() if isinstance(ann, str) and "Tensor," in ann)
    assert shaped >= 60  # the API does use tensors: the check has something to check


def test_the_static_check_finds_a_bare_tensor():
    namespace: dict[str, Any] = {}
    exec("from __future__ import annotations\nimport torch\nfrom jaxtyping import Float\n"  # noqa: S102
         "def plain(h: torch.Tensor, n: int) -> Float[torch.Tensor, 'd']: ...\n"
         "def nested(m: dict[int, torch.Tensor] | None) -> None: ...\n"
         "def shaped(h: Float[torch.Tensor, '*b d'] | None, ids: str | Float[torch.Tensor, 's']) -> None: ...\n",
         namespace)
    found = bare_tensors({k: namespace[k] for k in ("plain", "nested", "shaped")})
    assert found == ["nested: m: dict[int, torch.Tensor] | None", "plain: h: torch.Tensor"]


# -- run time: the shapes hold on a tiny model -------------------------------------------------------------
class ShapeError(AssertionError):
    pass


def jaxtyping_nodes(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in DTYPES
               for n in ast.walk(tree))


def matches(value: Any, node: ast.AST, scope: dict[str, Any]) -> bool:
    """Whether ``value`` fits the annotation ``node`` as far as its tensors go (within the current memo)."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in DTYPES:
        return isinstance(value, eval(compile(ast.Expression(node), "<annotation>", "eval"), scope))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # a union: a tensor must fit a shaped part
        parts, stack = [], [node]
        while stack:
            part = stack.pop()
            if isinstance(part, ast.BinOp) and isinstance(part.op, ast.BitOr):
                stack += [part.left, part.right]
            else:
                parts.append(part)
        shaped = [p for p in parts if jaxtyping_nodes(p)]
        if not isinstance(value, torch.Tensor) and not isinstance(value, (dict, tuple)):
            return True
        return any(matches(value, p, scope) for p in shaped) if isinstance(value, torch.Tensor) else True
    if isinstance(node, ast.Subscript) and isinstance(value, Mapping):  # dict[K, V], Mapping[K, V]
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return len(args) != 2 or all(matches(v, args[1], scope) for v in value.values())
    if isinstance(node, ast.Subscript) and isinstance(value, tuple):  # tuple[A, B]
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in args) or len(args) != len(value):
            return True
        return all(matches(v, a, scope) for v, a in zip(value, args))
    return True


def checked(fn: Callable, qualname: str, calls: dict[str, int]) -> Callable:
    """``fn`` checking its jaxtyping-annotated arguments and return against one memo per call."""
    signature = inspect.signature(fn)
    annotations = {name: ast.parse(text, mode="eval").body for name, text in fn.__annotations__.items()
                   if isinstance(text, str) and jaxtyping_nodes(ast.parse(text, mode="eval"))}
    scope = fn.__globals__

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[qualname] += 1
        bound = signature.bind(*args, **kwargs)
        with jaxtyping.jaxtyped("context"):
            for name, value in bound.arguments.items():
                if name in annotations and not matches(value, annotations[name], scope):
                    raise ShapeError(f"{qualname}: {name} {_shape(value)} does not fit {ast.unparse(annotations[name])}")
            result = fn(*args, **kwargs)
            if "return" in annotations and not matches(result, annotations["return"], scope):
                raise ShapeError(f"{qualname}: returns {_shape(result)}, not {ast.unparse(annotations['return'])}")
        return result

    return wrapper


def _shape(value: Any) -> str:
    return f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


# Annotated but never run by the scenario, and why.
EXEMPT = {
    "Lens.transport": "protocol signature (implementations are checked)", "Lens.matrix": "protocol signature",
    "LensModel.encode": "protocol signature", "LensModel.decode": "protocol signature",
    "LensModel.forward": "protocol signature", "LensModel.run_with_cache": "protocol signature",
    "LensModel.unembed": "protocol signature", "Lens.logits": "protocol signature",
    "MatrixTransportMixin.matrix": "abstract: raises NotImplementedError (subclasses' are checked)",
    "macro_pass_at_k": "needs labelled pass@k items read by the model (tests/test_expert_weights.py runs it)",
}


def wrap_public_api(monkeypatch) -> dict[str, int]:
    """Wrap every public callable whose annotations carry a shape (in the class or module that defines it)."""
    calls: dict[str, int] = {}
    for obj in public_objects().values():
        for where, fn in public_callables(obj):
            if inspect.isclass(fn) or where in calls:
                continue
            text = " ".join(a for a in fn.__annotations__.values() if isinstance(a, str))
            if "Tensor," not in text:
                continue
            calls[where] = 0
            owner_name, _, attr = where.rpartition(".")
            module = sys.modules[fn.__module__]
            owner = getattr(module, owner_name) if owner_name else module
            raw = vars(owner)[attr] if owner_name else fn
            if isinstance(raw, property):
                monkeypatch.setattr(owner, attr, property(checked(raw.fget, where, calls), raw.fset))
            elif isinstance(raw, classmethod):
                monkeypatch.setattr(owner, attr, classmethod(checked(raw.__func__, where, calls)))
            else:
                monkeypatch.setattr(owner, attr, checked(fn, where, calls))
                if not owner_name and attr in jlens_core.__all__ and getattr(jlens_core, attr) is fn:
                    monkeypatch.setattr(jlens_core, attr, getattr(owner, attr))
    return calls


def test_the_shapes_hold_on_a_tiny_model(monkeypatch, tmp_path):
    from conftest import make_tiny

    from jlens_core.reading.tokens import TokenDisplay, is_word_like

    model = make_tiny("llama")
    calls = wrap_public_api(monkeypatch)
    assert len(calls) >= 35
    from jlens_core import (
        Ablate,
        ExpertLens,
        LogitLens,
        Steer,
        Swap,
        TunedLens,
        dump_hidden_states,
        fit,
        generate,
        read_prompt,
        read_prompts,
    )
    from jlens_core.fitting.estimator import jacobian_for_prompt, valid_position_mask
    from jlens_core.interventions.read_directions import token_direction

    prompts = [LONG_TEXT, LONG_TEXT.upper()]
    lens = fit(model, prompts, max_seq_len=24, skip_first=2)
    experts = fit(model, prompts, max_seq_len=24, skip_first=2, experts=2, cluster_prompts=2)
    assert isinstance(experts, ExpertLens)
    weighted = experts.with_weights({layer: torch.tensor([1.0, -0.5]) for layer in experts.source_layers})
    layer = lens.source_layers[1]
    weighted.combined(layer, weighted.layer_weights(layer))
    weighted.expert_matrices(layer)
    weighted.uniform_weights()
    one = weighted.to_jacobian_lens()
    JacobianLens(dict(one.jacobians), 1, model.d_model)
    ExpertLens(experts.pooled, experts.experts, experts.counts, experts.clustering, 1, model.d_model,
               target_layer=experts.target_layer)
    tuned = TunedLens.zeros(model)
    TunedLens(dict(tuned.translators), model.d_model, target_layer=tuned.target_layer)
    logit = LogitLens.for_model(model)
    for each in (lens, weighted, tuned, logit):
        read_prompt(model, each, "The capital of France is")
        each.matrix(layer)
        each.logits(model, torch.randn(3, model.d_model), layer)
    read_prompts(model, {"J": lens, "logit": logit}, model.encode("The capital of France is")[0])
    jacobian_for_prompt(model, model.encode(LONG_TEXT, max_length=24)[0], source_layers=[layer], skip_first=2)
    valid_position_mask(12, 2)
    display = TokenDisplay.for_model(model)
    a, b = [t for t in display.texts if t.startswith(" ") and len(t) > 2 and is_word_like(t)][:2]
    token_direction(model, lens, layer, a)
    swap = Swap(model, lens, a, b, layers=[layer])
    swap.coordinates(layer, torch.randn(3, model.d_model))
    edits = [Steer(model, lens, a, 2.0, layers=[layer]), Ablate(model, lens, b, layers=[layer]), swap]
    for edit in edits:
        read_prompt(model, lens, "The capital of France is", edits=[edit])
    generate(model, "The capital of France is", max_new_tokens=2, edits=[edits[0]])
    from jlens_core import AblateJSpace, ClampJ, VectorSwap, concept_vectors, decompose, split

    decompose(model, lens, torch.randn(2, model.d_model), layer, k=3)
    split(model, lens, torch.randn(model.d_model), layer, k=3)
    concepts = concept_vectors(model, ["The capital of France is"], ["The capital of Spain is"], layers=[layer])
    clamp = ClampJ(model, lens, [a], layers=[layer])
    clamp.coordinates(layer, torch.randn(3, model.d_model))
    jspace_edits = [VectorSwap(model, lens, concepts, {layer: -concepts[layer]}, layers=[layer], k=3), clamp,
                    AblateJSpace(model, lens, k=3, layers=[layer])]
    read_prompt(model, lens, "The capital of France is", edits=jspace_edits)
    dump_hidden_states(model, model.encode("The capital")[0], tmp_path / "dump")
    model.decode(model.encode("The capital"))
    from jlens_core.fitting.fit import FitState

    state = FitState(jacobian_sum={0: torch.zeros(4, 4, dtype=torch.float64)}, n_done=1)
    state.mean(0)

    never = sorted(name for name, n in calls.items() if n == 0 and name not in EXEMPT)
    assert never == [], f"annotated but not exercised: {never}"
    assert set(EXEMPT) <= set(calls)  # an exemption names a wrapped callable
    assert [name for name in EXEMPT if calls[name]] == []  # and one that runs is no exemption


def test_a_wrong_shape_is_caught_naming_the_parameter(monkeypatch):
    from helpers import tiny

    model = tiny("llama")
    wrap_public_api(monkeypatch)
    lens = random_lens(model)
    h = torch.randn(3, model.d_model)
    torch.testing.assert_close(lens.transport(h, 1), h @ lens.matrix(1).T)  # a right one passes
    with pytest.raises(ShapeError, match=r"transport: h torch.int64 \[3, 32\] does not fit Float"):
        lens.transport(torch.ones(3, model.d_model, dtype=torch.long), 1)  # token ids where a residual goes
    with pytest.raises(ShapeError, match=r"unembed: out .* does not fit"):  # *batch differs between h and out
        model.unembed(h, out=torch.empty(4, model.vocab_size))
    with pytest.raises(ShapeError, match="JacobianLens.__init__: jacobians"):
        JacobianLens({0: torch.eye(4), 1: torch.eye(5)}, 1, 4)  # two widths for one d_model


def test_the_package_and_the_cli_parser_import_neither_torch_nor_jaxtyping():
    code = ("import sys, jlens_core; from jlens_core.cli.main import build_parser; build_parser(); "
            "print(sorted(n for n in ('torch', 'jaxtyping') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

