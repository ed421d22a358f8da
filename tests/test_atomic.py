"""Atomic file writes (_atomic): the whole file or the previous one, never half, and no temp file left."""

from __future__ import annotations

import stat

import pytest

from jlens_core._atomic import atomic_write, atomic_write_text


def test_atomic_write_text_replaces_the_file(tmp_path):
    path = tmp_path / "sub" / "status.json"
    assert atomic_write_text(path, "one") == path  # the folder is made
    atomic_write_text(path, "two ✓", shared=True)
    assert path.read_text(encoding="utf-8") == "two ✓"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["status.json"]


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "eval.csv"
    path.write_text("old")

    def half_then_fail(tmp):
        with open(tmp, "w") as fh:
            fh.write("ha")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["eval.csv"]
