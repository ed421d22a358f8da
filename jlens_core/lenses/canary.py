"""The lens check: is this lens still the lens of this model? (docs/method.md §4.2).

A lens is a property of one model's weights *and* of the code that ran them: a transformers release
that changes an attention function, a norm's epsilon or a rope scaling silently changes the residuals
a lens reads, and its matrices stop matching (a published lens read 4-6 % off that way). At fit time
a lens stores a **forward canary**: for a short fixed text (:data:`CANARY_TEXT`, its token ids kept),

* every layer's residual at a few positions (``canary.residuals``, ``[n_layers, n_positions, d_model]``);
* the Jacobian from the lens's first source layer to its target on a few seeded probe vectors
  (``canary.probes`` ``[n_probes, d_model]`` and ``canary.jacobian`` ``[n_probes, n_positions, d_model]``:
  ``u^T d(sum_p h_T[p]) / d h_s[q]`` at the canary positions ``q``);
* the L2 norm of every parameter (``canary.param_norms``, float64, names in the metadata): the weights
  fingerprint;
* the model's dtype and the transformers / torch / jlens versions.

:func:`check_lens` recomputes the canary with the model at hand and compares part by part, with a
relative tolerance that depends on the dtypes (:func:`tolerances`): the first part that changed, the
first layer where it did and by how much, with the versions then and now. The tensors go in the lens
file under the prefix ``canary.`` and the rest under the header key ``jlens_canary`` (JSON), beside
the lens's own; a file without them is reported as having no canary (``jlens check --write-canary``
adds one, leaving every other tensor bit for bit).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._atomic import atomic_write
from .._version import __version__
from ..seeds import generator

if TYPE_CHECKING:
    from ..models.model import LensModel
    from .protocol import Lens

log = logging.getLogger(__name__)

CANARY_TEXT = "The capital of France is Paris, and the river that runs through it is the Seine."
CANARY_POSITIONS = 4  # positions kept, spread over the text (the last one included)
CANARY_PROBES = 4  # seeded probe vectors for the Jacobian
CANARY_SEED = 0
TENSOR_PREFIX = "canary."
META_KEY = "jlens_canary"
CANARY_VERSION = 1
PARTS = ("tokenizer", "weights fingerprint", "residuals", "Jacobian")


@dataclass(eq=False)
class Canary:
    """A lens's forward canary (docs/method.md §4.2).

    Attributes:
        token_ids: the canary text's token ids when it was made (the recomputation runs these ids).
        positions: the positions kept.
        residuals: ``float32[n_layers, n_positions, d_model]``, every layer's output residual there.
        source_layer / target_layer: the Jacobian's layers.
        probes: ``float32[n_probes, d_model]`` unit vectors (seeded).
        jacobian: ``float32[n_probes, n_positions, d_model]``: ``u^T d(sum_p h_T[p]) / d h_s[q]``.
        param_names / param_layers / param_norms: every parameter's name, its decoder layer (None: outside
            the layers) and L2 norm (``float64[n_params]``).
        dtype: the model's dtype then; versions: ``{transformers, torch, jlens}`` then; model_name; text.
        seconds: how long making it took.
    """

    token_ids: list[int]
    positions: list[int]
    residuals: torch.Tensor
    source_layer: int
    target_layer: int
    probes: torch.Tensor
    jacobian: torch.Tensor
    param_names: list[str]
    param_layers: list[int | None]
    param_norms: torch.Tensor
    dtype: str
    versions: dict[str, str]
    model_name: str = ""
    text: str = CANARY_TEXT
    seconds: float = 0.0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a lens file stores, named with the ``canary.`` prefix."""
        return {f"{TENSOR_PREFIX}residuals": self.residuals.float().contiguous(),
                f"{TENSOR_PREFIX}probes": self.probes.float().contiguous(),
                f"{TENSOR_PREFIX}jacobian": self.jacobian.float().contiguous(),
                f"{TENSOR_PREFIX}param_norms": self.param_norms.double().contiguous()}

    def metadata(self) -> dict[str, Any]:
        """What the header's ``jlens_canary`` JSON holds."""
        return {"version": CANARY_VERSION, "text": self.text, "token_ids": list(self.token_ids),
                "positions": list(self.positions), "source_layer": self.source_layer,
                "target_layer": self.target_layer, "param_names": list(self.param_names),
                "param_layers": list(self.param_layers), "dtype": self.dtype, "versions": dict(self.versions),
                "model_name": self.model_name, "seconds": round(float(self.seconds), 3)}

    @classmethod
    def from_file_parts(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Canary:
        """The canary from a file's ``canary.*`` tensors and ``jlens_canary`` metadata.

        Raises:
            KeyError: a part is missing.
        """
        return cls(token_ids=[int(x) for x in meta["token_ids"]], positions=[int(x) for x in meta["positions"]],
                   residuals=tensors[f"{TENSOR_PREFIX}residuals"].float(),
                   source_layer=int(meta["source_layer"]), target_layer=int(meta["target_layer"]),
                   probes=tensors[f"{TENSOR_PREFIX}probes"].float(),
                   jacobian=tensors[f"{TENSOR_PREFIX}jacobian"].float(),
                   param_names=[str(n) for n in meta["param_names"]],
                   param_layers=[None if x is None else int(x) for x in meta["param_layers"]],
                   param_norms=tensors[f"{TENSOR_PREFIX}param_norms"].double(), dtype=str(meta["dtype"]),
                   versions={str(k): str(v) for k, v in meta["versions"].items()},
                   model_name=str(meta.get("model_name", "")), text=str(meta.get("text", CANARY_TEXT)),
                   seconds=float(meta.get("seconds", 0.0)))


# Token ids for a model without a tokenizer (prime stride over the vocabulary, as many as the text's tokens).
CANARY_FALLBACK_TOKENS = 19


def versions() -> dict[str, str]:
    """The transformers, torch and jlens versions running now."""
    try:
        import transformers

        tf_version = str(transformers.__version__)
    except ImportError:  # a model adapter without transformers
        tf_version = "none"
    return {"transformers": tf_version, "torch": str(torch.__version__), "jlens": __version__}


def _positions(n_tokens: int, count: int = CANARY_POSITIONS) -> list[int]:
    """``count`` positions spread over ``n_tokens`` (the last included, position 0 left out: a BOS
    token's residual is large and says little about the layers)."""
    if n_tokens <= 1:
        return [0]
    picks = {max(1, round(n_tokens * (i + 1) / count) - 1) for i in range(count)}
    return sorted(p for p in picks if p < n_tokens)


def _param_fingerprint(model: LensModel) -> tuple[list[str], list[int | None], torch.Tensor]:
    """Every parameter's name, decoder layer and float64 L2 norm (meta-device parameters left out)."""
    owner = {id(p): i for i, block in enumerate(model.layers) for p in block.parameters()}
    names: list[str] = []
    layers: list[int | None] = []
    norms: list[float] = []
    for name, param in model.hf_model.named_parameters():
        if param.device.type == "meta":
            continue
        names.append(name)
        layers.append(owner.get(id(param)))
        norms.append(float(torch.linalg.vector_norm(param.detach(), dtype=torch.float64)))  # float64 sums: fp32's
        # drift by ~1e-3 on a 28M-element embedding, and differently by device
    return names, layers, torch.tensor(norms, dtype=torch.float64)


def _forward_parts(model: LensModel, ids: torch.Tensor, positions: list[int], source: int, target: int,
                   probes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residuals [n_layers, n_pos, d], jacobian [n_probes, n_pos, d])`` of ``ids`` (``[1, seq]``), fp32 CPU."""
    from ..models.recorder import ActivationRecorder

    layers = list(range(model.n_layers))
    with torch.no_grad(), ActivationRecorder(model.layers, layers) as rec:
        model.forward(ids)
    pos = torch.tensor(positions, dtype=torch.long)
    residuals = torch.stack([rec.activations[layer][0].float().cpu()[pos] for layer in layers])  # [L, P, d]
    with torch.enable_grad(), ActivationRecorder(model.layers, [source, target], start_graph_at=source,
                                                 stop_after=target) as grad_rec:
        model.forward(ids)
    h_source, h_target = grad_rec.activations[source], grad_rec.activations[target]  # [1, seq, d] each
    summed = h_target[0].float().sum(dim=0)  # [d]: sum over positions of the target residual
    rows = []
    for j in range(probes.shape[0]):
        u = probes[j].to(device=summed.device)
        (grad,) = torch.autograd.grad(summed @ u, h_source, retain_graph=j + 1 < probes.shape[0])
        rows.append(grad[0].float().cpu()[pos])  # [P, d]
    return residuals, torch.stack(rows)


def make_canary(model: LensModel, lens: Lens | None = None, *, source_layer: int | None = None,
                target_layer: int | None = None) -> Canary:
    """Make the forward canary of ``model`` (for ``lens``: its first source layer and its target).

    Args:
        model: the model the lens was fitted on, as it is now.
        lens: takes the Jacobian's layers from it (default: layer 0 to the model's last layer).
        source_layer / target_layer: override them.

    Returns:
        A :class:`Canary` (a few hundred kB on a 135M model: 30 layers x 4 positions x 576 floats).

    Raises:
        ValueError: a source layer at or above the target.
    """
    t0 = time.perf_counter()
    target = int(target_layer if target_layer is not None
                 else (lens.target_layer if lens is not None else model.n_layers - 1))
    source = int(source_layer if source_layer is not None
                 else (lens.source_layers[0] if lens is not None and lens.source_layers else 0))
    if not 0 <= source < target < model.n_layers:
        raise ValueError(f"The canary's Jacobian needs 0 <= source layer < target layer < {model.n_layers}; got "
                         f"{source} and {target}.")
    if getattr(model, "tokenizer", None) is not None:
        ids = model.encode(CANARY_TEXT)  # [1, seq]
    else:  # a model read from token ids alone: fixed ids stand in for the text (the check replays the stored ids)
        ids = (torch.arange(CANARY_FALLBACK_TOKENS) * 7919 % model.vocab_size).unsqueeze(0).to(model.device)  # [1, seq]
    positions = _positions(int(ids.shape[1]))
    gen = generator(CANARY_SEED)
    probes = torch.randn(CANARY_PROBES, model.d_model, generator=gen)
    probes = probes / probes.norm(dim=-1, keepdim=True)  # [n_probes, d] unit vectors
    residuals, jacobian = _forward_parts(model, ids, positions, source, target, probes)
    names, layers, norms = _param_fingerprint(model)
    return Canary(token_ids=ids[0].tolist(), positions=positions, residuals=residuals, source_layer=source,
                  target_layer=target, probes=probes, jacobian=jacobian, param_names=names, param_layers=layers,
                  param_norms=norms, dtype=str(model.dtype).replace("torch.", ""), versions=versions(),
                  model_name=str(model.name), seconds=time.perf_counter() - t0)


# -- checking ------------------------------------------------------------------------------------------------
def tolerances(dtype_then: str, dtype_now: str) -> dict[str, float]:
    """Relative tolerances per part. float32 on both sides: 1e-4 (summation order differs by thread count, BLAS
    and device: 0 for the residuals and 1.8e-6 for the Jacobian between 1 and 2 threads on the default model). A
    16-bit dtype on either side: the rounding itself moves them (the default model in bfloat16 against its
    float32 canary: residuals 1.8e-2, Jacobian 5.6e-2, weights' norms 2.3e-5), so 5e-2, 1.5e-1 and 2e-3: a coarse
    check, which still catches edited weights (check in float32 for small forward changes)."""
    wide = any(d in ("float16", "bfloat16") for d in (dtype_then, dtype_now))
    return {"weights fingerprint": 2e-3 if wide else 1e-4, "residuals": 5e-2 if wide else 1e-4,
            "Jacobian": 1.5e-1 if wide else 1e-4}


@dataclass
class PartCheck:
    """One part of the check.

    Attributes:
        part: ``"tokenizer"``, ``"weights fingerprint"``, ``"residuals"`` or ``"Jacobian"``.
        ok: within tolerance.
        difference: the largest relative difference (residuals: per layer, the largest over positions of
            ``||now - then|| / ||then||``; weights: per parameter ``|norm now - norm then| / norm then``).
        tolerance: the tolerance it was held to.
        first_layer: the first decoder layer over tolerance (None: none, or outside the layers).
        detail: what changed, in words.
    """

    part: str
    ok: bool
    difference: float
    tolerance: float
    first_layer: int | None = None
    detail: str = ""


@dataclass
class CheckResult:
    """What :func:`check_lens` returns.

    Attributes:
        status: ``"same"`` (still the lens of this model), ``"changed"`` or ``"no canary"``.
        message: one sentence saying so (the CLI prints it).
        parts: the :class:`PartCheck` of each part compared (empty without a canary).
        versions_then / versions_now: ``{transformers, torch, jlens}`` at fit time and now.
        dtype_then / dtype_now: the model's dtype then and now.
        seconds: how long the check took.
    """

    status: str
    message: str
    parts: list[PartCheck] = field(default_factory=list)
    versions_then: dict[str, str] = field(default_factory=dict)
    versions_now: dict[str, str] = field(default_factory=dict)
    dtype_then: str = ""
    dtype_now: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True unless the model changed (a lens without a canary is not a failure)."""
        return self.status != "changed"

    @property
    def exit_code(self) -> int:
        """``jlens check``'s exit status: 0 (same, or no canary) or 1 (changed)."""
        return 0 if self.ok else 1

    @property
    def failed(self) -> list[PartCheck]:
        """The parts over tolerance, in :data:`PARTS` order."""
        return [p for p in self.parts if not p.ok]


def _relative(now: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """``||now - then|| / ||then||`` over the last axis, float64."""
    now, then = now.double(), then.double()
    return (now - then).norm(dim=-1) / then.norm(dim=-1).clamp_min(1e-30)


def _layered_part(part: str, per_layer: torch.Tensor, tol: float, layer_names: list[int], what: str) -> PartCheck:
    """A part judged per layer: ``per_layer`` (``[n]``) relative differences of the layers ``layer_names``."""
    worst = float(per_layer.max()) if per_layer.numel() else 0.0
    over = [layer_names[i] for i in range(len(layer_names)) if float(per_layer[i]) > tol]
    if not over:
        return PartCheck(part, True, worst, tol)
    first = over[0]
    size = float(per_layer[layer_names.index(first)])
    return PartCheck(part, False, worst, tol, first,
                     f"{what} first differs at layer {first} (relative difference {size:.2g} > {tol:.0e})")


def _weights_part(canary: Canary, model: LensModel, tol: float) -> PartCheck:
    """The weights fingerprint compared on the parameters both sides could read (an offloaded parameter, on the
    meta device, is left out of a fingerprint); no parameter in common is a failure."""
    names, _, norms = _param_fingerprint(model)
    then = dict(zip(canary.param_names, canary.param_norms.tolist()))
    now = dict(zip(names, norms.tolist()))
    common = [name for name in canary.param_names if name in now]  # model order: the first changed is the lowest
    if not common:
        return PartCheck("weights fingerprint", False, float("inf"), tol, None,
                         f"no parameter name in common (then e.g. {canary.param_names[:2]}, now e.g. {names[:2]})")
    uncompared = len(set(then) ^ set(now))
    note = f"; {uncompared} parameter(s) on one side only, not compared" if uncompared else ""
    layer_of = dict(zip(canary.param_names, canary.param_layers))
    relative = {name: abs(now[name] - then[name]) / max(abs(then[name]), 1e-30) for name in common}
    changed = [(name, rel) for name, rel in relative.items() if rel > tol]
    worst = max(relative.values())
    if not changed:
        return PartCheck("weights fingerprint", True, worst, tol, None, note.lstrip("; "))
    in_layers = [(n, r) for n, r in changed if layer_of[n] is not None]
    name, rel = min(in_layers, key=lambda nr: layer_of[nr[0]]) if in_layers else changed[0]  # type: ignore[arg-type,return-value]
    layer = layer_of[name]
    where = f" (layer {layer})" if layer is not None else ""
    return PartCheck("weights fingerprint", False, worst, tol, layer,
                     f"{len(changed)} parameter(s) changed, first {name!r}{where}: its norm by {rel:.2%}{note}")


def _format_versions(v: Mapping[str, str]) -> str:
    return ", ".join(f"{k} {v.get(k, '?')}" for k in ("transformers", "torch", "jlens"))


def check_canary(model: LensModel, canary: Canary) -> CheckResult:
    """Recompute ``canary`` with ``model`` and compare it part by part (docs/method.md §4.2).

    Returns:
        A :class:`CheckResult` with status ``"same"`` or ``"changed"``.
    """
    t0 = time.perf_counter()
    dtype_now = str(model.dtype).replace("torch.", "")
    tol = tolerances(canary.dtype, dtype_now)
    ids = torch.tensor([canary.token_ids], dtype=torch.long, device=model.device)
    parts = []
    encoded = model.encode(canary.text)[0].tolist()
    parts.append(PartCheck("tokenizer", encoded == canary.token_ids, 0.0 if encoded == canary.token_ids else 1.0, 0.0,
                           None, "" if encoded == canary.token_ids else
                           f"the canary text now encodes to {len(encoded)} tokens, not the {len(canary.token_ids)} "
                           "it did (the residuals are compared on the stored ids)"))
    parts.append(_weights_part(canary, model, tol["weights fingerprint"]))
    residuals, jacobian = _forward_parts(model, ids, canary.positions, canary.source_layer, canary.target_layer,
                                         canary.probes)
    layers = list(range(min(len(residuals), len(canary.residuals))))
    if residuals.shape != canary.residuals.shape:
        parts.append(PartCheck("residuals", False, float("inf"), tol["residuals"], None,
                               f"the residuals have the shape {list(residuals.shape)}, not "
                               f"{list(canary.residuals.shape)}"))
    else:
        per_layer = _relative(residuals, canary.residuals).amax(dim=-1)  # [n_layers]: worst position
        parts.append(_layered_part("residuals", per_layer, tol["residuals"], layers, "the residual"))
    jac = _relative(jacobian, canary.jacobian).amax()  # worst probe and position
    jac_ok = bool(jac <= tol["Jacobian"])
    parts.append(PartCheck("Jacobian", jac_ok, float(jac), tol["Jacobian"], None if jac_ok else canary.source_layer,
                           "" if jac_ok else f"the Jacobian from layer {canary.source_layer} to {canary.target_layer} "
                           f"differs by {float(jac):.2g} (> {tol['Jacobian']:.0e})"))
    now = versions()
    result = CheckResult("same", "", parts, dict(canary.versions), now, canary.dtype, dtype_now,
                         time.perf_counter() - t0)
    name = str(model.name)
    if not result.failed:
        coarse = "" if canary.dtype == dtype_now == "float32" else f", a coarse check in {dtype_now}"
        result.message = (f"Still the lens of {name}: the canary's residuals, Jacobian and weights fingerprint agree "
                          f"(largest relative difference {max(p.difference for p in parts):.1e}{coarse}).")
        return result
    result.status = "changed"
    what = "; ".join(f"{p.part}: {p.detail}" for p in result.failed)
    dtypes = "" if canary.dtype == dtype_now else (f"; dtype then {canary.dtype}, now {dtype_now} (load the model "
                                                   "in float32 for a finer check)")
    result.message = (f"Not the lens of {name} as it is now: {what}. Versions then: {_format_versions(canary.versions)};"
                      f" now: {_format_versions(now)}{dtypes}.")
    return result


def lens_canary(lens: Lens) -> Canary | None:
    """The canary a lens carries (``lens.canary``), or None."""
    canary = getattr(lens, "canary", None)
    return canary if isinstance(canary, Canary) else None


def check_lens(model: LensModel, lens: Lens, *, lens_name: str = "LENS") -> CheckResult:
    """Is ``lens`` still the lens of ``model``? Recompute its forward canary and compare (docs/method.md §4.2).

    Args:
        model: the model as it is now (weights, transformers, torch, device, dtype).
        lens: a lens; one fitted before canaries existed has none.
        lens_name: how the "no canary" sentence names the lens file in its ``jlens check`` command.

    Returns:
        A :class:`CheckResult`: ``"same"``, ``"changed"`` (names the part, the first layer that changed
        and by how much, with the versions then and now) or ``"no canary"`` (not a failure).
    """
    canary = lens_canary(lens)
    if canary is None:
        return CheckResult("no canary", f"No canary: this lens was saved without one, so it cannot be checked; run "
                                        f"`jlens check {lens_name} --write-canary` to add one (if this model is the one it was "
                                        f"fitted on), or `jlens check {lens_name} --refit 8` to refit a few prompts "
                                        "and compare (a lens fitted elsewhere).",
                           versions_now=versions(), dtype_now=str(model.dtype).replace("torch.", ""))
    if canary.residuals.shape[-1] != model.d_model or canary.target_layer >= model.n_layers:
        return CheckResult("changed", f"Not the lens of {model.name}: its canary is of a model with d_model="
                                      f"{canary.residuals.shape[-1]} and at least {canary.target_layer + 1} layers.",
                           versions_then=dict(canary.versions), versions_now=versions())
    return check_canary(model, canary)


# -- files -----------------------------------------------------------------------------------------------
def canary_file_parts(lens: object) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and header entries a lens file adds for the lens's canary (empty without one)."""
    canary = getattr(lens, "canary", None)
    if not isinstance(canary, Canary):
        return {}, {}
    return canary.tensors(), {META_KEY: json.dumps(canary.metadata())}


def read_canary(path: str | os.PathLike) -> Canary | None:
    """The canary a lens file holds, or None (a file without one, or one whose canary cannot be read: logged)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if META_KEY not in meta:
            return None
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(TENSOR_PREFIX)}  # noqa: SIM118
    try:
        return Canary.from_file_parts(tensors, json.loads(meta[META_KEY]))
    except (KeyError, ValueError, TypeError) as exc:
        log.warning("%s: its canary cannot be read (%s); it is treated as having none.", path, exc)
        return None


def write_canary(path: str | os.PathLike, canary: Canary) -> Path:
    """Add (or replace) ``canary`` in the lens file at ``path``, atomically; every other tensor and header
    entry is kept bit for bit (their dtypes too).

    Raises:
        FileNotFoundError: no file. LensFileError: not a safetensors lens file.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .header import LensFileError

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No lens file at {str(path)!r}.")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(TENSOR_PREFIX)}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise LensFileError(f"{str(path)!r} is not a safetensors lens file, so a canary cannot be added: {exc}") from exc
    if "jlens" not in meta:
        raise LensFileError(f"{str(path)!r} has no jlens metadata: it is not a lens file.")
    extra_tensors, extra_meta = canary_file_parts(_Carrier(canary))
    tensors.update(extra_tensors)
    meta.update(extra_meta)
    save: Callable[[str], None] = lambda tmp: save_file(tensors, tmp, metadata=meta)
    return atomic_write(path, save, shared=True)


@dataclass
class _Carrier:
    canary: Canary


__all__ = ["CANARY_TEXT", "Canary", "CheckResult", "PartCheck", "canary_file_parts", "check_canary", "check_lens",
           "lens_canary", "make_canary", "read_canary", "tolerances", "versions", "write_canary"]
