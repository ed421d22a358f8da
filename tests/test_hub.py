"""Lenses from the Hugging Face Hub, read from a Hub cache folder built here (no network)."""

from __future__ import annotations

import pytest
import torch

from jlens_core import JacobianLens
from jlens_core.cli.main import main
from jlens_core.lenses.hub import parse_hub_spec
from jlens_core.lenses.loading import load_lens
from jlens_core.lenses.tuned import TunedLens

MAIN_COMMIT = "a" * 40
TAG_COMMIT = "b" * 40


@pytest.fixture
def hub(tmp_path, llama, monkeypatch):
    """A Hub cache with ``owner/lenses``: on ``main`` a reference-format ``lens.pt``; on tag ``v1`` a jlens
    file under ``sub/`` and a tuned lens. HF_HUB_OFFLINE: only the cache may answer."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--owner--lenses"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN_COMMIT)
    (repo / "refs" / "v1").write_text(TAG_COMMIT)
    gen = torch.Generator().manual_seed(0)
    d = llama.d_model
    mats = torch.randn(3, d, d, generator=gen)
    main_dir = repo / "snapshots" / MAIN_COMMIT
    main_dir.mkdir(parents=True)
    torch.save({"J": mats, "n_prompts": 7, "source_layers": [0, 1, 2], "d_model": d, "target_layer": 3},
               main_dir / "lens.pt")
    tag_dir = repo / "snapshots" / TAG_COMMIT / "sub"
    tag_dir.mkdir(parents=True)
    ours = JacobianLens({0: mats[0] * 2}, n_prompts=3, d_model=d, target_layer=3, n_layers=4, model_name=llama.name,
                        model_fingerprint=llama.fingerprint())
    ours.save(tag_dir / "jlens.safetensors")
    TunedLens.zeros(llama).save(tag_dir / "tuned.safetensors")
    return {"mats": mats}


def test_parse_hub_spec():
    assert parse_hub_spec("hf://o/r@v2/a/b.pt") == ("o/r", "v2", "a/b.pt")
    assert parse_hub_spec("hf://o/r") == ("o/r", None, None)
    with pytest.raises(ValueError, match="is not a Hub lens spec"):
        parse_hub_spec("hf://onlyowner")


def test_load_lens_by_spec_repo_and_revision(llama, hub):
    ref = load_lens("hf://owner/lenses/lens.pt", model=llama)
    assert ref.n_prompts == 7 and ref.source_layers == [0, 1, 2]
    torch.testing.assert_close(ref.matrix(1), hub["mats"][1])
    tagged = load_lens("hf://owner/lenses@v1/sub/jlens.safetensors", model=llama)
    torch.testing.assert_close(tagged.matrix(0), hub["mats"][0] * 2)
    by_commit = load_lens(f"hf://owner/lenses@{TAG_COMMIT}/sub/jlens.safetensors")
    assert by_commit.n_prompts == 3
    tuned = load_lens("hf://owner/lenses@v1/sub/tuned.safetensors", model=llama)
    assert isinstance(tuned, TunedLens)


def test_from_pretrained(llama, hub):
    assert JacobianLens.from_pretrained("owner/lenses", model=llama).n_prompts == 7  # the only lens file on main
    assert JacobianLens.from_pretrained("owner/lenses", "sub/jlens.safetensors", revision="v1").n_prompts == 3
    with pytest.raises(FileNotFoundError, match=r"holds 2 lens files: sub/jlens.safetensors, sub/tuned.safetensors"):
        JacobianLens.from_pretrained("owner/lenses", revision="v1")


def test_missing_files_are_one_sentence(hub):
    with pytest.raises(FileNotFoundError, match=r"Could not get the lens owner/lenses@main/nope.pt: tried the Hugging "
                                                r"Face cache .*HF_HUB_OFFLINE is set"):
        load_lens("hf://owner/lenses/nope.pt")
    with pytest.raises(FileNotFoundError, match="Could not get the lens other/repo@main"):
        JacobianLens.from_pretrained("other/repo")
    with pytest.raises(FileNotFoundError, match="Could not get the lens owner/lenses@v9"):
        load_lens("hf://owner/lenses@v9/lens.pt")


def test_cli_takes_a_hub_spec(llama, hub, tmp_path, capsys):
    folder = tmp_path / "tiny"
    llama.hf_model.save_pretrained(folder)
    llama.tokenizer.save_pretrained(folder)
    code = main(["inspect", "--model", str(folder), "--lens", "hf://owner/lenses/lens.pt", "--prompt",
                 "The capital of France is", "--last", "2"])
    assert code == 0 and "jacobian lens" in capsys.readouterr().out.splitlines()[0]
    assert main(["inspect", "--model", str(folder), "--lens", "hf://owner/lenses/missing.pt", "--prompt", "hi"]) == 2
    assert "Could not get the lens" in capsys.readouterr().err
