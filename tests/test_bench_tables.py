"""The bench's figures in the docs are written from the bench's JSON (``bench/bf16_tables.py``), never typed."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bf16_tables


def _block(page: Path, name: str) -> str:
    match = re.search(rf"<!-- bf16_tables:{name} -->\n?(.*?)<!-- /bf16_tables:{name} -->", page.read_text(), re.DOTALL)
    assert match, f"no {name} block in {page}"
    return match.group(1)


def test_the_pages_hold_what_the_json_gives():
    """Each generated block in the README and bench/README.md equals the block its JSON makes now: a figure edited by
    hand, or a JSON rerun without `python bench/bf16_tables.py`, fails here."""
    speed_all = json.loads((ROOT / "bench" / "bf16_fit_speed_all.json").read_text())
    assert _block(ROOT / "README.md", "fit_time") == bf16_tables.fit_time_block(speed_all)
    app = json.loads((ROOT / "bench" / "app_latency.json").read_text())
    assert _block(ROOT / "bench" / "README.md", "app") == bf16_tables.app_block(app)
    stability = json.loads((ROOT / "bench" / "stability_speed.json").read_text())
    assert _block(ROOT / "bench" / "README.md", "stability") == bf16_tables.stability_block(stability)
    readout = json.loads((ROOT / "bench" / "bf16_readout.json").read_text())
    assert _block(ROOT / "bench" / "README.md", "readout") == bf16_tables.readout_block(readout)


def test_fit_time_and_app_rows_are_computed_from_the_runs():
    data = {"cpu": {"cores": 2, "model_name": "CPU X"},
            "fit_128": {"float32": {"median_s": 72.0}, "bfloat16": {"median_s": 36.0}}}
    assert bf16_tables.fit_time_block(data, n_prompts=100) == (
        "about 1.0 hours in bf16 (fp32: 2.0 hours) on a 2-thread CPU X (72 s / 36 s a prompt, fp32 / bf16, "
        "`bench/bf16_fit.py --speed-only 0`)")
    app = {"cpu": {}, "matmul_peak_gflops": 100.0, "rows": [
        {"step": "launch", "seconds": 7.0, "each": [6.0, 7.0, 9.0], "goal_seconds": 6.0},
        {"step": "marks", "seconds": 2.0, "each": [2.0], "goal_seconds": None}]}
    rows = bf16_tables.app_block(app).splitlines()[-2:]
    assert rows == ["| launch | 7.00 (6.00-9.00) | 6 **over** |", "| marks | 2.00 |  |"]
    inline = "a lens takes <!-- bf16_tables:fit_time -->old<!-- /bf16_tables:fit_time --> here"
    assert bf16_tables.replace(inline, "fit_time", "new") == \
        "a lens takes <!-- bf16_tables:fit_time -->new<!-- /bf16_tables:fit_time --> here"
