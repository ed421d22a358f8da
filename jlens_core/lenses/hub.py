"""Lenses from the Hugging Face Hub: ``hf://owner/repo[@revision]/path/in/repo.pt``.

Released Jacobian lenses (e.g. Neuronpedia's, in the reference jlens's ``.pt`` format) and jlens
or tuned-lens files live in Hub repositories. :func:`hub_lens_file` finds one through
``huggingface_hub``: its cache first (``HF_HUB_CACHE`` / ``HF_HOME``), the Hub only when reachable
and allowed (``HF_HUB_OFFLINE=1`` keeps it to the cache). When the file cannot be had, one sentence
says what was tried.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

LENS_SUFFIXES = (".pt", ".safetensors")
_SPEC = re.compile(r"hf://(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>[^/]+))?(?:/(?P<path>.+))?")


def is_hub_spec(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith("hf://")


def parse_hub_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``(repo_id, revision, path in repo)`` of ``hf://owner/repo[@revision][/path]``.

    Raises:
        ValueError: not of that form.
    """
    match = _SPEC.fullmatch(spec.strip())
    if not match:
        raise ValueError(f"{spec!r} is not a Hub lens spec: write hf://owner/repo[@revision]/path/in/repo.pt.")
    return match["repo"], match["rev"], match["path"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_lens_file(repo_id: str, filename: str | None = None, revision: str | None = None) -> Path:
    """The local path of a lens file in a Hub repository (downloaded into the cache if needed).

    Args:
        repo_id: ``owner/repo``.
        filename: the file's path in the repo; ``None``: the repo's only ``.pt`` / ``.safetensors`` file.
        revision: a branch, tag or commit (default ``main``).

    Raises:
        FileNotFoundError: the file (or repo, or revision) is neither in the cache nor reachable; the
            message names what was tried. ``None`` with several lens files in the repo lists them.
    """
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    offline = _offline()
    where = f"{repo_id}@{revision or 'main'}" + (f"/{filename}" if filename else "")
    tried = f"the Hugging Face cache ({HF_HUB_CACHE})" + ("" if offline else " and the Hub")
    try:
        if filename is not None:
            return Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=offline))
        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=offline,
                                        allow_patterns=[f"*{s}" for s in LENS_SUFFIXES]))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub raises many kinds: all mean "not available"
        hint = " (HF_HUB_OFFLINE is set: only the cache was searched)" if offline else ""
        raise FileNotFoundError(f"Could not get the lens {where}: tried {tried}{hint}; {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else 'not found'}. Download it and give "
                                "its path, or check the repo, file and revision.") from None
    found = sorted(p for p in folder.rglob("*") if p.suffix in LENS_SUFFIXES and p.is_file())
    if len(found) != 1:
        names = [str(p.relative_to(folder)) for p in found]
        raise FileNotFoundError(f"The repo {where} holds {len(found)} lens files{': ' + ', '.join(names) if names else ''}"
                                "; name one: hf://owner/repo[@revision]/path/in/repo.pt.")
    return found[0]


def resolve_lens_path(spec: str | os.PathLike) -> Path:
    """A lens spec as a local path: ``hf://...`` through the Hub cache, anything else as given."""
    if is_hub_spec(spec):
        repo, revision, path = parse_hub_spec(str(spec))
        return hub_lens_file(repo, path, revision)
    return Path(spec).expanduser()


__all__ = ["hub_lens_file", "is_hub_spec", "parse_hub_spec", "resolve_lens_path"]
