"""The J-space's structure by layer over a corpus (docs/method.md §11.6): explained fraction and occupancy, J beside
its controls, raw and centred gauges, with bootstrap intervals; and the MLP gain of J-lens vectors against MLP
neuron directions.

**Residuals**: each text is read once (truncated to ``max_seq_len`` tokens); ``per_text`` positions are drawn
(seeded) from those at or after the lens's ``skip_first`` (at least 1: position 0 is an attention sink), and the
same positions are decomposed at every layer.

**Per layer and gauge**: the median over residuals of the explained fraction (J, random dictionary, shuffled
dictionary), of the occupancy (active atoms at ``k``) and of the smallest number of steps reaching 90 % of the
``k``-step fit (J and random), each with a 95 % percentile bootstrap interval (``n_boot`` resamples of the residuals,
seeded).

**MLP gain** (the paper's definition): for a unit direction ``u`` defined at layer ``l``, ``||MLP_{l+1}(norm(s u))||``
(layer ``l + 1``'s MLP block with its own pre-MLP norm; ``s`` the median residual norm at layer ``l``, so the norm's
``eps`` acts as on real residuals) divided by the median of the same over isotropic Gaussian directions. Two sets of
``n_directions`` directions: J-lens vectors (raw atoms ``v_t`` of tokens drawn uniformly, seeded) and the
output-weight directions of layer ``l``'s MLP neurons (columns of its down projection, drawn uniformly).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn

from .._keywords import checked_options
from ..interventions.read_directions import check_layers
from ..lenses.protocol import Lens, recorded_skip_first
from ..models.layouts import get_path
from ..models.model import LensModel
from ..reading.inputs import record_residuals
from ..seeds import generator, unit_directions
from .decompose import DEFAULT_K, check_k, decompose
from .dictionary import GAUGES, jspace

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger(__name__)

PRE_MLP_NORMS = ("post_attention_layernorm", "ln_2", "pre_feedforward_layernorm")
DOWN_PROJECTIONS = ("down_proj", "c_proj", "dense_4h_to_h", "fc2")


@dataclass(frozen=True)
class Structure:
    """What :func:`jspace_structure` measured.

    Attributes:
        rows: one dict per (layer, gauge): ``layer, gauge, n`` and, for each of ``explained``, ``random_explained``,
            ``shuffled_explained``, ``occupancy``, ``steps90``, ``random_steps90``, its median and ``_lo`` / ``_hi``
            (95 % bootstrap interval).
        mlp_gain: one dict per layer: ``layer``, ``jlens_gain`` and ``neuron_gain`` (medians over the directions) with
            their quartiles (``_q1``, ``_q3``); empty when not measured.
        settings: how it was measured (model, lens kind, k, method, counts, seed).
    """

    rows: list[dict[str, Any]]
    mlp_gain: list[dict[str, Any]]
    settings: dict[str, Any] = field(default_factory=dict)

    def frame(self):
        """``rows`` as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def mlp_frame(self):
        import pandas as pd

        return pd.DataFrame(self.mlp_gain)


def bootstrap_median(values: torch.Tensor, n_boot: int, gen: torch.Generator) -> tuple[float, float, float]:
    """``(median, 2.5 %, 97.5 %)`` of the medians of ``n_boot`` resamples (with replacement) of ``values [n]``."""
    v = values.double().reshape(-1)
    if v.numel() == 0:
        return math.nan, math.nan, math.nan
    idx = torch.randint(0, v.numel(), (int(n_boot), v.numel()), generator=gen)
    medians = v[idx].median(dim=1).values
    lo, hi = torch.quantile(medians, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(v.median()), float(lo), float(hi)


def sample_residuals(model: LensModel, texts: Sequence[str], layers: Sequence[int], *, per_text: int,
                     skip_first: int, max_seq_len: int, seed: int) -> dict[int, torch.Tensor]:
    """``{layer: float32[n, d_model]}``: ``per_text`` positions per text (module docstring), the same at every layer.

    Raises:
        ValueError: no text long enough to give a position.
    """
    gen = generator(seed)
    out: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    for text in texts:
        ids = model.encode(text, max_length=int(max_seq_len))
        seq = int(ids.shape[-1])
        start = max(1, int(skip_first))
        if seq <= start:
            continue
        pick = torch.randperm(seq - start, generator=gen)[: int(per_text)] + start
        recorded = record_residuals(model, ids, layers)
        for layer in layers:
            out[layer].append(recorded[layer][pick.sort().values].float().cpu())
    if not out[layers[0]]:
        raise ValueError(f"No text is longer than {max(1, int(skip_first))} tokens: give longer texts.")
    return {layer: torch.cat(rows) for layer, rows in out.items()}


def _mlp_parts(model: LensModel, layer: int) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """``(pre-MLP norm, MLP, output directions [ff, d])`` of decoder layer ``layer``.

    Raises:
        ValueError: a layer whose MLP, pre-MLP norm or down projection is not where the known families keep it.
    """
    block = model.layers[int(layer)]
    mlp_path = model.layout.mlp
    mlp = get_path(block, mlp_path) if mlp_path else None
    norm = next((get_path(block, name) for name in PRE_MLP_NORMS if get_path(block, name) is not None), None)
    down = next((get_path(mlp, name) for name in DOWN_PROJECTIONS if mlp is not None and get_path(mlp, name)
                 is not None), None)
    if mlp is None or norm is None or down is None or not hasattr(down, "weight"):
        raise ValueError(f"The MLP gain needs layer {layer}'s MLP, its pre-MLP norm and its down projection; "
                         f"{model.name!r} (layout {model.layout.name!r}) keeps them elsewhere.")
    weight = down.weight.detach().float().cpu()
    d = int(model.d_model)
    directions = weight.T if weight.shape[0] == d else weight  # Linear [d, ff] -> rows [ff, d]; Conv1D is [ff, d]
    return norm, mlp, directions


def _mlp_output_norms(norm: nn.Module, mlp: nn.Module, u: torch.Tensor, scale: float) -> torch.Tensor:
    param = next(mlp.parameters())
    with torch.no_grad():
        x = (u / u.norm(dim=-1, keepdim=True) * scale).to(device=param.device, dtype=param.dtype)[None]
        out = mlp(norm(x))
        out = out[0] if isinstance(out, tuple) else out
    return out[0].float().norm(dim=-1).cpu()


def mlp_gain(model: LensModel, lens: Lens, layer: int, *, n_directions: int = 2000, scale: float | None = None,
             seed: int = 0) -> dict[str, float]:
    """The MLP gain at ``layer`` (module docstring): ``{"jlens_gain", "neuron_gain"}`` medians and quartiles.

    Raises:
        ValueError: ``layer`` is the last layer (no layer ``l + 1``), outside the lens, or the MLP is not found.
    """
    if int(layer) + 1 >= int(model.n_layers):
        raise ValueError(f"Layer {layer} is the last: the MLP gain reads layer {int(layer) + 1}'s MLP.")
    space = jspace(model, lens, layer, gauge="raw")
    norm, mlp, _ = _mlp_parts(model, int(layer) + 1)
    _, _, neurons = _mlp_parts(model, int(layer))
    gen = generator(seed)
    scale = float(math.sqrt(model.d_model)) if scale is None else float(scale)
    ids = torch.randperm(space.n_atoms, generator=gen)[: int(n_directions)]
    atoms = space.atoms(space.token_ids[ids])
    atoms = atoms[atoms.norm(dim=-1) > 0]
    pick = torch.randperm(neurons.shape[0], generator=gen)[: int(n_directions)]
    neuron_dirs = neurons[pick]
    neuron_dirs = neuron_dirs[neuron_dirs.norm(dim=-1) > 0]
    iso = unit_directions(int(n_directions), int(model.d_model), gen)
    base = float(_mlp_output_norms(norm, mlp, iso, scale).median())
    j = _mlp_output_norms(norm, mlp, atoms, scale) / base
    nrn = _mlp_output_norms(norm, mlp, neuron_dirs, scale) / base
    q = torch.tensor([0.25, 0.5, 0.75])
    jq, nq = torch.quantile(j, q).tolist(), torch.quantile(nrn, q).tolist()
    return {"layer": int(layer), "jlens_gain": jq[1], "jlens_gain_q1": jq[0], "jlens_gain_q3": jq[2],
            "neuron_gain": nq[1], "neuron_gain_q1": nq[0], "neuron_gain_q3": nq[2]}


class StructureKeywords(TypedDict, total=False):
    """:func:`jspace_structure`'s further keywords (its Args): positions per text, the truncation, bootstrap
    resamples, the MLP gain's directions, the seed."""

    per_text: int
    max_seq_len: int
    n_boot: int
    mlp_directions: int
    seed: int


def jspace_structure(model: LensModel, lens: Lens, texts: Sequence[str], *, layers: Iterable[int] | None = None,
                     k: int = DEFAULT_K, method: str = "gradient_pursuit", gauges: Sequence[str] = GAUGES,
                     progress: Callable[[str], None] | None = None,
                     **options: Unpack[StructureKeywords]) -> Structure:
    """The J-space's structure by layer over ``texts`` (module docstring; docs/method.md §11.6).

    Args:
        model, lens: the model and the lens whose J-space is measured.
        texts: the corpus (each read once, truncated to ``max_seq_len`` tokens).
        layers: source layers (default: every layer the lens reads below its target).
        k, method: the decomposition.
        gauges: ``("centred", "raw")`` or one of them.
        per_text: positions drawn per text.
        n_boot: bootstrap resamples.
        mlp_directions: directions per set for the MLP gain (0: not measured).
        seed: residual positions, controls, bootstrap and MLP directions.
        progress: called with a line per layer done.

    ``per_text``, ``max_seq_len``, ``n_boot``, ``mlp_directions`` and ``seed`` are :class:`StructureKeywords`, by
    keyword.

    Raises:
        ValueError: no text, a layer outside the lens, ``k`` out of range, an unknown gauge.
        TypeError: a keyword that is none of these.
    """
    given = checked_options("jspace_structure", options, StructureKeywords)
    per_text: int = given.get("per_text", 3)
    max_seq_len: int = given.get("max_seq_len", 64)
    n_boot: int = given.get("n_boot", 1000)
    mlp_directions: int = given.get("mlp_directions", 2000)
    seed: int = given.get("seed", 0)
    if not texts:
        raise ValueError("No texts: give a corpus of at least one text.")
    chosen = check_layers(model, lens, lens.source_layers if layers is None else layers)
    for gauge in gauges:
        if gauge not in GAUGES:
            raise ValueError(f"gauge={gauge!r} is not a J-space gauge: use 'centred' or 'raw'.")
    check_k(k, int(model.d_model))
    skip = int(recorded_skip_first(lens) or 1)
    residuals = sample_residuals(model, texts, chosen, per_text=per_text, skip_first=skip, max_seq_len=max_seq_len,
                                 seed=seed)
    gen = generator(seed, 2)
    rows: list[dict[str, Any]] = []
    gains: list[dict[str, Any]] = []
    for layer in chosen:
        x = residuals[layer]
        for gauge in gauges:
            dec = decompose(model, lens, x, layer, k=k, method=method, gauge=gauge, seed=seed)
            row: dict[str, Any] = {"layer": layer, "gauge": gauge, "n": dec.n}
            measures = {"explained": dec.explained, "random_explained": dec.random_explained,
                        "shuffled_explained": dec.shuffled_explained, "occupancy": dec.occupancy.float(),
                        "steps90": dec.steps_to(0.9).float(), "random_steps90": dec.steps_to(0.9, control=True).float()}
            for name, values in measures.items():
                row[name], row[f"{name}_lo"], row[f"{name}_hi"] = bootstrap_median(values, n_boot, gen)
            rows.append(row)
        if mlp_directions and layer + 1 < model.n_layers:
            gains.append(mlp_gain(model, lens, layer, n_directions=mlp_directions,
                                  scale=float(x.norm(dim=-1).median()), seed=seed))
        if progress is not None:
            done = [r for r in rows if r["layer"] == layer]
            progress(f"layer {layer}: " + ", ".join(f"{r['gauge']} J {r['explained']:.3f} vs random "
                                                    f"{r['random_explained']:.3f}" for r in done))
    settings = {"model": model.name, "lens_kind": str(lens.kind), "k": k, "method": method, "n_texts": len(texts),
                "per_text": per_text, "max_seq_len": max_seq_len, "n_boot": n_boot, "mlp_directions": mlp_directions,
                "seed": seed, "skip_first": skip, "n_residuals_per_layer": int(residuals[chosen[0]].shape[0])}
    return Structure(rows=rows, mlp_gain=gains, settings=settings)


__all__ = ["Structure", "StructureKeywords", "bootstrap_median", "jspace_structure", "mlp_gain", "sample_residuals"]
