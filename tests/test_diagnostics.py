"""fitting/diagnostics: the fit's per-prompt records as tables (convergence, the 1/n guide, norms) and the
diagnostics file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jlens_core.fitting.diagnostics import (
    DIAGNOSTIC_COLUMNS,
    convergence_frame,
    diagnostics_frame,
    norm_matrix,
    one_over_n_guide,
    read_diagnostics,
)


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

