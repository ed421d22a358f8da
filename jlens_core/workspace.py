"""Confining server-side paths to a workspace folder (what ``jlens app`` lets a visitor name).

A visitor of the app types paths into text boxes (corpus, checkpoint, lens, tuned lens, model
folder, dump folders, ...). Each one goes through :meth:`Workspace.confine` before anything is
read or written: the path is made absolute (a relative one against the workspace), ``~``, ``..``
and symbolic links are resolved, and a result outside every allowed root is refused with one
sentence (:class:`OutsideWorkspaceError`). Hub specs (``hf://...``) and model or dataset ids are
not paths and pass through :meth:`Workspace.confine_spec` unchanged. See ``docs/security.md``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ENV_WORKSPACE = "JLENS_APP_WORKSPACE"  # the workspace folder (default: ./runs)
ENV_ALLOW_ANY_PATH = "JLENS_APP_ALLOW_ANY_PATH"  # "1": no confinement
ENV_EXTRA_PATHS = "JLENS_APP_ALLOWED_PATHS"  # os.pathsep-separated paths the operator named (--model, --lens)
DEFAULT_WORKSPACE = "runs"
# Suffixes that make a spec a file path even without a slash (``lens.safetensors``, ``corpus.txt``).
PATH_SUFFIXES = (".safetensors", ".pt", ".ckpt", ".gguf", ".txt", ".jsonl", ".json", ".bin")
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


class OutsideWorkspaceError(ValueError):
    """A path that resolves outside the workspace (a ``ValueError``: bad input, shown as its sentence)."""


def looks_like_path(spec: str, base: str | os.PathLike | None = None) -> bool:
    """Whether a model, corpus or lens spec names a local path rather than an id or a Hub spec.

    ``hf://...`` and ids such as ``smollm2-135m`` or ``owner/repo`` are not paths. Absolute paths,
    ``~``, ``./`` and ``../`` prefixes, a file suffix from :data:`PATH_SUFFIXES`, and any spec that
    exists on disk relative to ``base`` (default the current folder) or the current folder are.
    """
    text = str(spec).strip()
    if not text or text.startswith("hf://"):
        return False
    if text.startswith(("/", "~", "./", "../", "\\")) or text in (".", "..") or re.match(r"^[A-Za-z]:[\\/]", text):
        return True
    if text.lower().endswith(PATH_SUFFIXES) or ".." in Path(text).parts:
        return True
    return os.path.lexists(text) or (base is not None and os.path.lexists(Path(base) / text))


def sanitise_filename(name: str, default: str = "file") -> str:
    """A file name safe to create in a folder: the last component of ``name``, letters, digits, ``._-`` only.

    ``"../../etc/passwd"`` -> ``"passwd"``; ``"my corpus (1).txt"`` -> ``"my-corpus-1-.txt"``; leading dots
    are dropped (no hidden files, no ``..``); an empty result is ``default``.
    """
    base = re.split(r"[\\/]", str(name))[-1]
    clean = _UNSAFE_NAME.sub("-", base).lstrip(".-")[:120]
    return clean or default


@dataclass(frozen=True)
class Workspace:
    """The folders a visitor's paths may resolve into.

    Attributes:
        root: the workspace folder (relative paths are taken against it).
        extra_roots: further allowed folders (the package's shipped assets, a runs folder the operator set).
        extra_paths: single files or folders the operator named on the command line (``--model``, ``--lens``).
        allow_any: ``True`` lifts the confinement (``jlens app --allow-any-path``).
    """

    root: Path
    extra_roots: tuple[Path, ...] = ()
    extra_paths: tuple[Path, ...] = ()
    allow_any: bool = False
    _resolved: tuple[Path, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        roots = tuple(Path(r).expanduser().resolve() for r in (self.root, *self.extra_roots))
        object.__setattr__(self, "root", Path(self.root).expanduser().resolve())
        object.__setattr__(self, "_resolved", roots)
        object.__setattr__(self, "extra_paths", tuple(Path(p).expanduser().resolve() for p in self.extra_paths))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, extra_roots: Iterable[os.PathLike | str] = ()) -> Workspace:
        """The workspace ``jlens app`` configured through the environment of the server process.

        ``JLENS_APP_WORKSPACE`` (default ``./runs``), ``JLENS_APP_ALLOW_ANY_PATH=1`` and
        ``JLENS_APP_ALLOWED_PATHS`` (operator-named paths, ``os.pathsep``-separated).
        """
        env = os.environ if env is None else env
        root = Path(env.get(ENV_WORKSPACE) or DEFAULT_WORKSPACE)
        extra = tuple(Path(p) for p in (env.get(ENV_EXTRA_PATHS) or "").split(os.pathsep) if p)
        return cls(root=root, extra_roots=tuple(Path(r) for r in extra_roots), extra_paths=extra,
                   allow_any=env.get(ENV_ALLOW_ANY_PATH, "") in ("1", "true", "yes"))

    def resolve(self, path: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
        """``path`` made absolute (relative: against ``base``, default the workspace), ``~``, ``..`` and links resolved."""
        candidate = Path(path).expanduser()
        if not candidate.is_absolute():
            candidate = Path(base).expanduser() / candidate if base is not None else self.root / candidate
        return candidate.resolve()

    def contains(self, resolved: Path) -> bool:
        """Whether an already resolved path lies under an allowed root or is an operator-named path."""
        if any(resolved == p or resolved.is_relative_to(p) for p in self.extra_paths if p.is_dir()):
            return True
        if resolved in self.extra_paths:
            return True
        return any(resolved == root or resolved.is_relative_to(root) for root in self._resolved)

    def confine(self, path: str | os.PathLike, what: str = "path", base: str | os.PathLike | None = None) -> Path:
        """The resolved absolute path, when it lies in the workspace; nothing is read or written here.

        Args:
            path: what the visitor typed.
            what: the input's name for the error sentence ("checkpoint", "lens file", ...).
            base: the folder a relative path is taken against (default the workspace).

        Raises:
            OutsideWorkspaceError: the resolved path is outside every allowed root.
        """
        resolved = self.resolve(path, base)
        if self.allow_any or self.contains(resolved):
            return resolved
        raise OutsideWorkspaceError(
            f"The {what} {str(path)!r} resolves to {str(resolved)!r}, outside the workspace {str(self.root)!r}: "
            f"put it under the workspace, or start `jlens app --workspace DIR` (or `--allow-any-path`).")

    def confine_spec(self, spec: str, what: str = "path") -> str:
        """A model, corpus or lens spec: a path (:func:`looks_like_path`) confined and made absolute, else unchanged.

        Relative path specs are taken against the workspace, like every other path.

        Raises:
            OutsideWorkspaceError: a path spec outside the workspace.
        """
        text = str(spec).strip()
        if not looks_like_path(text, self.root):
            return text
        return str(self.confine(text, what))


__all__ = ["DEFAULT_WORKSPACE", "ENV_ALLOW_ANY_PATH", "ENV_EXTRA_PATHS", "ENV_WORKSPACE", "OutsideWorkspaceError",
           "Workspace", "looks_like_path", "sanitise_filename"]
