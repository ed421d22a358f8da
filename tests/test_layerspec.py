"""Layer lists: the one normalisation (normalise_layers, resolve_layers) and the command-line layer spec."""

from __future__ import annotations

import pytest

from jlens_core.layerspec import check_layer_spec, normalise_layers, parse_layer_spec, resolve_layers

# -- normalise_layers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("layers", "kwargs", "expected"), [
    (None, {}, [0, 1, 2, 3, 4, 5]),
    ([3, 1, 1, 0], {}, [0, 1, 3]),
    ([-1, -6, 2], {}, [0, 2, 5]),
    ((x for x in (4, -2)), {}, [4]),  # an iterator, read once; -2 of 6 is 4
    (None, {"below": 3}, [0, 1, 2]),
    ([-4, 0], {"below": 3}, [0, 2]),
])
def test_normalise_layers(layers, kwargs, expected):
    assert normalise_layers(layers, 6, **kwargs) == expected


@pytest.mark.parametrize(("layers", "kwargs", "message"), [
    ([6], {}, r"^Layer 6 is out of range: the model has 6 layers \(valid: -6\.\.5\)\.$"),
    ([0, -7], {}, r"^Layer -7 is out of range"),
    ([], {}, r"list of layers is empty"),
    ([1, 3], {"below": 3}, r"^Layer 3 \(= 3\) is not below the target layer 3"),
    ([-1], {"below": 2, "name": "source layer"}, r"^source layer -1 \(= 5\) is not below the target layer 2"),
    (None, {"below": 0}, r"the target layer 0 leaves no layer below it"),
])
def test_normalise_layers_errors_name_the_value(layers, kwargs, message):
    with pytest.raises(ValueError, match=message):
        normalise_layers(layers, 6, **kwargs)


def test_normalise_layers_rejects_a_bad_depth():
    with pytest.raises(ValueError, match="n_layers must be a positive integer, not 0"):
        normalise_layers([0], 0)


def test_resolve_layers_defaults_and_errors():
    assert resolve_layers(4) == ([0, 1, 2], 3)
    assert resolve_layers(4, iter([-2, 1, 1, 0]), -1) == ([0, 1, 2], 3)
    assert resolve_layers(4, None, -2) == ([0, 1], 2)
    with pytest.raises(ValueError, match="source_layers is empty"):
        resolve_layers(4, iter([]))
    with pytest.raises(ValueError, match="target_layer=0 leaves no layer below it"):
        resolve_layers(4, None, 0)
    with pytest.raises(ValueError, match=r"target_layer=4 is out of range"):
        resolve_layers(4, [0], 4)


# -- layer specs -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "expected"), [
    ("0,4,8", [0, 4, 8]), ("8, 4,0,4", [0, 4, 8]), ("0:4", [0, 1, 2, 3]), ("0:12:4", [0, 4, 8]),
    ("-1", [11]), ("-2:", [10, 11]), (":3", [0, 1, 2]), ("::5", [0, 5, 10]), ("all", list(range(12))),
    ("ALL", list(range(12))), ("0:12", list(range(12))), ("1,-1,9:11", [1, 9, 10, 11]),
])
def test_parse_layer_spec(spec, expected):
    assert parse_layer_spec(spec, 12) == expected


@pytest.mark.parametrize(("spec", "message"), [
    ("", "empty"), ("0,,4", "empty part"), ("12", "Layer 12 .* out of range"), ("-13", "out of range"),
    ("x", "'x' is not an integer"), ("0:13", "stop 13 .* out of range"), ("5:2", "selects no layer"),
    ("0:4:0", "step 0 must be a positive"), ("0:4:-1", "positive"), ("1:2:3:4", "more than two"),
    ("1-3", "'1-3' is not an integer"),
])
def test_parse_layer_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_layer_spec(spec, 12)


def test_check_layer_spec_syntax_only():
    check_layer_spec("0:100,-50")  # range is checked later, against the model
    with pytest.raises(ValueError, match="'a' is not an integer"):
        check_layer_spec("0,a")
