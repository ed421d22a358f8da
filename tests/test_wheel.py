"""A built wheel works when installed (not editable): ``jlens inspect --lens default`` and ``jlens app``
find the shipped lens, the evaluation sets and the app through the package data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib
from conftest import free_port, stop, wait_serving

REPO = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_in_the_wheel_list():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.relative_to(REPO).parent.parts) for p in (REPO / "jlens_core").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject's packages: {sorted(found - listed)}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this tree, installed into a fresh venv whose other dependencies come from ours."""
    tmp = tmp_path_factory.mktemp("wheel")
    try:
        import setuptools

        isolation = [] if int(setuptools.__version__.split(".")[0]) >= 77 else None
    except ImportError:
        isolation = None
    build = [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(tmp / "dist")]
    build += ["--no-build-isolation"] if isolation is not None else []  # else pip fetches setuptools from the index
    subprocess.run(build, check=True, cwd=tmp, capture_output=True, timeout=600)
    (wheel,) = (tmp / "dist").glob("jlens-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # torch, transformers, streamlit, ... from our environment; a path in a .pth file is not itself scanned for
    # .pth files, so our editable install of jlens stays out and the wheel's copy is the one imported
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_jlens_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return {"wheel": wheel, "venv": venv, "python": python, "site": site, "tmp": tmp}


def run(installed, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([str(installed["venv"] / "bin" / "jlens"), *args], cwd=installed["tmp"], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_the_wheel_carries_its_assets_and_app(installed):
    import zipfile

    size = installed["wheel"].stat().st_size
    assert size < 100e6, f"the wheel is {size / 1e6:.1f} MB: PyPI refuses wheels over 100 MB (ship fp16 one-matrix lenses only)"
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    for needed in ("jlens_assets/lenses/smollm2-135m.safetensors", "jlens_assets/lenses/smollm2-135m.relevance.safetensors",
                   "jlens_assets/evaluations/two_hop.json",
                   "jlens_assets/example_prompts.json", "jlens_app/main.py", "jlens_app/views/inspect.py",
                   "jlens_core/evaluation/passk.py"):
        assert needed in names
    code = "import jlens_core, jlens_core._paths as p; print(jlens_core.__file__); print(p.ASSETS_DIR); print(p.APP_DIR)"
    where = subprocess.run([str(installed["python"]), "-c", code],
                           cwd=installed["tmp"], capture_output=True, text=True, check=True).stdout.split()
    assert all(str(installed["site"]) in line for line in where), where


@pytest.mark.slow
def test_jlens_inspect_from_the_wheel(installed):
    proc = run(installed, "inspect", "--lens", "default", "--prompt", "The capital of France is", "--last", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "jacobian lens" in proc.stdout.splitlines()[0] and "Paris" in proc.stdout
    evals = run(installed, "eval", "--lens", "logit", "--n-texts", "0", "--pass-at-k", "two_hop", "--k", "10",
                "--out", "ev", "--no-progress")
    assert evals.returncode == 0, evals.stderr[-2000:]


@pytest.mark.slow
def test_jlens_app_from_the_wheel(installed):
    printed = run(installed, "app", "--print-command")
    assert printed.returncode == 0 and re.search(r"jlens_app/main\.py", printed.stdout), printed.stdout
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([str(installed["venv"] / "bin" / "jlens"), "app", "--headless", "--port", str(port),
                             "--address", "127.0.0.1", "--server.fileWatcherType", "none"], cwd=installed["tmp"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_serving(f"http://127.0.0.1:{port}", proc), "the app from the wheel did not start"
    finally:
        stop(proc, 30)
