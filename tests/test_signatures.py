"""No public signature of jlens_core takes more than :data:`MAX_PARAMETERS` parameters (issue 48: "the largest
signatures are at most 10 parameters"); a call with more groups them into a typed value or typed ``**options``.

Read with ``ast`` from every module of ``jlens_core``. Counted: every public function, every public method of a
public class, and every public class's ``__init__`` (its constructor; ``from_fit``-style factories are methods).
Public: no leading underscore on the function and on its class (``__init__`` counts for its class); nested
functions and private classes are not counted. How parameters count: ``self`` and ``cls`` are left out; positional,
keyword-only and positional-only parameters count one each; ``*args`` counts one and ``**options`` counts one
(a typed ``**options: Unpack[...]`` is one documented value, checked at run time by
``jlens_core._keywords.checked_options``). ``typing.overload`` stubs count like the implementation. A dataclass's
generated ``__init__`` is not counted: a record (a result, a settings value) is read by field name and built by
the library or by keyword, which is what a long list of loose parameters is replaced *by*.

:data:`STILL_LONG` lists the signatures over the limit that are not yet shortened, with their count: the list may only
shrink (a listed signature that is now short, or longer than listed, fails too, so the list stays true).
"""

from __future__ import annotations

import ast
from pathlib import Path

import jlens_core

PACKAGE = Path(jlens_core.__file__).resolve().parent
MAX_PARAMETERS = 10
# Not yet shortened: "module:qualname" -> parameters counted as above (empty: every public signature is short).
STILL_LONG: dict[str, int] = {}


def count_parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    if method and positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    return len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)


def public_signatures() -> dict[str, int]:
    """``{"module:qualname": parameters}`` of every counted callable (module docstring), the largest overload's."""
    out: dict[str, int] = {}

    def add(name: str, n: int) -> None:
        out[name] = max(n, out.get(name, 0))

    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                add(f"{where}:{node.name}", count_parameters(node, method=False))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                            item.name == "__init__" or not item.name.startswith("_")):
                        add(f"{where}:{node.name}.{item.name}", count_parameters(item, method=True))
    return out


def test_counting_rule():
    tree = ast.parse("def f(a, /, b, *args, c, **options): ...\nclass C:\n    def __init__(self, x): ...")
    f = tree.body[0]
    init = tree.body[1].body[0]  # type: ignore[attr-defined]
    assert count_parameters(f, method=False) == 5  # type: ignore[arg-type]
    assert count_parameters(init, method=True) == 1


def test_no_public_signature_over_ten_parameters():
    found = public_signatures()
    assert len(found) > 300  # the walk reaches every module
    long = {name: n for name, n in found.items() if n > MAX_PARAMETERS}
    new = {name: n for name, n in long.items() if name not in STILL_LONG}
    assert not new, ("public signatures over 10 parameters (group them into a typed value or typed **options): "
                     + ", ".join(f"{name} ({n})" for name, n in sorted(new.items(), key=lambda kv: -kv[1])))
    stale = {name: (n, found.get(name)) for name, n in STILL_LONG.items() if found.get(name) != n}
    assert not stale, f"STILL_LONG is out of date (listed, now): {stale}: remove or correct the entries"


def test_the_shortened_calls_keep_their_old_keywords():
    """The old keyword spellings still reach the grouped values, and an unknown keyword is Python's TypeError."""
    import pytest

    from jlens_core._keywords import checked_options, options_value
    from jlens_core.interventions.say import SayKeywords, SayOptions
    from jlens_core.interventions.swap_success import SwapKeywords, SwapOptions

    chosen = options_value("make_it_say", None, SayOptions, {"max_replays": 3, "seed": 5}, SayKeywords)
    assert chosen == SayOptions(max_replays=3, seed=5)
    base = SwapOptions(alphas=(1.0,), centred=True)
    assert options_value("swap_success", base, SwapOptions, {"seed": 2}, SwapKeywords) == SwapOptions(
        alphas=(1.0,), centred=True, seed=2)
    assert options_value("swap_success", base, SwapOptions, {}, SwapKeywords) is base
    with pytest.raises(TypeError, match=r"swap_success\(\) got an unexpected keyword argument 'alpha'"):
        options_value("swap_success", None, SwapOptions, {"alpha": 1}, SwapKeywords)
    with pytest.raises(TypeError, match="takes a SwapOptions"):
        options_value("swap_success", SayOptions(), SwapOptions, {}, SwapKeywords)  # type: ignore[type-var]
    with pytest.raises(TypeError, match=r"f\(\) got an unexpected keyword argument 'x'"):
        checked_options("f", {"seed": 1, "x": 2}, SayKeywords)
