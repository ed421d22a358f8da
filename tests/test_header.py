"""A lens file's header read once (jlens_core/lenses/header.py): what each kind of file says, the refusals
naming the path, the cache per file version, no torch, and the readers that go through it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import LONG_TEXT
from helpers import ROOT, random_lens
from safetensors.torch import save_file

from jlens_core import ExpertLens, JacobianLens, LensFileError, TunedLens, fit
from jlens_core.lenses import header as header_module
from jlens_core.lenses.experts import is_expert_lens_file
from jlens_core.lenses.header import ForeignFileError, LensHeader, header_or_none, read_header
from jlens_core.lenses.kinds import lens_kind
from jlens_core.lenses.loading import load_lens_file
from jlens_core.lenses.shipped import is_tuned_lens_file


@pytest.fixture(scope="module")
def files(llama, tmp_path_factory):
    """A J lens, an R-lens's header twin, an expert lens (uniform and weighted), its combined file, a tuned lens."""
    folder = tmp_path_factory.mktemp("headers")
    experts = fit(llama, [LONG_TEXT, LONG_TEXT.upper()], experts=2, cluster_prompts=2, skip_first=2, max_seq_len=24)
    assert isinstance(experts, ExpertLens)
    weighted = experts.with_weights({layer: torch.tensor([1.0, -0.5]) for layer in experts.source_layers})
    return {
        "jacobian": random_lens(llama).save(folder / "j.safetensors"),
        "relevance": random_lens(llama, rules="relevance").save(folder / "r.safetensors"),
        "jacobian-experts": experts.save(folder / "experts.safetensors"),
        "jacobian++": weighted.save(folder / "jpp.safetensors"),
        "combined": weighted.to_jacobian_lens().save(folder / "jpp.one.safetensors"),
        "tuned": TunedLens.zeros(llama).save(folder / "tuned.safetensors"),
    }


def test_each_kind_of_file_says_what_it_holds(files, llama):
    for name, path in files.items():
        header = read_header(path)
        assert isinstance(header, LensHeader) and header.path == path
        lens = load_lens_file(path, model=llama)
        assert header.kind == lens_kind(lens), name  # the header alone tells the kind the loaded lens reads as
    assert read_header(files["jacobian"]).rules == "jacobian" and read_header(files["relevance"]).rules == "relevance"
    assert read_header(files["tuned"]).rules is None and read_header(files["tuned"]).is_tuned
    assert read_header(files["jacobian-experts"]).is_expert and not read_header(files["combined"]).is_expert
    assert read_header(files["combined"]).kind == "jacobian++"
    assert read_header(files["jacobian"]).format == "jlens" and read_header(files["tuned"]).format == "jlens-tuned"
    info = read_header(files["jacobian"]).fresh_info()
    info["settings"]["skip_first"] = -1  # a copy: the cached header is unchanged
    assert read_header(files["jacobian"]).fresh_info()["settings"] != info["settings"]
    assert set(read_header(files["jacobian"]).tensors) == {f"J.{layer}" for layer in range(llama.n_layers - 1)}


def test_a_header_is_read_once_per_file_version(files, tmp_path):
    path = random_lens(d=4).save(tmp_path / "lens.safetensors")
    header_module._read.cache_clear()
    first = read_header(path)
    for _ in range(3):
        assert read_header(path) is first
        assert is_expert_lens_file(path) is False and is_tuned_lens_file(path) is False
    assert header_module._read.cache_info().misses == 1
    random_lens(d=4, layers=(0, 1)).save(path)  # rewritten (atomically: a new file version)
    again = read_header(path)
    assert again is not first and set(again.tensors) == {"J.0", "J.1"}
    assert header_module._read.cache_info().misses == 2
    # loading a lens file: its header read once for the kind questions and the loader together
    header_module._read.cache_clear()
    load_lens_file(files["jacobian-experts"])
    assert header_module._read.cache_info().misses == 1


def test_missing_damaged_and_foreign_files_are_refused_naming_the_path(files, tmp_path):
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError, match="No lens file at .*missing.safetensors"):
        read_header(missing)
    data = files["jacobian"].read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(LensFileError, match=r"cut.safetensors' is not a readable lens file \(truncated"):
        read_header(cut)
    (tmp_path / "notes.txt").write_text("hello, not a lens at all\n")
    with pytest.raises(LensFileError, match="notes.txt' is not a readable lens file"):
        read_header(tmp_path / "notes.txt")
    save_file({"weight": torch.zeros(3, 3)}, str(tmp_path / "foreign.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ForeignFileError, match="foreign.safetensors' is a safetensors file but not a jlens lens"):
        read_header(tmp_path / "foreign.safetensors")
    with pytest.raises(LensFileError, match="is a folder"):
        read_header(tmp_path)
    assert all(header_or_none(p) is None for p in (missing, cut, tmp_path / "foreign.safetensors", tmp_path))
    with pytest.raises(LensFileError, match="a safetensors file but not a jlens lens"):
        JacobianLens.load(tmp_path / "foreign.safetensors")  # the loaders refuse through it


def test_reading_a_header_imports_no_torch(files):
    code = ("import sys; from jlens_core.lenses.header import read_header; "
            f"h = read_header({str(files['jacobian++'])!r}); print(h.kind, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    assert out == ["jacobian++", "False"]


def test_the_app_reads_a_files_header_once(files):
    pytest.importorskip("streamlit")
    sys.path.insert(0, str(ROOT / "app"))
    import lens_slots

    header_module._read.cache_clear()
    for _ in range(3):
        assert lens_slots.slot_for_file(files["jacobian++"]) is lens_slots.JPP
    assert lens_slots.slot_for_file(files["relevance"]) is lens_slots.RELEVANCE
    assert lens_slots.slot_for_file(files["combined"], "relevance") is lens_slots.JPP  # the header's rules win
    assert header_module._read.cache_info().misses == 3  # one read per file
