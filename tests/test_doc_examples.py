"""The examples in the documentation are the code's: every fenced ``python`` block of README.md,
bench/README.md and docs/*.md, and every ``jlens ...`` command line, is checked against the library.

- Names (fast): the python blocks of a page, taken in order as one program, use no undefined name
  (ruff's F821), and every call of a jlens name binds to its real signature: a renamed keyword, a
  missing method or a missing attribute fails. Variables assigned from a jlens call carry the
  call's return type, so ``r = read_prompt(...); r.grid(...)`` checks ``PromptReading.grid``.
- Commands (fast): every ``jlens ...`` line of a ``bash``/``console``/``sh`` block is parsed by the real
  argument parser (``jlens_core.cli.main.build_parser``); inline spans such as `` `jlens fit --rules X` ``
  name a real subcommand and real flags.
- Running (slow): each page's python blocks run in order in a fresh namespace in a temporary folder,
  on the default model.

Directives, an HTML comment on the line(s) just above a block (invisible on GitHub):

- ``<!-- doctest: replace 'OLD' 'NEW' -->`` runs the block with ``OLD`` replaced by ``NEW`` (tiny settings
  for a block that takes minutes); a replacement that matches nothing fails.
- ``<!-- doctest: skip-run REASON -->`` checks the block's names and calls but does not run it (a GPU, a
  model from the Hub).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*doctest:\s*(.*?)\s*-->\s*$")
SHELL_LANGS = {"bash", "console", "sh", "shell", "zsh"}
INLINE_JLENS = re.compile(r"`(jlens [^`]+)`")


def doc_pages(root: Path = ROOT) -> list[Path]:
    """The pages whose examples are checked: the README, bench's README and every docs/ page."""
    return [root / "README.md", root / "bench" / "README.md", *sorted((root / "docs").glob("*.md"))]


@dataclass
class Block:
    """One fenced code block of a page: its language, text, first line (1-based) and directives."""

    page: Path
    lang: str
    text: str
    line: int
    replace: list[tuple[str, str]] = field(default_factory=list)
    skip_run: str | None = None

    @property
    def where(self) -> str:
        try:
            rel = self.page.relative_to(ROOT)
        except ValueError:
            rel = self.page
        return f"{rel}:{self.line}"

    def runnable_text(self) -> str:
        """The block's text with the ``replace`` directives applied; a replacement that matches nothing
        raises ``ValueError`` (the example changed under its directive)."""
        text = self.text
        for old, new in self.replace:
            if old not in text:
                raise ValueError(f"{self.where}: doctest replace {old!r} matches nothing in the block")
            text = text.replace(old, new)
        return text


def parse_directive(text: str, block: Block) -> None:
    """Apply one ``doctest:`` directive's text to ``block``; an unknown directive raises ``ValueError``."""
    word, _, rest = text.partition(" ")
    if word == "replace":
        parts = shlex.split(rest)
        if len(parts) != 2:
            raise ValueError(f"{block.where}: doctest replace takes two quoted strings, got {rest!r}")
        block.replace.append((parts[0], parts[1]))
    elif word == "skip-run":
        if not rest.strip():
            raise ValueError(f"{block.where}: doctest skip-run needs a reason")
        block.skip_run = rest.strip()
    else:
        raise ValueError(f"{block.where}: unknown doctest directive {word!r} (replace, skip-run)")


def code_blocks(page: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a markdown page, with the directives of the comment lines just above it."""
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = match.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[i + 1:end])
        block = Block(page, lang.lower(), body + "\n", i + 2)
        j = i - 1
        while j >= 0 and DIRECTIVE.match(lines[j]):
            parse_directive(DIRECTIVE.match(lines[j]).group(1), block)
            j -= 1
        blocks.append(block)
        i = end + 1
    return blocks


def python_blocks(page: Path, text: str | None = None) -> list[Block]:
    return [b for b in code_blocks(page, text) if b.lang in ("python", "py")]


# -- undefined names ------------------------------------------------------------------------------

def page_program(blocks: list[Block]) -> tuple[str, list[tuple[int, Block]]]:
    """The blocks of a page as one program, and where each block starts in it (1-based program line)."""
    parts, starts, line = [], [], 1
    for block in blocks:
        starts.append((line, block))
        parts.append(block.text)
        line += block.text.count("\n")
    return "".join(parts), starts


def program_location(starts: list[tuple[int, Block]], line: int) -> str:
    for first, block in reversed(starts):
        if line >= first:
            return f"{block.page.relative_to(ROOT) if block.page.is_relative_to(ROOT) else block.page}:" \
                   f"{block.line + line - first}"
    return f"line {line}"


def undefined_names(blocks: list[Block]) -> list[str]:
    """``"page:line: message"`` for every undefined name in the page's python blocks (ruff F821), and for
    every block that is not valid Python."""
    if not blocks:
        return []
    program, starts = page_program(blocks)
    bad = []
    for block in blocks:
        try:
            ast.parse(block.text)
        except SyntaxError as exc:
            bad.append(f"{block.where}: not valid Python ({exc.msg}, block line {exc.lineno})")
    if bad:
        return bad
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    proc = subprocess.run([ruff, "check", "--isolated", "--select", "F821", "--output-format", "concise",
                           "--stdin-filename", "doc.py", "-"], input=program, capture_output=True, text=True,
                          timeout=60, check=False)
    for match in re.finditer(r"doc\.py:(\d+):\d+: (F821 .*)", proc.stdout):
        bad.append(f"{program_location(starts, int(match.group(1)))}: {match.group(2)}")
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not bad):
        raise RuntimeError(f"ruff failed: {proc.stdout}{proc.stderr}")
    return bad


# -- calls bind to the real signatures -------------------------------------------------------------

_UNKNOWN = object()


def _is_jlens(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
    return isinstance(module, str) and module.split(".")[0] == "jlens_core"


def _import(module: str, name: str) -> Any:
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        try:
            return importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError:
            return _UNKNOWN
    return getattr(mod, name)


def _resolve_annotation_name(name: str, target: Any) -> Any:
    """The object a name in ``target``'s return annotation stands for (its module's names, the front door, or
    an import under ``TYPE_CHECKING``), else ``None``."""
    module = sys.modules.get(getattr(inspect.unwrap(target), "__module__", ""), None)
    namespace = dict(vars(module)) if module else {}
    import jlens_core

    for space in (namespace, {n: getattr(jlens_core, n) for n in jlens_core.__all__ if n == name}):
        try:
            return eval(name, space)
        except (NameError, AttributeError, SyntaxError):  # not defined in this namespace: the next
            continue
    if module is not None:  # a name imported under TYPE_CHECKING only
        source = inspect.getsource(module)
        imported = re.search(rf"from ([\w.]+) import [^\n]*\b{re.escape(name)}\b", source)
        if imported:
            base = imported.group(1)
            if base.startswith("."):
                package = module.__name__.rsplit(".", 1)[0] if not hasattr(module, "__path__") else module.__name__
                base = importlib.util.resolve_name(base, package)
            found = _import(base, name)
            return None if found is _UNKNOWN else found
    return None


def _return_class(func: Any) -> Any:
    """The jlens class a function or method returns: one class, a tuple of classes when the annotation names
    several (``JacobianLens | ExpertLens``; ``None`` left out), or ``None`` when it names anything else."""
    target = func.fget if isinstance(func, property) else func
    try:
        annotation = inspect.signature(target).return_annotation
    except (TypeError, ValueError):
        return None
    if isinstance(annotation, type):
        return annotation if _is_jlens(annotation) else None
    if not isinstance(annotation, str):
        return None
    names = [part.strip() for part in annotation.split("|") if part.strip() not in ("None", "")]
    if not names or not all(re.fullmatch(r"[\w.]+", n) for n in names):
        return None
    found = [_resolve_annotation_name(n, target) for n in names]
    if not all(isinstance(f, type) and _is_jlens(f) for f in found):
        return None
    return found[0] if len(found) == 1 else tuple(found)


def _pick(classes: Any, name: str) -> type | None:
    """The first of ``classes`` (a class or a tuple of them) whose instances have ``name``, else ``None``."""
    for cls in classes if isinstance(classes, tuple) else (classes,):
        if _has_attribute(cls, name):
            return cls
    return None


def _names(classes: Any) -> str:
    return " | ".join(c.__name__ for c in (classes if isinstance(classes, tuple) else (classes,)))


def _has_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute, a dataclass field, an annotation, or an
    assignment ``self.name = ...`` in the source of the class or a base."""
    if hasattr(cls, name):
        return True
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        if dataclasses.is_dataclass(klass) and name in {f.name for f in dataclasses.fields(klass)}:
            return True
        if _is_jlens(klass):
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=", source):
                return True
    return False


def typed_keywords(func: Any, sig: inspect.Signature) -> set[str] | None:
    """The keywords a ``**keywords: Unpack[SomeTypedDict]`` parameter takes (the TypedDict's keys), or ``None``
    when ``func`` has no such parameter (a plain ``**kwargs`` takes anything)."""
    for param in sig.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            match = re.fullmatch(r"Unpack\[([\w.]+)\]", str(param.annotation).strip("'\""))
            if not match:
                return None
            typed = _resolve_annotation_name(match.group(1), func)
            keys = set(getattr(typed, "__annotations__", {}))
            return keys or None
    return None


def _bind(func: Any, call: ast.Call, what: str, drop_first: bool = False) -> str | None:
    """``None`` when ``call``'s arguments bind to ``func``'s signature, else the reason. A ``**keywords:
    Unpack[TypedDict]`` parameter takes only the TypedDict's keys."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    if drop_first:
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    typed = typed_keywords(func, sig)
    if typed is not None:
        named = {p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        unknown = [k.arg for k in call.keywords if k.arg is not None and k.arg not in named | typed]
        if unknown:
            return f"{what} has no parameter {unknown[0]!r} (nor a keyword of its **keywords)"
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    double = any(k.arg is None for k in call.keywords)
    keywords = [k.arg for k in call.keywords if k.arg is not None]
    if starred or double:
        takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        names = {p.name for p in sig.parameters.values() if p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)}
        unknown = [k for k in keywords if k not in names and not takes_any]
        return f"{what} has no parameter {unknown[0]!r}" if unknown else None
    try:
        sig.bind(*range(len(call.args)), **{k: None for k in keywords})
    except TypeError as exc:
        return f"{what}{sig}: {exc}"
    return None


class _CallChecker(ast.NodeVisitor):
    """Walks a page's blocks in order, knowing which names are jlens objects and which variables hold
    instances of jlens classes, and reports calls that do not bind and attributes that do not exist."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}    # name -> the jlens module, class or function it is bound to
        self.instances: dict[str, Any] = {}  # variable -> the jlens class (or classes) of its value
        self.problems: list[tuple[int, str]] = []

    # imports
    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.split(".")[0] == "jlens_core" and node.level == 0:
            for alias in node.names:
                obj = _import(node.module, alias.name)
                if obj is _UNKNOWN:
                    self.problems.append((node.lineno, f"{node.module} has no name {alias.name!r}"))
                else:
                    self.objects[alias.asname or alias.name] = obj

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "jlens_core":
                module = importlib.import_module(alias.name)
                self.objects[alias.asname or alias.name.split(".")[0]] = (
                    module if alias.asname else importlib.import_module("jlens_core"))

    # what a call or expression gives
    def value_of(self, node: ast.AST) -> tuple[Any, Any]:
        """(the jlens object an expression names, the jlens class of the value it computes)."""
        if isinstance(node, ast.Name):
            if node.id in self.objects:
                return self.objects[node.id], None
            return None, self.instances.get(node.id)
        if isinstance(node, ast.Attribute):
            obj, cls = self.value_of(node.value)
            if obj is not None:
                attr = getattr(obj, node.attr, _UNKNOWN)
                if attr is _UNKNOWN and inspect.ismodule(obj):
                    attr = _import(obj.__name__, node.attr)
                if attr is _UNKNOWN:
                    self.problems.append((node.lineno, f"{getattr(obj, '__name__', obj)} has no attribute {node.attr!r}"))
                    return None, None
                return (attr, None) if _is_jlens(attr) or inspect.isclass(obj) else (None, None)
            if cls is not None:
                owner = _pick(cls, node.attr)
                if owner is None:
                    self.problems.append((node.lineno, f"{_names(cls)} has no attribute {node.attr!r}"))
                    return None, None
                attr = inspect.getattr_static(owner, node.attr, None)
                if isinstance(attr, property):
                    return None, _return_class(attr)
                return None, None
            return None, None
        if isinstance(node, ast.Call):
            return None, self.check_call(node)
        return None, None

    def check_call(self, node: ast.Call) -> Any:
        """Check one call; the jlens class it returns, if known."""
        for arg in [*node.args, *[k.value for k in node.keywords]]:
            self.visit(arg)
        func = node.func
        if isinstance(func, ast.Attribute):
            obj, cls = self.value_of(func.value)
            if obj is not None:
                target = getattr(obj, func.attr, _UNKNOWN)
                if target is _UNKNOWN:
                    if inspect.ismodule(obj) and _import(obj.__name__, func.attr) is not _UNKNOWN:
                        return None
                    self.problems.append((node.lineno, f"{getattr(obj, '__name__', obj)} has no attribute {func.attr!r}"))
                    return None
                what = f"{getattr(obj, '__name__', obj)}.{func.attr}"
            elif cls is not None:
                owner = _pick(cls, func.attr)
                if owner is None:
                    self.problems.append((node.lineno, f"{_names(cls)} has no attribute {func.attr!r}"))
                    return None
                cls = owner
                static = inspect.getattr_static(cls, func.attr, None)
                if not inspect.isfunction(static):
                    target = getattr(cls, func.attr, None)  # a classmethod or staticmethod binds as called
                    if not callable(target) or isinstance(static, property):
                        return None
                    problem = _bind(target, node, f"{cls.__name__}.{func.attr}")
                else:
                    target = static
                    problem = _bind(static, node, f"{cls.__name__}.{func.attr}", drop_first=True)
                if problem:
                    self.problems.append((node.lineno, problem))
                ret = _return_class(target)
                return cls if ret is None and func.attr.startswith("with_") else ret
            else:
                self.generic_visit(func)
                return None
        elif isinstance(func, ast.Name) and func.id in self.objects:
            target, what = self.objects[func.id], func.id
        else:
            self.visit(func)
            return None
        if not _is_jlens(target) or not callable(target):
            return None
        if inspect.isclass(target):
            problem = _bind(target, node, what)
            if problem:
                self.problems.append((node.lineno, problem))
            return target
        problem = _bind(target, node, what)
        if problem:
            self.problems.append((node.lineno, problem))
        return _return_class(target)

    # statements
    def visit_Assign(self, node: ast.Assign) -> None:
        _, cls = self.value_of(node.value)
        for target in node.targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    self.instances.pop(name.id, None)
                    self.objects.pop(name.id, None)
            if isinstance(target, ast.Name) and cls is not None:
                self.instances[target.id] = cls

    def visit_Call(self, node: ast.Call) -> None:
        self.check_call(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.value_of(node)


def call_problems(blocks: list[Block]) -> list[str]:
    """``"page:line: reason"`` for every call of a jlens name in the page's python blocks that does not bind
    to its signature, and every missing jlens name, method or attribute."""
    checker = _CallChecker()
    bad = []
    for block in blocks:
        checker.problems = []
        try:
            tree = ast.parse(block.text)
        except SyntaxError:
            continue  # reported by undefined_names
        for statement in tree.body:
            checker.visit(statement)
        bad += [f"{block.page.name}:{block.line + line - 1}: {reason}" for line, reason in checker.problems]
    return bad


# -- signatures written inline in the prose ---------------------------------------------------------

INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")
SIGNATURE = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)(?:\s*->\s*(.+))?$", re.DOTALL)


def _public(name: str) -> Any:
    """``name`` or ``Class.method`` of ``jlens_core``'s front door; ``None`` when it is not one."""
    import jlens_core

    head, _, attr = name.partition(".")
    if head not in jlens_core.__all__:
        return None
    obj = getattr(jlens_core, head)
    if attr:
        obj = getattr(obj, attr, _UNKNOWN)
    return obj


def signature_problems(text: str) -> list[str]:
    """Inline spans of prose that show a public name called or declared: `` `read_prompt(model, lens, text)` ``,
    `` `fit(model, prompts, *, experts=0, ...) -> JacobianLens | ExpertLens` ``. A call must bind to the real
    signature; a declaration (it has ``*``, annotations or ``...``) must name real parameters of the right kind
    (positional before ``*``, keyword-only after), every parameter unless it ends with ``...``, and the real
    return type when it shows one."""
    outside_code = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    bad = []
    for span in INLINE_CODE.findall(outside_code):
        span = re.sub(r"\s+", " ", span).strip()
        match = SIGNATURE.match(span)
        if not match:
            continue
        name, params, returns = match.groups()
        obj = _public(name)
        if obj is None:
            continue
        if obj is _UNKNOWN:
            bad.append(f"`{span}`: {name} does not exist")
            continue
        try:
            real = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        real_params = {n: p for n, p in real.parameters.items() if n not in ("self", "cls")}
        if not inspect.isclass(obj) and "." in name and isinstance(inspect.getattr_static(
                _public(name.split(".")[0]), name.split(".")[1], None), type(lambda: 0)):
            real_params = dict(list(real_params.items())[1:]) if list(real.parameters)[:1] == ["self"] else real_params
        elided = params.strip().startswith("...")  # `fit(..., rules="relevance")`: some keywords of a call
        try:
            call = ast.parse(f"{name}({params.strip()[3:].lstrip(',') if elided else params})", mode="eval").body
        except SyntaxError:
            call = None
        declared = not elided and ("*" in params or ":" in params or returns
                                    or re.search(r"(^|,)\s*\.\.\.\s*(,|$)", params))
        if isinstance(call, ast.Call) and not declared:
            typed = typed_keywords(obj, real) or set()
            unknown = [k.arg for k in call.keywords if k.arg and k.arg not in real_params and k.arg not in typed]
            if unknown and (typed or not any(p.kind is p.VAR_KEYWORD for p in real_params.values())):
                bad.append(f"`{span}`: {name} has no parameter {unknown[0]!r}")
            elif not elided:
                try:
                    real.bind_partial(*range(len(call.args)), **{k.arg: None for k in call.keywords if k.arg})
                except TypeError as exc:
                    bad.append(f"`{span}`: {name}: {exc}")
            continue
        open_ended = bool(re.search(r"(^|,)\s*\.\.\.\s*$", params))
        cleaned = re.sub(r"(^|,)\s*\.\.\.\s*(?=,|$)", r"\1", params).strip().strip(",")
        cleaned = re.sub(r"=\s*\.\.\.", "=None", cleaned)
        cleaned = re.sub(r'"[^"]*"(\s*\|\s*"[^"]*")+', '""', cleaned)  # dtype="float32" | "float16"
        try:
            tree = ast.parse(f"def _f({cleaned}): pass").body[0]
        except SyntaxError:
            continue
        args = tree.args
        shown = [(a.arg, "positional") for a in [*args.posonlyargs, *args.args]]
        shown += [(a.arg, "keyword") for a in args.kwonlyargs]
        for param, kind in shown:
            if param not in real_params:
                bad.append(f"`{span}`: {name} has no parameter {param!r}")
            elif kind == "positional" and real_params[param].kind is inspect.Parameter.KEYWORD_ONLY:
                bad.append(f"`{span}`: {param!r} of {name} is keyword-only (after `*`)")
            elif kind == "keyword" and real_params[param].kind is not inspect.Parameter.KEYWORD_ONLY:
                bad.append(f"`{span}`: {param!r} of {name} is not keyword-only")
        if not open_ended:
            listed = {p for p, _ in shown}
            missing = [n for n, p in real_params.items()
                       if n not in listed and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if missing:
                bad.append(f"`{span}`: {name} also takes {', '.join(missing)} (list them or end with `...`)")
        if returns:
            want = {r.strip() for r in returns.split("|")}
            annotation = real.return_annotation
            have = {r.strip().split(".")[-1] for r in str(annotation).split("|")} if annotation is not \
                inspect.Signature.empty else set()
            if inspect.isclass(obj):
                have = {obj.__name__}
            if want != have:
                bad.append(f"`{span}`: {name} returns {' | '.join(sorted(have))}")
    return bad


def dotted_problems(text: str) -> list[str]:
    """Inline spans naming a dotted jlens path (`` `jlens_core.reading.passk.macro_mean` ``) or a file of the
    package (`` `jlens_core/fitting/fused.py` ``) that no longer exists (a module moved or a name renamed)."""
    bad = []
    outside_code = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for span in INLINE_CODE.findall(outside_code):
        span = span.strip()
        if re.fullmatch(r"jlens_core(/[\w]+)+\.py", span):
            if not (ROOT / span).is_file():
                bad.append(f"`{span}`: no such file")
            continue
        match = re.fullmatch(r"(jlens_core(?:\.\w+)+)(?:\(.*\))?", span, flags=re.DOTALL)
        if not match:
            continue
        parts = match.group(1).split(".")
        obj: Any = None
        for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                continue
            forwards = getattr(obj, "__getattr__", None)
            if "moved_module" in getattr(forwards, "__qualname__", ""):  # an old path that warns and forwards
                bad.append(f"`{span}`: {'.'.join(parts[:i])} is a deprecated path (name the module it moved to)")
                obj = True
                break
            for attr in parts[i:]:
                obj = getattr(obj, attr, _UNKNOWN)
                if obj is _UNKNOWN:
                    break
            break
        if obj is None or obj is _UNKNOWN:
            bad.append(f"`{span}`: {match.group(1)} does not exist")
    return bad


# -- command lines ---------------------------------------------------------------------------------

SHELL_BREAKS = {"|", "||", "&&", ";", "&", ";;"}
REDIRECTS = {">", ">>", "<", "2>", "2>&1", "&>", ">&"}


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments and prompts (``$ ``)
    dropped, split at pipes, ``&&``, ``;``, with redirections removed."""
    joined = re.sub(r"\\\n", " ", text)
    commands = []
    for line in joined.splitlines():
        line = re.sub(r"^\s*\$\s+", "", line)
        line = re.sub(r"(?<=\s)\d?>&\d\b", " ", line)  # 2>&1
        line = re.sub(r"(?<=\s)\d(?=>)", " ", line)  # the 2 of 2> FILE
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:
            continue
        current: list[str] = []
        skip_next = False
        for token in tokens:
            if skip_next:
                skip_next = False
                continue
            if token in SHELL_BREAKS:
                if current:
                    commands.append(current)
                current = []
            elif token in REDIRECTS or re.fullmatch(r"\d?[<>]+&?\d?", token):
                skip_next = not token.endswith(("&1", "&2"))
            else:
                current.append(token)
        if current:
            commands.append(current)
    return commands


def jlens_argv(command: list[str]) -> list[str] | None:
    """The arguments after ``jlens`` (or ``python -m jlens_core``, ``torchrun ... -m jlens_core``,
    ``.venv/bin/jlens``) in a shell command; ``None`` when the command does not run jlens."""
    words = list(command)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words.pop(0)
    if words and words[0] in ("srun", "nice", "time", "exec"):
        words = words[1:]
    if words and Path(words[0]).name == "jlens":
        return words[1:]
    if "-m" in words:
        i = words.index("-m")
        if i + 1 < len(words) and words[i + 1] == "jlens_core" and Path(words[0]).name.startswith(("python", "torchrun")):
            return words[i + 2:]
    return None


def parse_error(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """``None`` when the real parser accepts ``argv``, else its error message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flag_problems(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """For a partial command line (placeholders such as ``...`` or ``TEXT``): the subcommand exists and every
    ``--flag`` is one of its options."""
    subs = _subparsers(parser)
    top = {s for a in parser._actions for s in a.option_strings}
    rest = list(words)
    while rest and rest[0] in top:
        rest = rest[1:]
    if not rest or not re.fullmatch(r"[a-z]+", rest[0]):
        return []  # `jlens COMMAND --help`, `jlens ...`
    if rest[0] not in subs:
        return [f"no subcommand {rest[0]!r}"]
    flags = {s for a in subs[rest[0]]._actions for s in a.option_strings}
    bad = []
    for word in rest[1:]:
        if word == "--":
            break
        flag = word.split("=")[0]
        if re.fullmatch(r"--[a-z][a-z0-9-]*", flag) and flag not in flags:
            bad.append(f"{rest[0]} has no option {flag}")
    return bad


def inline_problems(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """Inline `` `jlens SUB --flag ...` `` spans name a real subcommand and real flags of it."""
    outside_code = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return [f"`{span}`: {problem}" for span in INLINE_JLENS.findall(outside_code)
            for problem in flag_problems(parser, span.split()[1:])]


def command_problems(parser: argparse.ArgumentParser, page: Path, text: str | None = None) -> list[str]:
    """Every ``jlens`` command line of a page's shell blocks that the parser refuses, and every inline span
    with a subcommand or flag that does not exist."""
    text = page.read_text(encoding="utf-8") if text is None else text
    bad = []
    for block in code_blocks(page, text):
        if block.lang not in SHELL_LANGS:
            continue
        for command in shell_commands(block.text):
            argv = jlens_argv(command)
            if argv is None:
                continue
            if "..." in argv:  # a partial line: the subcommand and the flags exist
                bad += [f"{block.where}: jlens {' '.join(argv)}: {p}" for p in flag_problems(parser, argv)]
                continue
            error = parse_error(parser, argv)
            if error:
                bad.append(f"{block.where}: jlens {' '.join(argv)}: {error}")
    return bad + [f"{page.name}: {p}" for p in inline_problems(parser, text)]


def strict_parser() -> argparse.ArgumentParser:
    """The real ``jlens`` parser with abbreviations off: the docs spell every option in full."""
    from jlens_core.cli.main import build_parser

    parser = build_parser()
    for each in [parser, *_subparsers(parser).values()]:
        each.allow_abbrev = False
    return parser


# -- the fast tests --------------------------------------------------------------------------------

PAGES = doc_pages()
PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]


@pytest.fixture(scope="module")
def parser():
    return strict_parser()


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_python_blocks_use_only_defined_names(page):
    assert undefined_names(python_blocks(page)) == []


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_python_blocks_call_real_signatures(page):
    assert call_problems(python_blocks(page)) == []


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_signatures_in_the_prose_are_the_real_ones(page):
    assert signature_problems(page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_module_paths_in_the_prose_exist(page):
    assert dotted_problems(page.read_text(encoding="utf-8")) == []


def test_a_moved_module_path_fails():
    text = ("`jlens_core.evaluation.passk.pass_at_k` `jlens_core.fitting` `jlens_core/fitting/fit.py`\n"
            "`jlens_core.reading.no_such_module` `jlens_core.evaluation.passk.no_such_name(x)` `jlens_core/gone.py`")
    assert [p.split(":")[0] for p in dotted_problems(text)] == [
        "`jlens_core.reading.no_such_module`", "`jlens_core.evaluation.passk.no_such_name(x)`", "`jlens_core/gone.py`"]


def test_a_wrong_signature_in_the_prose_fails():
    text = ("`read_prompt(model, lens, prompt, *, layers=None, ...)` and `fit(model, prompts, *, layers=None, ...)`\n"
            "`JacobianLens.load(path, model=None)` is a call that binds; `JacobianLens.load(path, model=None, *, x=1)`;\n"
            "`load_corpus(spec, *, n=None)` `fit(model, prompts, ...) -> JacobianLens` `default_lens(model, rules=2)`\n"
            "`read_prompt(model, lens, text, *, layers=None, ...)` `load_corpus(spec, *, n=None, min_chars=400, split=None,\n"
            "field='text')` `no_such_function(x)`")
    problems = signature_problems(text)
    assert len(problems) == 7, problems
    assert "read_prompt has no parameter 'prompt'" in problems[0]
    assert "fit has no parameter 'layers'" in problems[1]
    assert "'model' of JacobianLens.load is keyword-only" in problems[2]
    assert "JacobianLens.load has no parameter 'x'" in problems[3]
    assert "load_corpus also takes min_chars, split, field" in problems[4]
    assert "fit returns ExpertLens | JacobianLens" in problems[5]
    assert "default_lens" in problems[6] and "rules" in problems[6]


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_jlens_command_lines_parse(page, parser):
    assert command_problems(parser, page) == []


def test_the_docs_hold_python_blocks_and_command_lines():
    """The checks above look at something: the pages have python blocks and jlens command lines."""
    n_python = sum(len(python_blocks(p)) for p in PAGES)
    n_commands = sum(1 for p in PAGES for b in code_blocks(p) if b.lang in SHELL_LANGS
                     for c in shell_commands(b.text) if jlens_argv(c) is not None)
    assert n_python >= 15 and n_commands >= 20


def test_every_replace_directive_matches_its_block():
    problems = []
    for page in PAGES:
        for block in python_blocks(page):
            try:
                block.runnable_text()
            except ValueError as exc:
                problems.append(str(exc))
    assert problems == []


# -- the checks catch what they are for (negative cases) --------------------------------------------

PAGE = """# A page

```python
from jlens_core import load_model, read_prompt, default_lens, fit
model = load_model()
lens = default_lens(model)
r = read_prompt(model, lens, "Paris is", topk=5)
fit(model, ["a text"], max_seq_len=64, max_seq_lenn=64)
r.grid("kl_bits")
r.no_such_method()
```

<!-- doctest: replace 'n=20' 'n=1' -->
```python
reading = read_prompt(model, lens, text="x")
print(undefined_thing)
from jlens_core import no_such_name
```
"""


def test_a_renamed_keyword_a_missing_method_and_an_undefined_name_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    blocks = python_blocks(page)
    assert [b.replace for b in blocks] == [[], [("n=20", "n=1")]]
    calls = call_problems(blocks)
    assert len(calls) == 4, calls
    assert "read_prompt" in calls[0] and "'topk'" in calls[0] and calls[0].startswith("page.md:7:")
    assert "fit has no parameter 'max_seq_lenn'" in calls[1] and calls[1].startswith("page.md:8:")  # **keywords
    assert "PromptReading has no attribute 'no_such_method'" in calls[2] and calls[2].startswith("page.md:10:")
    assert "no name 'no_such_name'" in calls[3]
    names = undefined_names(blocks)
    assert len(names) == 1 and "undefined_thing" in names[0] and names[0].endswith(
        "F821 Undefined name `undefined_thing`") and ":16:" in names[0]
    with pytest.raises(ValueError, match="matches nothing"):
        blocks[1].runnable_text()


def test_the_real_keywords_pass(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE.split("<!--")[0].replace("topk=5", "top_k=5").replace("r.no_such_method()\n", "")
                    .replace("max_seq_lenn", "dim_batch"))
    assert call_problems(python_blocks(page)) == []
    assert undefined_names(python_blocks(page)) == []


def test_unknown_directives_are_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- doctest: skip-it because -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown doctest directive 'skip-it'"):
        python_blocks(page)
    page.write_text("<!-- doctest: skip-run needs a GPU -->\n```python\nx = 1\n```\n")
    assert python_blocks(page)[0].skip_run == "needs a GPU"


def test_bad_command_lines_are_reported(tmp_path, parser):
    page = tmp_path / "page.md"
    page.write_text("Run `jlens fit --n-prompts 2` or `jlens fitt --x` or `jlens inspect --promt X`.\n\n"
                    "```bash\n$ jlens inspect --lens default --prompt 'a b' --format csv > grid.csv\n"
                    "jlens fit --model smollm2-135m \\\n    --n-prompt 2 --out x  # a comment\n"
                    "echo jlens eval && .venv/bin/jlens eval --lens logit --pass-at-k two_hop --out e | head\n"
                    "python -m jlens_core inspect --no-such-flag\njlens fit ... --ruls relevance\n```\n")
    problems = command_problems(parser, page)
    assert len(problems) == 5, problems
    assert "jlens fit --model smollm2-135m --n-prompt 2 --out x" in problems[0] and "--n-prompt" in problems[0]
    assert "--no-such-flag" in problems[1]
    assert "fit has no option --ruls" in problems[2]
    assert "no subcommand 'fitt'" in problems[3] and "inspect has no option --promt" in problems[4]


def test_shell_commands_split_pipes_redirections_and_prompts():
    text = "$ FOO=1 jlens inspect --prompt \"a | b\" 2>&1 | jq . > out.json && echo done # c\n"
    assert shell_commands(text) == [["FOO=1", "jlens", "inspect", "--prompt", "a | b"], ["jq", "."],
                                    ["echo", "done"]]
    assert jlens_argv(["FOO=1", "jlens", "inspect"]) == ["inspect"]
    assert jlens_argv(["torchrun", "--nproc-per-node", "8", "-m", "jlens_core", "fit"]) == ["fit"]
    assert jlens_argv(["echo", "jlens"]) is None


# -- running the blocks (slow) ----------------------------------------------------------------------

RUN_PAGES = [p for p in PAGES if any(not b.skip_run for b in python_blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_python_blocks_run(page, tmp_path, monkeypatch):
    """The page's blocks run in order in one namespace, in an empty folder, on the default model."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict[str, Any] = {"__name__": "__doc_example__"}
    started = time.perf_counter()
    for block in python_blocks(page):
        if block.skip_run:
            continue
        code = compile(block.runnable_text(), block.where, "exec")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(code, namespace)  # noqa: S102 - the documentation's own examples
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"{block.where}: {type(exc).__name__}: {exc}")
    print(f"{page.name}: {time.perf_counter() - started:.1f} s")
    assert os.getcwd() == str(tmp_path)


def test_every_lens_option_names_every_form(parser):
    """``--lens`` of eval, inspect and intervene names the forms that work: shipped variants and the Hub."""
    subs = _subparsers(parser)
    for command in ("eval", "inspect", "intervene"):
        (action,) = [a for a in subs[command]._actions if "--lens" in a.option_strings]
        for form in ("'default'", "'logit'", "'tuned'", "smollm2-135m:relevance", "smollm2-135m:jpp", "hf://",
                     "tuned-lens folder"):
            assert form in action.help, (command, form)


def test_a_deprecated_module_path_fails():
    import types

    from jlens_core import _deprecated

    shim = types.ModuleType("jlens_core._doc_test_old_path")
    shim.__getattr__, shim.__dir__ = _deprecated.moved_module(shim.__name__, "jlens_core.corpus", removed_in="9.9")
    sys.modules[shim.__name__] = shim
    try:
        problems = dotted_problems("`jlens_core._doc_test_old_path.load_corpus` `jlens_core.corpus.load_corpus`")
    finally:
        del sys.modules[shim.__name__]
    assert len(problems) == 1 and "is a deprecated path" in problems[0]
