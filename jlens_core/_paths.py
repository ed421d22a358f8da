"""Where the files that travel with jlens live (a leaf module: imports nothing from jlens_core).

In a source checkout, ``assets/`` and ``app/`` sit next to the package folder. In an installed wheel
they are the package-data packages ``jlens_assets`` and ``jlens_app`` (``pyproject.toml`` maps the
two folders to them), found through ``importlib``. The checkout wins where both exist.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent


def _installed(package: str) -> Path | None:
    """The folder of an installed (package-data) package, or ``None``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def _locate(folder: str, package: str, marker: str) -> Path:
    local = REPO_DIR / folder
    if (local / marker).exists():
        return local
    return _installed(package) or local


ASSETS_DIR = _locate("assets", "jlens_assets", "evaluations")
APP_DIR = _locate("app", "jlens_app", "main.py")
