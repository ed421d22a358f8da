"""The package layout: dependencies between jlens_core's subpackages point one way (docs/development.md, Layout).

Every import inside ``jlens_core`` is read with ``ast`` (relative and absolute, at module level or
inside functions) and checked against the order below: a module may import its own subpackage, a
leaf, or a subpackage of a lower rank. Siblings of one rank (``fitting`` / ``reading``) do not
import each other.
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
LEAVES = {"_atomic", "_deprecated", "_version", "_paths", "corpus", "layerspec", "workspace"}
RANKS = {"files": 1, "models": 1, "lenses": 2, "fitting": 3, "reading": 3, "interventions": 4, "debugging": 4,
         "figures": 4, "evaluation": 5, "cli": 6}
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

PUBLIC_NAMES = [
    "DEFAULT_MODEL", "EVAL_SETS", "LAYOUTS", "ActivationRecorder", "FitProgress", "FitState", "HFLensModel",
    "JacobianLens", "LensFileError", "LensModel", "LogitLens", "ModelLayout", "PromptJacobian", "PromptReading",
    "decoy_items", "default_lens", "evaluate", "fit", "jacobian_for_prompt", "load_corpus", "load_eval_set", "load_lens",
    "load_model", "pass_at_k", "read_prompt", "read_prompts", "resolve_layers", "valid_position_mask",
    "Lens",  # the lens protocol (issue #29 §4)
    # the front door for what the docs import (issue #29 §5)
    "Ablate", "Generation", "Steer", "Swap", "SwapReport", "TunedLens", "compare_readings", "compare_runs",
    "diff_dumps", "difference", "divergence_curve", "dump_hidden_states", "generate", "load_swap_set",
    "most_common_tokens", "swap_success", "token_direction", "train_tuned_lens",
    "ExpertLens",  # expert lenses, J++ (issue #32 §1)
    "learn_expert_weights", "macro_pass_at_k", "read_labelled_items", "split_items",  # expert weights (#32 §3)
    "CheckResult", "check_lens",  # the lens check (issue #42 §3)
    # the figures, in the library (issue #33 §1, §2)
    "comparison_figure", "eval_curves_figure", "fit_figures", "heatmap_figure", "pass_at_k_figure",
    "pinned_ranks_figure", "swap_success_figure", "write_reading_page",
    "ReadingFile", "ReadingFileError", "load_readings", "save_readings",  # the reading file (issue #33 §3)
    "gap_comparison", "heldout_items", "macro_comparison",  # lenses compared with paired intervals (issues #31 §5, #32 §5)
]


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
    import subprocess
    import sys

    current = version_tuple(jlens_core.__version__)
    for old, (new, removed_in) in DEPRECATED_PATHS.items():
        path = PACKAGE.parent / (old.replace(".", "/") + ".py")
        assert current < version_tuple(removed_in), (
            f"jlens is {jlens_core.__version__}: delete the deprecated shim {path.name} ({old} -> {new}), "
            f"due in {removed_in}, and its entry in DEPRECATED_PATHS")
        assert path.is_file(), f"{old} is listed as deprecated but has no shim"
        code = (f"import warnings, {new} as new; warnings.simplefilter('always')\n"
                f"with warnings.catch_warnings(record=True) as seen:\n"
                f"    import {old} as old\n"
                f"    names = [n for n in new.__all__]\n"
                f"    same = all(getattr(old, n) is getattr(new, n) for n in names)\n"
                f"print(same, len(names), sum(issubclass(w.category, DeprecationWarning) for w in seen))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        assert out[0] == "True" and int(out[1]) > 0 and out[2] == "1", (old, out)
    assert version_tuple("0.3.0") > version_tuple("0.2.9") and version_tuple("0.10.0") > version_tuple("0.3.0")


def test_public_names_are_unchanged():
    assert sorted(jlens_core.__all__) == sorted(PUBLIC_NAMES)
    for name in PUBLIC_NAMES:
        assert getattr(jlens_core, name) is not None


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
    # the TYPE_CHECKING imports (what type checkers see) name the same modules as the lazy table
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    seen = {alias.name: "." + node.module for node in guarded.body for alias in node.names}
    assert seen == jlens_core._SOURCES
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        jlens_core.no_such_name  # noqa: B018
