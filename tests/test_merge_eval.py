"""scripts/merge_eval.py: a comparison grows by the lenses of a second evaluation folder, no row lost or doubled."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def merge_eval():
    return load_script("scripts/merge_eval.py")


def per_layer(lenses: list[str]) -> pd.DataFrame:
    return pd.DataFrame([{"lens": lens, "layer": layer, "kl_bits": 1.0 + i + layer, "ce_bits": 2.0 + i}
                         for i, lens in enumerate(lenses) for layer in range(3)])


def detail(lenses: list[str], words=("cold", "hot")) -> pd.DataFrame:
    return pd.DataFrame([{"item": 0, "name": "a", "lens": lens, "role": "intermediate", "word": word, "best_rank": 1.0 + i,
                          "vocab": "all", "set": "s"} for i, lens in enumerate(lenses) for word in words])


def swaps(lenses: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    success = pd.DataFrame([{"lens": lens, "alpha": 1.0, "successes": i} for i, lens in enumerate(lenses)])
    items = pd.DataFrame({"name": ["x", "y"], "eligible": [True, False],
                          **{f"{lens}@1": [True, False] for lens in lenses}, "set": ["swaps", "swaps"]})
    return success, items


def write(folder: Path, lenses: list[str], **kwargs) -> None:
    (folder / "swap").mkdir(parents=True)
    per_layer(lenses).to_csv(folder / "eval.csv", index=False)
    detail(lenses, **kwargs).to_csv(folder / "pass_at_k_detail.csv", index=False)
    success, items = swaps(lenses)
    success.to_csv(folder / "swap" / "swap_success.csv", index=False)
    items.to_csv(folder / "swap" / "swap_items.csv", index=False)
    (folder / "eval.json").write_text(json.dumps({"model": "m", "corpus": "c", "split": "eval", "n_texts": 2,
                                                  "max_seq_len": 8, "per_layer": []}))
    (folder / "swap" / "eval.json").write_text(json.dumps({"model": "m", "swap_success": []}))


def test_new_lenses_are_appended_and_shared_ones_kept_from_the_base(tmp_path, merge_eval):
    base, added = tmp_path / "base", tmp_path / "added"
    write(base, ["logit", "jacobian"])
    write(added, ["jacobian++", "logit"])  # the logit lens comes with every swap run: its base rows stay
    merge_eval.merge_folders(base, added)

    merged = pd.read_csv(base / "eval.csv")
    assert list(dict.fromkeys(merged["lens"])) == ["logit", "jacobian", "jacobian++"]
    assert len(merged) == 9
    # the base's logit rows, not the added run's (whose numbers differ: index 1 there)
    assert merged[merged["lens"] == "logit"]["ce_bits"].tolist() == [2.0] * 3
    assert merged[merged["lens"] == "jacobian++"]["ce_bits"].tolist() == [2.0] * 3
    success = pd.read_csv(base / "swap" / "swap_success.csv")
    assert success["lens"].tolist() == ["logit", "jacobian", "jacobian++"]
    items = pd.read_csv(base / "swap" / "swap_items.csv")
    assert list(items.columns) == ["name", "eligible", "logit@1", "jacobian@1", "jacobian++@1", "set"]
    summary = json.loads((base / "eval.json").read_text())
    assert [row["lens"] for row in summary["per_layer"]] == merged["lens"].tolist()
    assert len(json.loads((base / "swap" / "eval.json").read_text())["swap_success"]) == 3
    assert (base / "eval.png").stat().st_size > 0


def test_lenses_scored_on_other_items_are_refused(tmp_path, merge_eval):
    base, added = tmp_path / "base", tmp_path / "added"
    write(base, ["logit"])
    write(added, ["jacobian++"], words=("cold", "warm"))
    with pytest.raises(merge_eval.MergeError, match="pass_at_k_detail.csv: lens 'jacobian\\+\\+' was scored on"):
        merge_eval.merge_folders(base, added)


def test_a_table_missing_from_the_base_is_named(tmp_path, merge_eval, capsys):
    base, added = tmp_path / "base", tmp_path / "added"
    write(base, ["logit"])
    write(added, ["jacobian++"])
    (base / "eval.csv").unlink()
    assert merge_eval.main([str(base), str(added)]) == 2
    assert f"{base / 'eval.csv'} is missing while {added / 'eval.csv'} exists" in capsys.readouterr().err
    assert merge_eval.main([str(base), str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
