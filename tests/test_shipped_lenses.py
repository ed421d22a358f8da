"""load_lens / default_lens / the shipped lookup read every kind of lens file (issue #32 §4): a Jacobian
lens, an expert lens (J-experts, J++), its combined one-matrix file, the shipped variants."""

from __future__ import annotations

import pytest
import torch
from conftest import LONG_TEXT

from jlens_core import ExpertLens, JacobianLens, LensFileError, fit
from jlens_core.lenses import shipped
from jlens_core.lenses.kinds import lens_kind
from jlens_core.lenses.loading import default_lens, load_lens, load_lens_file
from jlens_core.lenses.shipped import shipped_lens_path

PROMPTS = [LONG_TEXT, LONG_TEXT.upper(), " ".join(reversed(LONG_TEXT.split()))]


@pytest.fixture(scope="module")
def experts(llama) -> ExpertLens:
    lens = fit(llama, PROMPTS, experts=2, cluster_prompts=3, skip_first=2, max_seq_len=32)
    assert isinstance(lens, ExpertLens)
    return lens


def _weights(lens: ExpertLens) -> dict[int, torch.Tensor]:
    return {layer: torch.tensor([1.0, -0.5]) for layer in lens.source_layers}


def test_load_lens_reads_expert_and_combined_files(llama, experts, tmp_path):
    uniform = load_lens(str(experts.save(tmp_path / "experts.safetensors")), model=llama)
    assert isinstance(uniform, ExpertLens) and uniform.kind == lens_kind(uniform) == "jacobian-experts"
    weighted = experts.with_weights(_weights(experts), items=["a", "b"])
    jpp = load_lens(str(weighted.save(tmp_path / "jpp.safetensors")), model=llama)
    assert isinstance(jpp, ExpertLens) and jpp.kind == "jacobian++" and jpp.weight_items == ["a", "b"]
    layer = experts.source_layers[1]
    assert torch.allclose(jpp.matrix(layer), weighted.matrix(layer))
    # the combined one-matrix file is a plain Jacobian lens whose settings say what it was combined from
    combined = load_lens(str(weighted.to_jacobian_lens().save(tmp_path / "jpp.one.safetensors")), model=llama)
    assert type(combined) is JacobianLens and combined.kind == "jacobian" and lens_kind(combined) == "jacobian++"
    assert torch.allclose(combined.matrix(layer), weighted.matrix(layer), atol=1e-6)
    pooled = experts.pooled_lens()
    assert lens_kind(pooled) == "jacobian"  # a plain lens stays a J lens
    assert "experts" not in pooled.settings_dict() and "cluster_prompts" not in pooled.settings_dict()
    assert pooled.fit_settings == experts.fit_settings.replace(experts=0) and pooled.record == experts.record
    assert {k: v for k, v in experts.settings_dict().items() if k not in ("experts", "cluster_prompts")} == \
        pooled.settings_dict()
    # an expert file for another model is refused like any lens file
    other = ExpertLens.load(tmp_path / "experts.safetensors")
    other = other.replace(model_fingerprint=dict(other.model_fingerprint or {}, d_model=999))
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(LensFileError):
        load_lens_file(tmp_path / "other.safetensors", model=llama)


def test_shipped_variants_are_found_beside_the_jacobian_lens(llama, experts, tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "LENS_DIR", tmp_path)
    monkeypatch.setattr(shipped, "SHIPPED_LENSES", {"smollm2-135m": tmp_path / "smollm2-135m.safetensors"})
    assert all(shipped_lens_path("smollm2-135m", v) is None for v in shipped.VARIANTS)
    # J++ and R++ travel in a clone, not in the wheel: the sentence says where they lie
    with pytest.raises(FileNotFoundError) as caught:
        load_lens("smollm2-135m", variant="jpp")
    assert str(caught.value).startswith("The J++ lens of 'smollm2-135m' is not in the wheel (PyPI's 100 MB limit")
    assert "assets/lenses/smollm2-135m.rpp.safetensors" in str(pytest.raises(
        FileNotFoundError, load_lens, "smollm2-135m:rpp").value)
    with pytest.raises(FileNotFoundError, match="No shipped R-lens for 'smollm2-135m' \\(assets/lenses/smollm2-135m"
                                                "\\.relevance\\.safetensors\\): fit one"):
        load_lens("smollm2-135m", variant="relevance")
    with pytest.raises(FileNotFoundError, match="No shipped J\\+\\+ lens for 'my-model' \\(assets/lenses/my-model"):
        load_lens("my-model:jpp")
    with pytest.raises(ValueError, match="not a shipped lens variant"):
        shipped_lens_path("smollm2-135m", "jp")
    weighted = experts.with_weights(_weights(experts), items=["a"])
    weighted.to_jacobian_lens().save(tmp_path / "smollm2-135m.jpp.safetensors")
    experts.save(tmp_path / "smollm2-135m.rpp.safetensors")  # a full expert file ships too
    assert shipped_lens_path("SmolLM2-135M", "jpp") == tmp_path / "smollm2-135m.jpp.safetensors"
    assert lens_kind(load_lens("smollm2-135m:jpp")) == "jacobian++"
    assert isinstance(load_lens("smollm2-135m", variant="rpp"), ExpertLens)
    # another model's variants: by its name (a Hub id's "/" as "--"), and default_lens(model, variant)
    name = llama.name.replace("/", "--")
    experts.to_jacobian_lens().save(tmp_path / f"{name}.jpp.safetensors")
    assert lens_kind(default_lens(llama, "jpp")) == "jacobian-experts"
    assert default_lens(llama, "rpp") is None and default_lens(llama) is None


def test_the_default_reading_lens_is_a_shipped_variant_only_when_its_file_ships(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "LENS_DIR", tmp_path)
    monkeypatch.setattr(shipped, "SHIPPED_LENSES", {"smollm2-135m": tmp_path / "smollm2-135m.safetensors"})
    monkeypatch.setattr(shipped, "DEFAULT_READING_LENS", {"smollm2-135m": "rpp"})
    assert shipped.default_reading_lens("smollm2-135m") == "jacobian"  # rpp is named but does not ship
    (tmp_path / "smollm2-135m.rpp.safetensors").write_bytes(b"")
    assert shipped.default_reading_lens("SmolLM2-135M") == "rpp"  # an alias of the default model
    assert shipped.default_reading_lens("some/other-model") == "jacobian"
