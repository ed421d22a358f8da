"""The reading file (docs/method.md §6.1) and ``jlens inspect --save / --format``, on a tiny model.

Round trips compare field by field with the readings read from the model: every number is stored
in its own dtype, so equality is exact (``np.array_equal`` with NaN equal), not within a tolerance.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import math

import numpy as np
import pandas as pd
import pytest
from helpers import random_lens, tiny

from jlens_core import (
    LogitLens,
    PromptReading,
    ReadingFileError,
    Steer,
    compare_runs,
    generate,
    load_readings,
    most_common_tokens,
    read_prompt,
    read_prompts,
    save_readings,
)
from jlens_core.cli.main import main
from jlens_core.reading.file_format import FORMAT_VERSION, READING_ARRAYS
from jlens_core.reading.grid_export import grid_records

PROMPT = "def add(a, b):\n    return a + b"


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture(scope="module")
def lenses(model):
    return {"logit": LogitLens.for_model(model), "jacobian": random_lens(model, settings={"skip_first": 2})}


@pytest.fixture(scope="module")
def readings(model, lenses):
    return read_prompts(model, lenses, PROMPT, top_k=5, pinned=["a", "return"])


def assert_same_reading(loaded: PromptReading, original: PromptReading) -> None:
    """Every field of ``original`` equal in ``loaded`` (arrays exactly, dtypes too); the names shown equal."""
    for name in READING_ARRAYS:
        a, b = getattr(loaded, name), getattr(original, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), name
    for name in ("text", "model_name", "lens_kind", "tokens", "layers", "output_layer", "top_k", "show_whitespace",
                 "word_like", "pinned", "n_prompt", "edits", "vocab", "skip_first", "segments", "n_generated",
                 "position_tokens", "next_tokens", "final_top1_tokens", "stats"):
        assert getattr(loaded, name) == getattr(original, name), name
    assert loaded.pinned_ranks.keys() == original.pinned_ranks.keys()
    for name, ranks in original.pinned_ranks.items():
        assert loaded.pinned_ranks[name].dtype == ranks.dtype and np.array_equal(loaded.pinned_ranks[name], ranks)
    assert np.array_equal(loaded.fitted, original.fitted)
    assert loaded.top1_grid() == original.top1_grid()
    pd.testing.assert_frame_equal(loaded.frame, original.frame)
    for stat in original.stats:
        assert np.array_equal(loaded.grid(stat), original.grid(stat), equal_nan=True), stat
    layer, position = original.layers[1], int(original.positions[-2])
    assert loaded.cell(layer, position) == original.cell(layer, position)
    assert loaded.display is None  # no tokenizer: the file names the ids it shows
    shown = np.unique(original.top_ids)
    if original.word_ids is not None:
        assert np.array_equal(loaded.word_ids[shown], original.word_ids[shown])


def test_one_reading_round_trips_exactly(model, lenses, readings, tmp_path):
    reading = readings["jacobian"]
    path = reading.save(tmp_path / "r.jlens.json", model=model, lens=lenses["jacobian"], origin="lens.safetensors")
    loaded = PromptReading.load(path)
    assert_same_reading(loaded, reading)
    assert not loaded.fitted[:2].any() and loaded.fitted[2:].all()  # skip_first=2 travels
    with pytest.raises(ReadingFileError, match="holds no reading 'logit'"):
        PromptReading.load(path, "logit")


def test_several_lenses_with_identities(model, lenses, readings, tmp_path):
    path = save_readings(tmp_path / "two.jlens.json", readings, model=model, lenses=lenses,
                         origins={"logit": "logit", "jacobian": "lens.safetensors"})
    opened = load_readings(path)
    assert list(opened.readings) == ["logit", "jacobian"]
    for name, reading in readings.items():
        assert_same_reading(opened.readings[name], reading)
    assert opened.model == {"name": model.name, "fingerprint": model.fingerprint(), "n_layers": model.n_layers,
                            "vocab_size": model.vocab_size}
    jac = opened.lenses["jacobian"]
    assert jac["kind"] == "jacobian" and jac["origin"] == "lens.safetensors"
    assert jac["settings"]["skip_first"] == 2 and jac["model_fingerprint"] == model.fingerprint()
    assert "diagnostics" not in jac
    assert opened.lenses["logit"] == {"kind": "logit", "origin": "logit", "settings": {},
                                      "layers": list(lenses["logit"].layers)}
    assert opened.generation is None and opened.comparison is None and opened.version == FORMAT_VERSION
    with pytest.raises(ReadingFileError, match="holds 2 readings"):
        PromptReading.load(path)
    assert_same_reading(PromptReading.load(path, "logit"), readings["logit"])


def test_word_readout_and_most_common_tokens_after_loading(model, lenses, tmp_path):
    reading = read_prompt(model, lenses["jacobian"], PROMPT, top_k=4, vocab="word", word_like=True)
    loaded = PromptReading.load(reading.save(tmp_path / "word.jlens.json"))
    assert_same_reading(loaded, reading)
    for vocab in ("all", "word"):
        pd.testing.assert_frame_equal(most_common_tokens(loaded, vocab=vocab, word_like=True),
                                      most_common_tokens(reading, vocab=vocab, word_like=True))


def _same_generation(a, b) -> None:
    for name in ("prompt_ids", "generated_ids", "top_ids", "top_probs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    for name in ("prompt", "prompt_text", "stop_reason", "temperature", "seed", "chat", "model_name", "edits",
                 "continuation", "n_prompt", "n_generated"):
        assert getattr(a, name) == getattr(b, name), name


def test_a_generation_and_a_comparison_with_edits(model, lenses, tmp_path):
    steer = Steer(model, lenses["logit"], " capital", 2.0, layers=[1])
    gen = generate(model, PROMPT, max_new_tokens=6, temperature=0.7, seed=3)
    clean = read_prompts(model, lenses, gen, top_k=3)
    edited = read_prompts(model, lenses, gen, top_k=3, edits=[steer])
    comparison = compare_runs(model, PROMPT, [steer], max_new_tokens=5, top_k=4)
    readings = {**clean, **{f"{name} (edited)": r for name, r in edited.items()}}
    path = save_readings(tmp_path / "edits.jlens.json", readings, model=model, lenses=lenses,
                         generation=gen, comparison=comparison)
    opened = load_readings(path)
    assert list(opened.readings) == ["logit", "jacobian", "logit (edited)", "jacobian (edited)"]
    for name, reading in readings.items():
        assert_same_reading(opened.readings[name], reading)
    assert opened.readings["jacobian (edited)"].edits == [repr(steer)]
    assert opened.readings["jacobian"].n_generated == gen.n_generated == 6
    _same_generation(opened.generation, gen)
    _same_generation(opened.comparison.clean, comparison.clean)
    _same_generation(opened.comparison.edited, comparison.edited)
    assert opened.comparison.edited.edits == [repr(steer)]
    assert opened.comparison.first_difference == comparison.first_difference
    pd.testing.assert_frame_equal(opened.comparison.next_tokens, comparison.next_tokens)
    # the side effects (docs/method.md §7.2) come back; a file saved before them opens with NaN
    for name in ("readout_kl_bits", "downstream_kl_bits", "downstream_kl_max_bits"):
        assert getattr(opened.comparison, name) == getattr(comparison, name) and getattr(comparison, name) >= 0
    assert opened.comparison.readout_excluded == comparison.readout_excluded != []

    def drop_figures(data):
        for key in ("readout_kl_bits", "downstream_kl_bits", "downstream_kl_max_bits", "readout_excluded"):
            data["comparison"].pop(key)

    _rewrite(path, drop_figures)
    older = load_readings(path).comparison
    assert math.isnan(older.readout_kl_bits) and older.side_effects() == "side effects not computed"


# -- bad files: one sentence each ---------------------------------------------------------------------------
def _rewrite(path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _one_sentence(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert message.count(". ") == 0 and message.endswith(".") and "\n" not in message
    return message


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: d.update(version=FORMAT_VERSION + 1), f"format version {FORMAT_VERSION + 1}, which this jlens"),
    (lambda d: d.pop("version"), "format version None"),
    (lambda d: d.update(format="jlens-lens"), "its format is 'jlens-lens', not 'jlens-reading'"),
    (lambda d: d.pop("readings"), "lacks the field 'readings'"),
    (lambda d: d["readings"]["jacobian"]["arrays"].pop("kl_bits"), "lacks the field 'readings.jacobian.arrays.kl_bits'"),
    (lambda d: d["readings"]["jacobian"].pop("tokens"), "lacks the field 'readings.jacobian.tokens'"),
    (lambda d: d["readings"]["logit"]["pinned_ranks"].pop("a"), "lacks the field 'readings.logit.pinned_ranks.a'"),
    (lambda d: d["model"].pop("name"), "lacks the field 'model.name'"),
    (lambda d: d["readings"]["jacobian"].update(top_k="5"), "'readings.jacobian.top_k' is a str, not a whole number"),
    (lambda d: d["readings"]["jacobian"]["arrays"]["kl_bits"].update(shape=[1, 2]), "bytes, not the 16 its shape [1, 2] and dtype float64 take"),
    (lambda d: d["readings"]["jacobian"]["arrays"]["kl_bits"].update(dtype="complex64"), "dtype 'complex64'"),
    (lambda d: d["readings"]["jacobian"].update(layers=[0]), "arrays.entropy_bits has the shape"),
])
def test_a_bad_file_is_one_sentence(readings, tmp_path, change, expected):
    path = save_readings(tmp_path / "bad.jlens.json", readings)
    _rewrite(path, change)
    with pytest.raises(ReadingFileError) as exc:
        load_readings(path)
    assert expected in _one_sentence(exc)


def test_not_json_and_no_file(tmp_path):
    path = tmp_path / "x.jlens.json"
    path.write_text("{not json")
    with pytest.raises(ReadingFileError, match="it is not JSON") as exc:
        load_readings(path)
    _one_sentence(exc)
    with pytest.raises(FileNotFoundError, match="No reading file"):
        load_readings(tmp_path / "missing.jlens.json")
    with pytest.raises(ValueError, match="No readings to save"):
        save_readings(tmp_path / "y.jlens.json", {})


def test_arrays_are_readable_without_jlens(readings, tmp_path):
    """The documented encoding: little-endian bytes, base64, in the named dtype and shape."""
    path = save_readings(tmp_path / "plain.jlens.json", readings)
    field = json.loads(path.read_text())["readings"]["jacobian"]["arrays"]["kl_bits"]
    kl = np.frombuffer(base64.b64decode(field["base64"]), dtype="<" + np.dtype(field["dtype"]).str[1:])
    assert np.array_equal(kl.reshape(field["shape"]), readings["jacobian"].kl_bits)


# -- the command line ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    from conftest import save_tiny

    root = tmp_path_factory.mktemp("inspect-data")
    model_dir = save_tiny(root / "tiny")
    from jlens_core import load_model

    model = load_model(str(model_dir), device="cpu")
    lens_path = random_lens(model, settings={"skip_first": 2}).save(root / "lens.safetensors")
    return {"root": root, "model_dir": str(model_dir), "model": model, "lens_path": str(lens_path)}


def _inspect(cli_files, *extra: str) -> list[str]:
    return ["inspect", "--model", cli_files["model_dir"], "--lens", "logit", "--lens", cli_files["lens_path"],
            "--prompt", PROMPT, "--top-k", "3", "--pin", "a", *extra]


def test_cli_save_and_formats_parse_back(cli_files, capsys):
    from jlens_core import load_lens

    model = cli_files["model"]
    expected = read_prompts(model, {"logit": LogitLens.for_model(model),
                                    "jacobian": load_lens(cli_files["lens_path"], model=model)},
                            PROMPT, top_k=3, show_whitespace=True, pinned=["a"])
    saved = cli_files["root"] / "cli.jlens.json"
    assert main(_inspect(cli_files, "--format", "json", "--save", str(saved))) == 0
    out = capsys.readouterr()
    records = json.loads(out.out)  # stdout is the data alone
    assert f"Wrote {saved}" in out.err
    assert records == json.loads(json.dumps(grid_records(expected)))
    n_cells = sum(r.n_layers * r.n_positions for r in expected.values())
    assert len(records) == n_cells and records[0]["lens"] == "logit" and records[-1]["lens"] == "jacobian"
    last = [r for r in records if r["position"] == expected["logit"].positions[-1]]
    assert all(r["next_token_rank"] is None and r["ce_bits"] is None for r in last)
    first = records[0]
    assert first["kl_bits"] == float(expected["logit"].kl_bits[0, 0])  # exact: the shortest repr round-trips
    opened = load_readings(saved)
    assert opened.lenses["jacobian"]["origin"] == cli_files["lens_path"]
    for name, reading in expected.items():
        assert_same_reading(opened.readings[name], reading)

    assert main(_inspect(cli_files, "--format", "csv")) == 0
    text = capsys.readouterr().out
    table = pd.read_csv(io.StringIO(text))
    assert len(table) == n_cells and list(table.columns[:3]) == ["lens", "layer", "position"]
    frame = expected["jacobian"].frame
    rows = table[table["lens"] == "jacobian"].reset_index(drop=True)
    assert rows["top_ids"].map(json.loads).tolist() == frame["top_ids"].tolist()
    assert rows["top_tokens"].map(json.loads).tolist() == frame["top_tokens"].tolist()
    assert np.array_equal(rows["kl_bits"].to_numpy(), frame["kl_bits"].to_numpy())
    assert rows["next_token_rank"].isna().sum() == expected["jacobian"].n_layers  # the last position
    assert rows["fitted"].tolist() == frame["fitted"].tolist()
    assert rows["rank_a"].tolist() == frame["rank_a"].tolist()
    assert len(list(csv.reader(io.StringIO(text)))) == n_cells + 1


def test_cli_generate_keeps_stdout_data_and_saves_the_generation(cli_files, capsys):
    saved = cli_files["root"] / "gen.jlens.json"
    assert main(_inspect(cli_files, "--generate", "4", "--no-progress", "--format", "csv", "--save", str(saved))) == 0
    out = capsys.readouterr()
    assert "continuation (4 tokens" in out.err and "continuation" not in out.out
    table = pd.read_csv(io.StringIO(out.out))
    opened = load_readings(saved)
    assert (table["segment"] == "generated").sum() == 4 * sum(r.n_layers for r in opened.readings.values())
    assert opened.generation is not None and opened.generation.n_generated == 4
    assert opened.readings["logit"].n_generated == 4


def test_cli_table_shows_each_lens(cli_files, capsys):
    assert main(_inspect(cli_files, "--last", "3")) == 0
    out = capsys.readouterr().out
    assert "· logit lens ·" in out and "· jacobian lens ·" in out
    assert out.count("   out ") == 2
