"""reading/singular_directions: a lens matrix's singular directions decoded into tokens through the unembedding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import random_lens

from jlens_core.reading.singular_directions import DIRECTION_COLUMNS, top_directions
from jlens_core.reading.tokens import TokenDisplay


def test_top_directions_decode_through_unembedding(llama):
    model = llama
    lens = random_lens(d=model.d_model, eye=0, noise=1 / math.sqrt(model.d_model), n_prompts=3)
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

