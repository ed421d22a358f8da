"""lenses/spectra: per-layer matrix statistics (norms, distance to the identity, ranks) and spectra of a lens."""

from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import random_lens

from jlens_core import LogitLens
from jlens_core.lenses.spectra import (
    LAYER_STATS_COLUMNS,
    effective_rank,
    jacobian_matrix,
    layer_stats,
    layer_stats_and_spectra,
    matrix_stats,
    singular_values,
)

# Matrices N(0, 1 / d), 32 wide, layers 0-2, target layer 3.
scaled_lens = functools.partial(random_lens, d=32, eye=0, noise=1 / math.sqrt(32), n_prompts=3)


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
    lens = scaled_lens()
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
    lens = scaled_lens()
    full = lens.with_shrinkage(1.0)  # (1 - 1) J + 1 I = I
    assert layer_stats(full)["dist_identity"].max() == pytest.approx(0.0, abs=1e-6)
    s = singular_values(jacobian_matrix(lens, 1))
    assert s.shape == (32,) and np.all(np.diff(s) <= 1e-12)
    np.testing.assert_allclose(s, singular_values(lens.jacobians[1]), rtol=1e-6)


def test_errors_name_the_problem():
    lens = scaled_lens()
    with pytest.raises(ValueError, match="logit lens"):
        layer_stats(LogitLens(4, 32))
    with pytest.raises(ValueError, match="layer 7"):
        jacobian_matrix(lens, 7)
    with pytest.raises(ValueError, match="matrix"):
        singular_values(torch.zeros(3))


def test_layer_stats_and_spectra_in_one_pass():
    lens = random_lens(d=16, layers=(0, 2), seed=3, eye=0, noise=1.0)
    stats, singular = layer_stats_and_spectra(lens)
    pd_stats = layer_stats(lens)
    np.testing.assert_allclose(stats.drop(columns="layer").to_numpy(), pd_stats.drop(columns="layer").to_numpy())
    for layer in (0, 2):
        np.testing.assert_allclose(singular[layer], singular_values(jacobian_matrix(lens, layer)))


def test_stored_stats_and_spectra_are_computed_once_and_read_back(tmp_path):
    """The stored spectra equal a fresh computation, come back from the file (even once the lens's matrices are
    gone), are not stored under an empty key, and an unreadable file is rebuilt."""
    from jlens_core.lenses.spectra import stored_stats_and_spectra

    lens = random_lens(d=6, seed=4)
    fresh_stats, fresh = layer_stats_and_spectra(lens)
    stats, singular = stored_stats_and_spectra(lens, "lens-a", tmp_path)
    (stored,) = tmp_path.glob("*.npz")
    pd.testing.assert_frame_equal(stats, fresh_stats)
    assert singular.keys() == fresh.keys() and all(np.array_equal(singular[k], fresh[k]) for k in fresh)
    again_stats, again = stored_stats_and_spectra(random_lens(d=6, seed=5), "lens-a", tmp_path)  # the file's, not this lens's
    pd.testing.assert_frame_equal(again_stats, fresh_stats, check_dtype=False)
    assert all(np.array_equal(again[k], fresh[k]) for k in fresh)
    stored_stats_and_spectra(lens, "", tmp_path)
    assert list(tmp_path.glob("*.npz")) == [stored]
    stored.write_bytes(b"not an npz")
    rebuilt_stats, _ = stored_stats_and_spectra(random_lens(d=6, seed=5), "lens-a", tmp_path)
    other_stats, _ = layer_stats_and_spectra(random_lens(d=6, seed=5))
    pd.testing.assert_frame_equal(rebuilt_stats, other_stats)
