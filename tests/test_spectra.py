"""jlens_core.lenses.spectra, reading.singular_directions, fitting.diagnostics: per-layer matrix statistics, spectra, decoded directions, fit diagnostics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from jlens_core import JacobianLens, LogitLens
from jlens_core.fitting.diagnostics import (
    DIAGNOSTIC_COLUMNS,
    convergence_frame,
    diagnostics_frame,
    norm_matrix,
    one_over_n_guide,
    read_diagnostics,
)
from jlens_core.lenses.spectra import (
    LAYER_STATS_COLUMNS,
    effective_rank,
    layer_spectrum,
    layer_stats,
    matrix_stats,
    singular_values,
)
from jlens_core.reading.singular_directions import DIRECTION_COLUMNS, top_directions


def _lens(d=32, layers=(0, 1, 2), seed=0, **kwargs):
    g = torch.Generator().manual_seed(seed)
    mats = {layer: torch.randn(d, d, generator=g) / math.sqrt(d) for layer in layers}
    return JacobianLens(mats, n_prompts=3, d_model=d, target_layer=max(layers) + 1, **kwargs)


def test_matrix_stats_identity_and_rank_one():
    d = 16
    eye = matrix_stats(torch.eye(d))
    assert eye["fro_norm"] == pytest.approx(1.0)
    assert eye["spectral_norm"] == pytest.approx(1.0)
    assert eye["dist_identity"] == pytest.approx(0.0, abs=1e-12)
    assert eye["effective_rank"] == pytest.approx(d)
    assert eye["stable_rank"] == pytest.approx(d)
    u = torch.randn(d, 1, dtype=torch.float64)
    one = matrix_stats(3.0 * u @ u.T / u.norm() ** 2)
    assert one["spectral_norm"] == pytest.approx(3.0)
    assert one["effective_rank"] == pytest.approx(1.0, abs=1e-6)
    assert one["stable_rank"] == pytest.approx(1.0)
    assert effective_rank(np.zeros(4)) == 0.0
    with pytest.raises(ValueError, match="square"):
        matrix_stats(torch.zeros(3, 4))


def test_layer_stats_match_direct_computation():
    lens = _lens()
    table = layer_stats(lens)
    assert list(table.columns) == list(LAYER_STATS_COLUMNS)
    assert table["layer"].tolist() == [0, 1, 2]
    for _, row in table.iterrows():
        mat = lens.jacobians[int(row["layer"])].double()
        s = torch.linalg.svdvals(mat)
        assert row["fro_norm"] == pytest.approx(float(mat.norm()) / math.sqrt(32))
        assert row["spectral_norm"] == pytest.approx(float(s[0]))
        assert row["dist_identity"] == pytest.approx(float((mat - torch.eye(32, dtype=mat.dtype)).norm()) / math.sqrt(32))
        p = s / s.sum()
        assert row["effective_rank"] == pytest.approx(float(torch.exp(-(p * p.log()).sum())))
    assert layer_stats(lens, layers=[1])["layer"].tolist() == [1]


def test_shrinkage_is_applied_and_spectrum_sorted():
    lens = _lens()
    full = lens.with_shrinkage(1.0)  # (1 - 1) J + 1 I = I
    assert layer_stats(full)["dist_identity"].max() == pytest.approx(0.0, abs=1e-6)
    s = layer_spectrum(lens, 1)
    assert s.shape == (32,) and np.all(np.diff(s) <= 1e-12)
    np.testing.assert_allclose(s, singular_values(lens.jacobians[1]), rtol=1e-6)


def test_errors_name_the_problem():
    lens = _lens()
    with pytest.raises(ValueError, match="logit lens"):
        layer_stats(LogitLens(4, 32))
    with pytest.raises(ValueError, match="layer 7"):
        layer_spectrum(lens, 7)
    with pytest.raises(ValueError, match="matrix"):
        singular_values(torch.zeros(3))


def test_top_directions_decode_through_unembedding(tiny_llama):
    model = tiny_llama
    lens = _lens(d=model.d_model, layers=(0, 1, 2))
    frame = top_directions(model, lens, 1, n_directions=3, top_k=5)
    assert list(frame.columns) == list(DIRECTION_COLUMNS)
    assert len(frame) == 3 * 2 * 2  # directions x sides x signs
    assert frame["side"].tolist()[:6] == ["output"] * 6
    assert frame["sign"].tolist()[:2] == ["+", "-"]
    assert all(len(t) == 5 for t in frame["tokens"])
    sv = frame.drop_duplicates("direction")["singular_value"].to_numpy()
    assert np.all(np.diff(sv) <= 1e-9)
    # the "+" tokens of the first output direction are the argmax of unembed(cu) - unembed(-cu)
    u = torch.linalg.svd(lens.matrix(1).double())[0]
    x = math.sqrt(model.d_model) * u[:, 0].float()
    with torch.no_grad():
        score = model.unembed(x) - model.unembed(-x)
    from jlens_core.reading.tokens import TokenDisplay

    strings = TokenDisplay.for_model(model).strings()
    first = frame.iloc[0]
    assert first["tokens"][0] == strings[int(score.argmax())]
    minus = frame.iloc[1]
    assert minus["tokens"][0] == strings[int(score.argmin())]
    inputs = top_directions(model, lens, 1, n_directions=1, top_k=2, sides=("input",))
    assert set(inputs["side"]) == {"input"}
    with pytest.raises(ValueError, match="sides"):
        top_directions(model, lens, 1, sides=("middle",))
    with pytest.raises(ValueError, match="at least 1"):
        top_directions(model, lens, 1, n_directions=0)


def _records(n_prompts=6, layers=(0, 1), skip=(2,)):
    out = []
    n = 0
    for idx in range(n_prompts):
        if idx in skip:
            continue
        n += 1
        for layer in layers:
            out.append({"prompt_index": idx, "layer": layer, "seq_len": 40, "n_valid": 23, "seconds": 0.5,
                        "jacobian_norm": 1.0 + layer + 0.1 * idx, "rel_change": None if n == 1 else 0.5 / n})
    return out


def test_diagnostics_frames(tmp_path):
    recs = _records()
    frame = diagnostics_frame(recs)
    assert list(frame.columns) == list(DIAGNOSTIC_COLUMNS)
    # prompt 2 was skipped: prompt 3 is the third one averaged
    assert frame.loc[frame["prompt_index"] == 3, "n_prompts"].unique().tolist() == [3]
    assert frame.loc[frame["prompt_index"] == 0, "rel_change"].isna().all()
    conv = convergence_frame(frame)
    assert conv["n_prompts"].min() == 2 and len(conv) == 2 * 4
    np.testing.assert_allclose(conv["rel_change"] * conv["n_prompts"], 0.5)
    guide = one_over_n_guide(conv)
    assert guide["rel_change"].tolist() == pytest.approx([0.25, 0.1])
    norms = norm_matrix(frame)
    assert norms.shape == (5, 2) and norms.loc[4, 1] == pytest.approx(2.4)
    empty = diagnostics_frame([])
    assert empty.empty and list(empty.columns) == list(DIAGNOSTIC_COLUMNS)
    assert convergence_frame(empty).empty and one_over_n_guide(convergence_frame(empty)).empty
    assert norm_matrix(empty).empty

    path = tmp_path / "lens.diagnostics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"prompt_index": 9, "lay')
    assert read_diagnostics(path) == recs  # the half-written last line is left out
    assert read_diagnostics(tmp_path / "missing.jsonl") == []


def test_layer_stats_and_spectra_in_one_pass():
    from jlens_core.lenses.spectra import layer_stats_and_spectra

    gen = torch.Generator().manual_seed(3)
    lens = JacobianLens({layer: torch.randn(16, 16, generator=gen) for layer in (0, 2)}, n_prompts=1, d_model=16,
                        target_layer=3)
    stats, singular = layer_stats_and_spectra(lens)
    pd_stats = layer_stats(lens)
    np.testing.assert_allclose(stats.drop(columns="layer").to_numpy(), pd_stats.drop(columns="layer").to_numpy())
    for layer in (0, 2):
        np.testing.assert_allclose(singular[layer], layer_spectrum(lens, layer))
