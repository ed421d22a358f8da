"""Where the files that travel with jlens live (a leaf module: imports nothing from jlens_core).

In a checkout, ``assets/`` and ``app/`` sit next to the package folder.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
ASSETS_DIR = REPO_DIR / "assets"
APP_DIR = REPO_DIR / "app"
