"""The library type-checks: mypy (pyproject's [tool.mypy]: default checks on jlens_core) reports nothing.

Slow: a run without mypy's cache takes about a minute on two cores (a few seconds with it).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (it is in the dev extras: pip install -e '.[dev]')")
def test_jlens_core_passes_mypy():
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"mypy found problems in jlens_core:\n{done.stdout}\n{done.stderr}"
