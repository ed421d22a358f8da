"""The package layout: dependencies between jlens_core's subpackages point one way (docs/development.md, Layout).

Every import inside ``jlens_core`` is read with ``ast`` (relative and absolute, at module level or
inside functions) and checked against the order below: a module may import its own subpackage, a
leaf, or a subpackage of a lower rank. Siblings of one rank (``fitting`` / ``reading``) do not
import each other, and no module imports itself around a loop of others (every import counted).
The package's public names are one list (``jlens_core/__init__.py``'s ``TYPE_CHECKING`` imports), read here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import jlens_core

PACKAGE = Path(jlens_core.__file__).resolve().parent
APP = PACKAGE.parent / "app"

# Leaves: top-level modules that import nothing from jlens_core.
LEAVES = {"_atomic", "_deprecated", "_extras", "_keywords", "_version", "_paths", "corpus", "layerspec", "seeds",
          "workspace"}
RANKS = {"files": 1, "models": 1, "lenses": 2, "fitting": 3, "reading": 3, "interventions": 4, "debugging": 4,
         "figures": 4, "jspace": 5, "evaluation": 6, "experiments": 7, "cli": 8}
# Modules placed with another group than their folder's: the J-space edits live beside the other edits but use the
# J-space (which reads interventions.read_directions), so they rank with it.
PLACED_WITH = {"jlens_core.interventions.jspace_edits": "jspace"}
# Old paths of moved modules that were documented in 0.1.0: each warns once and forwards (jlens_core/_deprecated.py)
# until the version named, when test_deprecated_paths_go_when_their_version_comes fails.
DEPRECATED_PATHS = {"jlens_core.reading.passk": ("jlens_core.evaluation.passk", "0.3.0"),
                    "jlens_core.reading.lens_comparison": ("jlens_core.evaluation.lens_comparison", "0.3.0"),
                    "jlens_core.reading.labelled_items": ("jlens_core.evaluation.labelled_items", "0.3.0")}
# A result object draws itself (``reading.figure()``, ``evaluation.figure()``, ``reading._repr_html_``): these
# methods import ``jlens_core.figures`` inside their body, lazily, the one upward import the layout allows.
FIGURE_HOOKS = {"figure", "to_html", "_repr_html_", "_repr_mimebundle_"}
# The package's front door re-exports from everywhere; `python -m jlens_core` starts the CLI.
EXEMPT = {"__init__", "__main__"}

def module_name(path: Path) -> str:
    """``jlens_core.fitting.fit`` for ``.../jlens_core/fitting/fit.py`` (packages end in ``__init__``)."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every ``jlens_core`` import in the file."""
    name = module_name(path)
    package = name.rsplit(".", 1)[0]  # the package a relative import starts from
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None:
                # `from . import x`: each name may be a module
                found.extend((node.lineno, f"{target}.{a.name}") for a in node.names)
            else:
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return [(line, mod) for line, mod in found if mod == "jlens_core" or mod.startswith("jlens_core.")]


def place(module: str) -> tuple[str, int | None]:
    """``(group, rank)`` of a jlens_core module: its subpackage, or a leaf / exempt name with rank 0 / None."""
    parts = module.split(".")
    if len(parts) == 1:
        return "jlens_core", None
    owner = next((group for name, group in PLACED_WITH.items() if module == name or module.startswith(name + ".")),
                 None)
    if owner is not None:
        return owner, RANKS[owner]
    top = parts[1]
    if top in RANKS:
        return top, RANKS[top]
    if top in LEAVES:
        return top, 0
    if top in EXEMPT:
        return top, None
    raise AssertionError(f"{module}: not in the layout (add it to a subpackage, or to LEAVES if it imports nothing)")


def all_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_has_a_place_in_the_layout():
    unplaced = []
    for path in all_modules():
        try:
            group, _ = place(module_name(path))
        except AssertionError as exc:
            unplaced.append(str(exc))
        else:
            assert group in ({"jlens_core"} | set(RANKS) | LEAVES | EXEMPT), module_name(path)
    assert not unplaced, "\n".join(unplaced)
    with pytest.raises(AssertionError, match="not in the layout"):
        place("jlens_core.no_such_module")


def all_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in the file (``from x import y`` gives ``x`` and ``x.y``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return found


def test_no_module_in_jlens_core_imports_streamlit():
    """The library never depends on the app's framework (README: the core never imports streamlit)."""
    hits = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {mod}" for path in all_modules()
            for line, mod in all_imports(path) if mod.split(".")[0] == "streamlit"]
    assert not hits, "\n".join(hits)


def private_or_cli(module: str) -> bool:
    """Whether a ``jlens_core`` module path is private (a ``_`` part) or the command line's (``jlens_core.cli``)."""
    parts = module.split(".")
    return parts[0] == "jlens_core" and (any(p.startswith("_") for p in parts[1:]) or parts[1:2] == ["cli"])


def test_the_app_imports_only_public_jlens_core_modules():
    """``app/`` uses the library's public modules: no private ``_`` module, nothing from the CLI."""
    files = sorted(p for p in APP.rglob("*.py") if "__pycache__" not in p.parts)
    assert len(files) >= 10
    hits = [f"{path.relative_to(APP.parent)}:{line} imports {mod}" for path in files
            for line, mod in all_imports(path) if private_or_cli(mod)]
    assert not hits, "\n".join(hits)
    assert private_or_cli("jlens_core._paths") and private_or_cli("jlens_core.cli.fit.sidecar")
    assert not private_or_cli("jlens_core.fitting.runfiles.sidecar") and not private_or_cli("jlens_core.files")


def figure_hook_lines(path: Path) -> set[int]:
    """Lines of the imports inside a :data:`FIGURE_HOOKS` method (a result drawing itself with ``figures``)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name in FIGURE_HOOKS:
            lines.update(sub.lineno for sub in ast.walk(node) if isinstance(sub, ast.ImportFrom | ast.Import))
    return lines


def test_dependencies_point_one_way():
    problems = []
    for path in all_modules():
        name = module_name(path)
        group, rank = place(name)
        if group in EXEMPT:
            continue
        hooks = figure_hook_lines(path)
        for line, target in imported_modules(path):
            t_group, t_rank = place(target)
            if t_group == "figures" and line in hooks:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            if t_group in EXEMPT or t_rank is None:
                problems.append(f"{where}: import from the named subpackage, not the package's front door")
            elif rank == 0:
                problems.append(f"{where}: a leaf imports nothing from jlens_core")
            elif t_group == group or t_rank == 0:
                continue
            elif t_rank >= rank:
                problems.append(f"{where}: {group} (rank {rank}) may not import {t_group} (rank {t_rank})")
    assert not problems, "\n".join(problems)


def import_graph() -> dict[str, set[str]]:
    """``{module: the jlens_core modules it imports}``, every import counted: module level, inside functions and
    under ``TYPE_CHECKING`` (a circle through a type hint is still a circle to the reader). The front door
    (``jlens_core/__init__.py``, which names everything) is left out."""
    modules = {module_name(path): path for path in all_modules()}
    modules = {(name.removesuffix(".__init__")): path for name, path in modules.items()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name == "jlens_core":
            continue
        targets = set()
        for _, target in imported_modules(path):
            while target not in modules and "." in target:  # `from .x import Name`: the module x
                target = target.rsplit(".", 1)[0]
            if target in modules and target not in (name, "jlens_core"):
                targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted: the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    """No two modules import each other, directly or around a longer loop (counting every import)."""
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(group) for group in found)


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert circles({"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"p"}}) == [["p", "q"], ["x", "y"]]


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    """The rule itself: a lenses module importing reading is reported (guards the test above)."""
    fake = tmp_path / "jlens_core"
    (fake / "lenses").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "lenses" / "__init__.py").write_text("")
    (fake / "lenses" / "bad.py").write_text("def f():\n    from ..reading.tokens import TokenDisplay\n")
    (fake / "corpus.py").write_text("from .models.model import HFLensModel\n")
    # a figure hook may import figures lazily; the same import at module level may not
    (fake / "reading").mkdir()
    (fake / "reading" / "__init__.py").write_text("")
    (fake / "reading" / "drawn.py").write_text("class R:\n    def figure(self):\n        from ..figures.heatmaps import f\n")
    (fake / "reading" / "eager.py").write_text("from ..figures.heatmaps import f\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", fake)
    with pytest.raises(AssertionError, match=r"lenses/bad.py:2 imports jlens_core.reading.tokens: lenses \(rank 2\)"):
        test_dependencies_point_one_way()
    with pytest.raises(AssertionError, match="corpus.py:1 imports jlens_core.models.model: a leaf"):
        test_dependencies_point_one_way()
    with pytest.raises(AssertionError, match=r"reading/eager.py:1 imports jlens_core.figures.heatmaps: reading \(rank 3\)"):
        test_dependencies_point_one_way()
    with pytest.raises(AssertionError) as caught:
        test_dependencies_point_one_way()
    assert "drawn.py" not in str(caught.value)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def test_deprecated_paths_warn_once_and_go_when_their_version_comes():
    """A moved module's old path forwards every name with one DeprecationWarning; at its version it must go."""
    import warnings

    current = version_tuple(jlens_core.__version__)
    for old, (new, removed_in) in DEPRECATED_PATHS.items():
        path = PACKAGE.parent / (old.replace(".", "/") + ".py")
        assert current < version_tuple(removed_in), (
            f"jlens is {jlens_core.__version__}: delete the deprecated shim {path.name} ({old} -> {new}), "
            f"due in {removed_in}, and its entry in DEPRECATED_PATHS")
        assert path.is_file(), f"{old} is listed as deprecated but has no shim"
        target = importlib.import_module(new)
        shim = importlib.reload(importlib.import_module(old))  # a fresh shim: it has not warned yet
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert all(getattr(shim, name) is getattr(target, name) for name in target.__all__)
            assert getattr(shim, target.__all__[0]) is getattr(target, target.__all__[0])
        deprecations = [w for w in seen if issubclass(w.category, DeprecationWarning)]
        assert len(deprecations) == 1 and new in str(deprecations[0].message) and removed_in in str(
            deprecations[0].message), (old, [str(w.message) for w in seen])
    assert version_tuple("0.3.0") > version_tuple("0.2.9") and version_tuple("0.10.0") > version_tuple("0.3.0")


def test_public_names_come_from_one_list():
    """``__all__`` and the lazy table are read from the ``TYPE_CHECKING`` imports of ``__init__.py`` (one list)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    listed = [alias.name for node in guarded.body for alias in node.names]
    assert 30 <= len(listed) == len(set(listed)) <= 50  # a notebook's front door (the rest: jlens_core._MOVED)
    assert jlens_core.__all__ == sorted(listed)
    assert {"fit", "read_prompt", "JacobianLens", "load_lens", "pass_at_k", "evaluate"} <= set(jlens_core.__all__)


def test_cli_subcommands_are_all_found():
    from jlens_core.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) >= {"fit", "merge", "eval", "inspect", "dump", "diff", "app"}


def test_the_cli_parser_and_the_package_import_without_torch():
    """``jlens app`` / ``jlens --help`` start in a fraction of a second: the package front door is lazy."""
    import subprocess
    import sys

    code = ("import sys, jlens_core; from jlens_core.cli.main import build_parser; build_parser(); "
            "print(sorted(n for n in ('torch', 'transformers', 'pandas') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_lazy_name_resolves_to_its_defining_module():
    for name in jlens_core.__all__:
        value = getattr(jlens_core, name)
        module = jlens_core._SOURCES[name]
        assert getattr(importlib.import_module(module, "jlens_core"), name) is value
    assert set(jlens_core.__all__) == set(jlens_core._SOURCES) and set(dir(jlens_core)) >= set(jlens_core.__all__)
    # each name is listed at the module that defines it (one address): a function or class is not re-exported
    for name, module in jlens_core._SOURCES.items():
        value = getattr(jlens_core, name)
        if isinstance(value, type) or callable(value) and hasattr(value, "__module__"):
            assert value.__module__ == "jlens_core" + module, f"{name} is defined in {value.__module__}, not {module}"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        jlens_core.no_such_name  # noqa: B018
