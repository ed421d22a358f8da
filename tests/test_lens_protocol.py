"""The lens interface (jlens_core.lenses.protocol): every lens kind implements Lens, and its transport
agrees with its matrix; the protocol is importable without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import random_lens, tiny

from jlens_core import JacobianLens, LensFileError, LogitLens, TunedLens
from jlens_core.lenses.protocol import FittedLens, Lens

D, TARGET = 8, 3


def tuned_lens() -> TunedLens:
    gen = torch.Generator().manual_seed(1)
    return TunedLens({layer: (torch.randn(D, D, generator=gen), torch.randn(D, generator=gen))
                      for layer in range(TARGET)}, D, target_layer=TARGET)


def all_lenses() -> dict[str, Lens]:
    return {"logit": LogitLens(TARGET + 1, D),
            "jacobian": random_lens(d=D, eye=0, noise=1.0, n_prompts=3),
            "jacobian shrunk": random_lens(d=D, eye=0, noise=1.0, n_prompts=3).with_shrinkage(0.25),
            "tuned": tuned_lens()}


def expected_matrix(lens: Lens, layer: int) -> torch.Tensor:
    """The linear part of ``lens``'s transport at a source layer, formed from its parts (not ``matrix``)."""
    eye = torch.eye(D)
    if isinstance(lens, JacobianLens):
        return (1 - lens.shrinkage) * lens.jacobians[layer] + lens.shrinkage * eye
    if isinstance(lens, TunedLens):
        return eye + lens.translators[layer][0]
    return eye


@pytest.mark.parametrize("name", list(all_lenses()))
def test_every_lens_kind_is_a_lens(name):
    lens = all_lenses()[name]
    assert isinstance(lens, Lens)
    assert isinstance(lens, FittedLens) == (lens.kind != "logit")  # the logit lens has no file
    assert lens.layers == lens.source_layers + [lens.target_layer] == list(range(TARGET + 1))
    assert lens.d_model == D and lens.n_layers == TARGET + 1
    assert lens.skip_first is None or isinstance(lens.skip_first, int)


@pytest.mark.parametrize("name", list(all_lenses()))
def test_transport_agrees_with_matrix(name):
    lens = all_lenses()[name]
    h = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(2))
    for layer in lens.source_layers:
        mat = lens.matrix(layer)
        assert mat.shape == (D, D) and mat.dtype == torch.float32
        torch.testing.assert_close(mat, expected_matrix(lens, layer))
        # transport is affine (the tuned lens adds b_l): its linear part is h @ M^T
        linear = lens.transport(h, layer) - lens.transport(torch.zeros(D), layer)
        torch.testing.assert_close(linear, h @ mat.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(lens.transport(h, lens.target_layer), h)  # the model's output: the identity


def test_logit_lens_matrix_and_model_check():
    lens = LogitLens(TARGET + 1, D)
    with pytest.raises(KeyError, match="reads layers 0..3"):
        lens.matrix(TARGET + 1)
    model = tiny()
    LogitLens.for_model(model).check_model(model)
    with pytest.raises(LensFileError, match="LogitLens.for_model"):
        LogitLens(model.n_layers + 1, model.d_model).check_model(model)


def test_lens_comes_from_the_front_door_without_torch():
    code = ("import sys, jlens_core; from jlens_core.lenses.protocol import Lens; "
            "assert jlens_core.Lens is Lens; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_kind_reads_through_one_readout():
    """``lens.logits(model, h, layer)`` is the model's output head (final norm, lm_head, taken from the HF
    model itself) applied to the lens's transport, formed from its parts, for every kind; and the stacked
    readout over several layers agrees with it row by row."""
    from jlens_core.lenses.readout import layer_logits

    model = tiny()
    d, top = model.d_model, model.n_layers - 1
    gen = torch.Generator().manual_seed(3)
    tuned = TunedLens({layer: (0.1 * torch.randn(d, d, generator=gen), 0.1 * torch.randn(d, generator=gen))
                       for layer in range(top)}, d, target_layer=top)
    head = model.hf_model.lm_head
    norm = model.hf_model.model.norm
    h = torch.randn(4, d, generator=gen)
    for lens in (LogitLens.for_model(model), random_lens(model, noise=0.5), tuned):
        for layer in lens.source_layers:
            if isinstance(lens, TunedLens):
                a, b = lens.translators[layer]
                carried = h + h @ a.T + b
            elif isinstance(lens, JacobianLens):
                carried = h @ lens.jacobians[layer].T
            else:
                carried = h
            with torch.no_grad():
                expected = head(norm(carried))
                got = lens.logits(model, h, layer)
            assert got.shape == (4, model.vocab_size)
            torch.testing.assert_close(got.float(), expected.float(), rtol=1e-4, atol=1e-4)
        resid = {layer: torch.randn(6, d, generator=gen) for layer in lens.source_layers}
        with torch.no_grad():
            stacked = layer_logits(lens, model, resid, lens.source_layers, [1, 4])  # [L, 2, vocab]
            for i, layer in enumerate(lens.source_layers):
                torch.testing.assert_close(stacked[i], lens.logits(model, resid[layer][[1, 4]], layer))
