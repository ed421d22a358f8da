"""What every workspace experiment shares (docs/experiments.md): prompts, the band, the capability gate,
batched forwards of edited trials, ranks, Wilson intervals, a bootstrap clustered by category, the result.

* **Prompts**: a string is read as written; a list of ``{"role", "content"}`` turns goes through the
  tokenizer's chat template (a final assistant turn is a teacher-forced prefill, continued in place).
* **Band**: given (``"20-26"``, ``(20, 26)`` or a list of layers, each a source layer of the lens), or derived
  with the study's band rule (docs/method.md §8.1, :func:`~jlens_core.evaluation.study.band_of`) from the
  curve ``c_l`` = the fraction of gated items whose experiment concept is in the lens's top
  :data:`BAND_TOP_K` at the last position at layer ``l``: onset = the first layer reaching half the curve's
  maximum, end = the last layer of the contiguous run from there.
* **Trials sharing a prompt** run as one batched forward: row ``b`` of the batch carries its own edits
  (:class:`RowEdits`), and edits that need the clean residuals read them from one clean forward.
"""

from __future__ import annotations

import csv
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from .._atomic import atomic_write_text
from .._version import __version__
from ..evaluation.study import band_of
from ..interventions.intervals import wilson_interval
from ..interventions.read_directions import check_layers, default_layers, last_source_layer
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..models.recorder import ActivationRecorder, block_output, register_own_thread_hook
from ..reading.inputs import record_residuals
from ..reading.tokens import spellings

BAND_TOP_K = 5
N_BOOT = 1000
ROW_CHUNK = 32  # edited rows per batched forward


class ExperimentCancelled(Exception):
    """``stop()`` returned True between trials."""


class NoChatTemplateError(ValueError):
    """The model's tokenizer has no chat template, and the experiment's prompts are turns."""


# -- prompts and words ------------------------------------------------------------------------------------
def render_prompt(model: LensModel, prompt: str | Sequence[Mapping[str, str]], *, experiment: str = "") -> str:
    """The prompt text: a string as is, turns through the chat template (a last assistant turn is continued).

    Raises:
        NoChatTemplateError: turns, and the tokenizer has no chat template.
        ValueError: turns that are not ``{"role", "content"}`` objects.
    """
    if isinstance(prompt, str):
        return prompt
    turns = list(prompt)
    if not turns or not all(isinstance(t, Mapping) and "role" in t and "content" in t for t in turns):
        raise ValueError(f"A multi-turn prompt must be a list of {{'role', 'content'}} objects, not {prompt!r}.")
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(f"{model.name!r} has no chat template, so the turns of {experiment or 'this experiment'} "
                                  "cannot be rendered: use a chat (instruct) model.")
    messages = [{"role": str(t["role"]), "content": str(t["content"])} for t in turns]
    if messages[-1]["role"] == "assistant":
        head = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        return head + messages[-1]["content"]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def word_ids(model: LensModel, word: str) -> dict[str, int]:
    """``{spelling: id}`` of the complete single-token spellings of ``word`` (empty: not one token here)."""
    return spellings(model.tokenizer, str(word), vocab_size=model.vocab_size) if str(word).strip() else {}


def first_ids(model: LensModel, word: str) -> set[int]:
    """The ids a greedy answer may start ``word`` with: its first token with and without a leading space, and
    its single-token spellings (the study's capability rule)."""
    return set(spellings(model.tokenizer, str(word), rule="first", vocab_size=model.vocab_size).values()) | set(
        word_ids(model, word).values())


def not_single(model: LensModel, words: Mapping[str, str]) -> list[str]:
    """``["field 'word'", ...]`` for the words with no single-token spelling under the model's tokenizer."""
    return [f"{k} {v!r}" for k, v in words.items() if not word_ids(model, v)]


def ranks_of(logits: torch.Tensor, ids: Iterable[int]) -> int:
    """The best 1-based rank among ``ids`` in ``logits [vocab]`` (1 + how many tokens score higher)."""
    ids = list(ids)
    values = logits[ids]
    return int(1 + (logits[None, :] > values[:, None]).sum(dim=1).min())


# -- the band ----------------------------------------------------------------------------------------------
def parse_band(band: str | Sequence[int] | None) -> list[int] | None:
    """``"20-26"`` -> ``[20, ..., 26]``; ``"7"`` -> ``[7]``; a pair ``(a, b)`` or a list as given; ``None`` as is.

    Raises:
        ValueError: text that is not ``A-B`` or ``A``, or a range that runs backwards.
    """
    if band is None:
        return None
    if isinstance(band, str):
        match = re.fullmatch(r"\s*(-?\d+)\s*(?:-\s*(\d+))?\s*", band)
        if not match:
            raise ValueError(f"Band {band!r} is not a layer range: write it as START-END, e.g. '20-26'.")
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) else start
        if end < start:
            raise ValueError(f"Band {band!r} runs backwards: write the lower layer first.")
        return list(range(start, end + 1))
    layers = [int(x) for x in band]
    if not layers:
        raise ValueError("The band is empty: give at least one layer, or None to derive it.")
    return layers


@dataclass(frozen=True)
class Band:
    """The layers an experiment edits and reads, and how they were chosen.

    Attributes:
        layers: the band's layers, ascending.
        rule: one sentence: given, derived (with the curve's concept) or the fallback.
        curve: ``{layer: fraction}`` the derivation used (empty when the band was given).
    """

    layers: tuple[int, ...]
    rule: str
    curve: dict[int, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.layers[0]}-{self.layers[-1]}" if len(self.layers) > 1 else str(self.layers[0])


def resolve_band(model: LensModel, lens: Lens, band: str | Sequence[int] | None,
                 curve: Mapping[int, float] | None = None, concept: str = "concept") -> Band:
    """The band: given (checked against the lens) or derived from ``curve`` by the study's band rule.

    Raises:
        ValueError: a given layer outside the lens (one sentence naming it and the lens's layers).
    """
    given = parse_band(band)
    if given is not None:
        return Band(tuple(check_layers(model, lens, given)), "given")
    values = dict(curve or {})
    layers = sorted(values)
    found = band_of([values[x] for x in layers]) if layers else None
    if found is None:
        fallback = default_layers(model, lens)
        why = (f"the {concept} never reached the lens's top {BAND_TOP_K}" if values else
               "this experiment has no concept curve to derive a band from")
        return Band(tuple(fallback), f"{why}, so the default edit band (n_layers // 3 .. the lens's last source "
                                     "layer) is used", values)
    onset, end = found
    return Band(tuple(layers[onset:end + 1]),
                f"derived by the study's band rule (docs/method.md §8.1) from the fraction of gated items whose "
                f"{concept} is in the lens's top {BAND_TOP_K} at the last position: onset = the first layer "
                f"reaching half the maximum ({max(values.values()):.2f}), end = the last layer of the run above it",
                values)


def readable_layers(lens: Lens) -> list[int]:
    """The lens's layers up to its last source layer: where a curve is read and a swap may go."""
    top = last_source_layer(lens)
    return [x for x in lens.layers if x <= top]


def gated_band(model: LensModel, lens: Lens, band: str | Sequence[int] | None, experiment: str,
               gate_rows: list[dict], hits: Sequence[Mapping[int, bool]], concept: str) -> tuple[pd.DataFrame, Band]:
    """``(gate table, band)`` once the gate has run: one sentence when no item passed, else the band, given or
    derived from ``hits`` (per gated item, ``{layer: concept in the lens's top 5 at the last position}``).

    Raises:
        ValueError: no item passed the gate.
    """
    gate = pd.DataFrame(gate_rows)
    if not hits:
        raise gate_error(experiment, gate)
    curve = {layer: float(np.mean([h[layer] for h in hits])) for layer in hits[0]}
    return gate, resolve_band(model, lens, band, curve, concept=concept)


# -- clean readings and edited forwards --------------------------------------------------------------------
def encode(model: LensModel, text: str) -> torch.Tensor:
    """``[1, seq]`` token ids of a rendered prompt."""
    return model.encode(text)


@dataclass(frozen=True)
class CleanRead:
    """One clean forward: the model's next-token logits ``[vocab]`` and, per lens layer, the lens logits at the
    last position (``{layer: [vocab]}`` fp32)."""

    logits: torch.Tensor
    lens_logits: dict[int, torch.Tensor]

    @property
    def greedy(self) -> int:
        return int(self.logits.argmax())


def clean_read(model: LensModel, lens: Lens, ids: torch.Tensor, layers: Sequence[int]) -> CleanRead:
    """The model's next-token logits and the lens's last-position logits at ``layers`` (one forward)."""
    top = model.n_layers - 1
    recorded = record_residuals(model, ids, layers)
    with torch.no_grad():
        logits = model.unembed(recorded[top][-1]).float()
        lens_logits = {}
        if layers:
            moved = torch.cat([lens.transport(recorded[layer][-1:], int(layer)) for layer in layers])  # [L, d]
            for layer, row in zip(layers, model.unembed(moved).float()):  # one head matmul for every layer
                lens_logits[int(layer)] = row
    return CleanRead(logits, lens_logits)


class RowEdits:
    """Forward hooks that give each row of a batch its own edits (the residual-edit protocol of
    :mod:`jlens_core.reading.edit_hooks`, applied per row in list order), reading clean residuals from one
    unedited forward of the shared prompt."""

    def __init__(self, model: LensModel, rows: Sequence[Sequence[Any]], n_prompt: int) -> None:
        self.model = model
        self.rows = [list(r) for r in rows]
        self.n_prompt = int(n_prompt)
        self.layers = sorted({int(x) for edits in self.rows for e in edits for x in e.layers})
        self.needs_clean = any(e.needs_clean for edits in self.rows for e in edits)
        self.clean: dict[int, torch.Tensor] = {}

    def record_clean(self, ids: torch.Tensor) -> None:
        if not self.needs_clean:
            return
        with torch.no_grad(), ActivationRecorder(self.model.layers, self.layers,
                                                 stop_after=max(self.layers)) as rec:
            self.model.forward(ids)
        self.clean = {layer: rec.activations[layer][0].detach() for layer in self.layers}

    def _hook(self, layer: int) -> Callable:
        def hook(module, args, output):
            h = block_output(output)  # [batch, seq, d]
            positions = torch.arange(h.shape[-2], device=h.device)
            new = h.clone()
            for b, edits in enumerate(self.rows):
                for edit in edits:
                    if layer not in edit.layers:
                        continue
                    mask = edit.selects(positions, self.n_prompt)
                    if not bool(mask.any()):
                        continue
                    clean = self.clean[layer][mask] if edit.needs_clean else None
                    new[b, mask] = edit.apply(layer, new[b, mask], clean).to(new.dtype)
            if isinstance(output, tuple):
                return (new, *output[1:])
            return new

        return hook

    def _last_layer(self, ids: torch.Tensor) -> torch.Tensor:
        """``[rows, seq, d_model]``: the last layer's output, each row under its edits (the head not run)."""
        top = self.model.n_layers - 1
        batch = ids.expand(len(self.rows), -1)
        handles = [register_own_thread_hook(self.model.layers[layer], self._hook(layer)) for layer in self.layers]
        try:
            with torch.no_grad(), ActivationRecorder(self.model.layers, [top], stop_after=top) as rec:
                self.model.forward(batch)
            return rec.activations[top]
        finally:
            for handle in handles:
                handle.remove()

    def greedy_all(self, ids: torch.Tensor) -> torch.Tensor:
        """``[rows, seq]`` the greedy next token at every position, each row under its edits."""
        with torch.no_grad():
            return torch.stack([self.model.unembed(row).argmax(-1) for row in self._last_layer(ids)])

    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab]`` fp32 next-token logits at the last position, each row under its edits."""
        with torch.no_grad():
            return self.model.unembed(self._last_layer(ids)[:, -1]).float()


def edited_next_logits(model: LensModel, ids: torch.Tensor, rows: Sequence[Sequence[Any]],
                       chunk: int = ROW_CHUNK) -> torch.Tensor:
    """``[len(rows), vocab]``: the next-token logits of ``ids [1, seq]`` with each row's edits, in batched forwards
    of ``chunk`` rows sharing one clean forward."""
    if not rows:
        return torch.zeros(0, int(model.vocab_size))
    runner = RowEdits(model, rows, int(ids.shape[-1]))
    runner.record_clean(ids)
    out = []
    for start in range(0, len(rows), int(chunk)):
        part = RowEdits(model, rows[start:start + int(chunk)], int(ids.shape[-1]))
        part.clean = runner.clean
        out.append(part.next_logits(ids))
    return torch.cat(out)


EDITS = "_edits"  # a trial row's key for the edits it ran: kept beside the table (ExperimentResult.trial_edits)


def trial_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None,
                ) -> tuple[pd.DataFrame, tuple[tuple[Any, ...], ...]]:
    """``(trials, trial_edits)``: the per-trial table of ``rows`` and, aligned with it, each row's edits
    (its :data:`EDITS` entry, taken out of the row; ``()`` where it has none)."""
    edits = tuple(tuple(row.pop(EDITS, ())) for row in rows)
    return pd.DataFrame(rows, columns=list(columns) if columns is not None else None), edits


# -- statistics --------------------------------------------------------------------------------------------
def clustered_bootstrap(successes: np.ndarray, clusters: np.ndarray, *, n_boot: int = N_BOOT,
                        seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile interval of the pooled rate, resampling whole clusters (categories) with replacement.

    ``successes`` and ``clusters`` are ``[n]`` arrays; ``(nan, nan)`` when there are no trials.
    """
    successes = np.asarray(successes, dtype=np.float64)
    if successes.size == 0:
        return math.nan, math.nan
    names, index = np.unique(np.asarray(clusters, dtype=str), return_inverse=True)
    wins = np.bincount(index, weights=successes, minlength=len(names))
    counts = np.bincount(index, minlength=len(names)).astype(np.float64)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(names), size=(int(n_boot), len(names)))
    rates = wins[draws].sum(axis=1) / np.maximum(counts[draws].sum(axis=1), 1)
    low, high = np.percentile(rates, [2.5, 97.5])
    return float(low), float(high)


SUMMARY_COLUMNS = ("arm", "trials", "successes", "rate", "wilson_low", "wilson_high", "boot_low", "boot_high",
                   "top5_rate")


def summarise(trials: pd.DataFrame, arms: Sequence[str], *, success: str = "top1", seed: int = 0,
              n_boot: int = N_BOOT) -> pd.DataFrame:
    """One row per arm: trials, successes, rate with its Wilson 95 % interval and the category-clustered bootstrap
    interval, and the top-5 rate (columns :data:`SUMMARY_COLUMNS`)."""
    rows = []
    for arm in arms:
        part = trials[trials["arm"] == arm] if len(trials) else trials
        n = len(part)
        wins = int(part[success].sum()) if n else 0
        low, high = wilson_interval(wins, n)
        b_low, b_high = (clustered_bootstrap(part[success].to_numpy(), part["category"].to_numpy(), n_boot=n_boot,
                                             seed=seed) if n else (math.nan, math.nan))
        top5 = float(part["top5"].mean()) if n and "top5" in part else math.nan
        rows.append({"arm": arm, "trials": n, "successes": wins, "rate": wins / n if n else math.nan,
                     "wilson_low": low, "wilson_high": high, "boot_low": b_low, "boot_high": b_high, "top5_rate": top5})
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


class Progress:
    """Counts trials for ``progress(done, total)`` and asks ``stop()`` between them."""

    def __init__(self, total: int, progress: Callable[[int, int], None] | None,
                 stop: Callable[[], bool] | None) -> None:
        self.total, self.done = max(1, int(total)), 0
        self.progress, self.stop = progress, stop

    def step(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if self.progress is not None:
            self.progress(self.done, self.total)
        if self.stop is not None and self.stop():
            raise ExperimentCancelled(f"The experiment was stopped after {self.done} of {self.total} steps.")


def gate_error(experiment: str, gate: pd.DataFrame) -> ValueError:
    """The one sentence for an empty gate."""
    reasons = gate["reason"].value_counts().head(1)
    why = f" (most often: {reasons.index[0]})" if len(reasons) else ""
    return ValueError(f"The model answers none of the {len(gate)} {experiment} items, so nothing can be scored"
                      f"{why}: use a larger model or items it can do.")


# -- the result --------------------------------------------------------------------------------------------
def _jsonable(value: Any) -> Any:
    if isinstance(value, pd.DataFrame):
        return json.loads(value.to_json(orient="records"))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        return None if not math.isfinite(float(value)) else float(value)
    return value





@dataclass(frozen=True)
class ExperimentResult:
    """What :func:`~jlens_core.experiments.run_experiment` returns.

    Attributes:
        name: the experiment (``probe-swap``, ...).
        model, lens: their names; band: the :class:`Band` (layers, rule, curve).
        gate: one row per item (or cell): ``item, category, passed, reason`` (and what the model said).
        trials: the tidy per-trial table: one row per item x arm x target, with ``arm, item, category, source,
            target, rank, top1, top5`` and the experiment's own columns.
        summary: one row per arm (:data:`SUMMARY_COLUMNS`): Wilson 95 % and category-clustered bootstrap intervals.
        extras: the experiment's own tables and numbers (the depth test, grids, correlations ...), each a
            DataFrame or a plain value.
        settings: the arguments it ran with; seconds: wall time; notes: sentences worth reading.
        trial_edits: per row of ``trials``, the residual edits it ran (the experiment's own swaps, vectors,
            clamps and injections, held in memory so that Inspect can replay any arm; never written to JSON).
    """

    name: str
    model: str
    lens: str
    band: Band
    gate: pd.DataFrame
    trials: pd.DataFrame
    summary: pd.DataFrame
    extras: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    notes: tuple[str, ...] = ()
    trial_edits: tuple[tuple[Any, ...], ...] = field(default=(), repr=False, compare=False)

    def edits_of(self, row: int) -> tuple[Any, ...]:
        """The residual edits trial ``row`` (a position in :attr:`trials`) ran, as objects bound to the model
        (empty: a trial without edits, such as a label-hit count, or a result read back from JSON)."""
        return self.trial_edits[row] if 0 <= row < len(self.trial_edits) else ()

    @property
    def n_gated(self) -> int:
        return int(self.gate["passed"].sum()) if len(self.gate) else 0

    def rate(self, arm: str) -> float:
        """The top-1 success rate of ``arm`` (NaN when it has no trials or is not an arm)."""
        row = self.summary[self.summary["arm"] == arm]
        return float(row["rate"].iloc[0]) if len(row) else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"experiment": self.name, "model": self.model, "lens": self.lens, "jlens": __version__,
                "band": {"layers": list(self.band.layers), "rule": self.band.rule,
                         "curve": {str(k): v for k, v in self.band.curve.items()}},
                "seconds": round(self.seconds, 2), "settings": _jsonable(self.settings), "notes": list(self.notes),
                "summary": _jsonable(self.summary), "gate": _jsonable(self.gate), "trials": _jsonable(self.trials),
                "extras": _jsonable(self.extras)}

    def to_json(self, path: str | Path | None = None) -> str:
        """The result as JSON text (written to ``path`` too, atomically, when given)."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            atomic_write_text(Path(path), text)
        return text

    def figure(self) -> Any:
        """The Plotly figure: each arm's rate with its Wilson interval, and the experiment's own panel."""
        from ..figures.experiments import experiment_figure

        return experiment_figure(self)

    def to_html(self, path: str | Path | None = None) -> str:
        """One self-contained HTML page (figure, summary, gate, extras, trials); written to ``path`` when given."""
        from ..figures.experiments import experiment_page

        page = experiment_page(self)
        if path is not None:
            atomic_write_text(Path(path), page)
        return page

    def save(self, folder: str | Path, *, html: bool = False) -> list[Path]:
        """Write ``result.json``, ``trials.csv``, ``summary.csv``, ``gate.csv`` (and ``result.html``) to ``folder``."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "result.json", out / "trials.csv", out / "summary.csv", out / "gate.csv"]
        self.to_json(written[0])
        for frame, path in zip((self.trials, self.summary, self.gate), written[1:]):
            atomic_write_text(path, frame.to_csv(index=False, quoting=csv.QUOTE_NONNUMERIC))  # tokens hold \r, \n
        if html:
            written.append(out / "result.html")
            self.to_html(written[-1])
        return written

    def __repr__(self) -> str:
        rates = ", ".join(f"{r.arm} {r.rate:.0%}" for r in self.summary.itertuples() if r.trials)
        return (f"ExperimentResult({self.name!r}, band {self.band.label}, {self.n_gated}/{len(self.gate)} gated, "
                f"{rates})")


def timer() -> Callable[[], float]:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


__all__ = [
    "BAND_TOP_K",
    "EDITS",
    "SUMMARY_COLUMNS",
    "Band",
    "CleanRead",
    "ExperimentCancelled",
    "ExperimentResult",
    "NoChatTemplateError",
    "Progress",
    "RowEdits",
    "clean_read",
    "clustered_bootstrap",
    "edited_next_logits",
    "first_ids",
    "gate_error",
    "gated_band",
    "not_single",
    "parse_band",
    "ranks_of",
    "readable_layers",
    "render_prompt",
    "resolve_band",
    "summarise",
    "trial_table",
    "word_ids",
]
