"""Helpers shared by the tests: cached tiny models, lenses built by hand, references computed from HF.

Fixtures live in ``conftest.py`` (``llama`` is ``tiny("llama")``); these are plain functions.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from conftest import make_tiny

from jlens_core import JacobianLens

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str) -> ModuleType:
    """The repository's script or benchmark at ``path`` (relative to the repository root, e.g.
    ``"scripts/merge_eval.py"``) imported as a module, for testing its functions: scripts are not a package."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def tiny(family: str = "llama", seed: int = 0, **kwargs):
    """``make_tiny(family, seed=seed, **kwargs)``, built once per session: do not modify it (use
    ``make_tiny`` for a model a test changes)."""
    return make_tiny(family, seed=seed, **kwargs)


def _model_fields(model) -> dict:
    return {"d_model": model.d_model, "target_layer": model.n_layers - 1, "n_layers": model.n_layers,
            "model_name": model.name, "model_fingerprint": model.fingerprint()}


def identity_lens(model, layers=None, **kwargs) -> JacobianLens:
    """A Jacobian lens of ``model`` whose matrices are the identity (reads as the logit lens);
    ``layers`` defaults to every layer but the last."""
    layers = range(model.n_layers - 1) if layers is None else layers
    return JacobianLens({layer: torch.eye(model.d_model) for layer in layers}, n_prompts=1,
                        **_model_fields(model), **kwargs)


def random_lens(model=None, layers=None, *, d: int | None = None, seed: int = 0, eye: float = 1.0,
                noise: float = 0.3, n_prompts: int = 1, **kwargs) -> JacobianLens:
    """A Jacobian lens with matrices ``eye * I + noise * N(0, 1)`` (a seeded generator, layers in order).

    With ``model``: its width and depth, name and fingerprint; ``layers`` defaults to every layer but the
    last. Without: ``d`` wide, ``layers`` (default 0, 1, 2) and ``target_layer = max(layers) + 1``.
    """
    gen = torch.Generator().manual_seed(seed)
    if model is not None:
        layers = range(model.n_layers - 1) if layers is None else layers
        fields = _model_fields(model)
    else:
        layers = (0, 1, 2) if layers is None else layers
        fields = {"d_model": d, "target_layer": max(layers) + 1}
    width = fields["d_model"]
    mats = {}
    for layer in layers:
        mat = noise * torch.randn(width, width, generator=gen)
        mats[layer] = eye * torch.eye(width) + mat if eye else mat
    return JacobianLens(mats, n_prompts=n_prompts, **(fields | kwargs))


def reference_logits(model, ids) -> list[torch.Tensor]:
    """Logit-lens logits ``[seq, vocab]`` per layer, from HF's own hidden states and output.

    ``hidden_states[l + 1]`` is layer ``l``'s output for every layer but the last, whose entry HF
    stores after the final norm; the last layer's logits are the model's own output.
    """
    hf = model.hf_model
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        logits = [hf.lm_head(model.final_norm(out.hidden_states[layer + 1][0])).float()
                  for layer in range(model.n_layers - 1)]
        logits.append(out.logits[0].float())
    return logits


def rel_frob(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b||_F / ||b||_F`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cli_fit_cache(work: dict, fit_args: Callable[..., list[str]]) -> Callable[[int], JacobianLens]:
    """``get(n) -> JacobianLens``: one uninterrupted in-process ``jlens fit`` of the first ``n`` prompts per ``n``
    (``fit_args(work, out, *extra)`` gives its arguments), written under ``work["root"]`` and cached."""
    from jlens_core.cli.main import main

    cache: dict[int, JacobianLens] = {}

    def get(n: int) -> JacobianLens:
        if n not in cache:
            out = work["root"] / f"reference-{n}.safetensors"
            assert main(fit_args(work, out, "--n-prompts", str(n))) == 0
            cache[n] = JacobianLens.load(out)
        return cache[n]

    return get
