"""Training a tuned lens (Belrose et al., 2023) on a corpus, with checkpoints and resume.

The objective is tuned-lens's: for every layer ``l``, ``KL(p_final || p_lens_l)`` averaged over the
corpus tokens, summed over layers; the model is frozen and only the translators ``A_l, b_l`` learn
(they start at zero: the logit lens). Adam, a constant learning rate after a short linear warm-up.

The token stream is fixed by the texts: each text truncated to ``max_seq_len`` tokens, positions
``>= skip_first`` kept (the first are attention sinks, as in the Jacobian lens's fit), concatenated
in order and cycled. Step ``s`` takes tokens ``[s T, (s + 1) T)`` of that stream (``T =
tokens_per_step``), so a step's batch depends only on ``s``: a resumed run sees exactly the batches
of an uninterrupted one. A step runs the model (no gradients) over the texts it touches, then one
layer at a time: unembed, KL, backward, so neither layers x positions x vocabulary nor the corpus is
ever held.

Checkpoints (a ``torch.save`` dict, written atomically every ``checkpoint_every`` steps and at the
end, and when training stops on Ctrl-C or an error) hold the translators, the optimizer state, the
step and the settings; resuming with other settings is a ``ValueError`` naming the setting
(:func:`~jlens_core.fitting.resume.check_same_settings`, as for the Jacobian lens's fit).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from .._atomic import atomic_write
from .._keywords import checked_options
from ..layerspec import normalise_layers
from ..lenses.readout import transported_logits
from ..lenses.tuned import TunedLens
from ..models.model import LensModel
from ..models.recorder import ActivationRecorder
from .resume import check_same_settings, prompts_digest

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger(__name__)

LN2 = math.log(2.0)
# Settings that shape the result: a checkpoint written with others cannot be resumed.


@dataclass(frozen=True)
class TuneSettings:
    """What shapes a tuned lens's training (a checkpoint resumes only under the same values): its lens file's and
    checkpoint's ``settings`` (:meth:`to_dict`, with the steps done added to the lens's).

    Attributes:
        layers: the source layers translated (concrete, ascending).
        tokens_per_step: tokens per optimisation step.
        lr: Adam's learning rate after the warm-up.
        warmup_steps: steps of linear warm-up.
        max_seq_len: each text truncated to this many tokens.
        skip_first: positions before this are left out (the lens's :attr:`~jlens_core.lenses.tuned.TunedLens.skip_first`).
        seed: reserved for data order.
        corpus_digest: the training texts' digest (:func:`~jlens_core.fitting.resume.prompts_digest`).
    """

    layers: tuple[int, ...]
    tokens_per_step: int
    lr: float
    warmup_steps: int
    max_seq_len: int
    skip_first: int
    seed: int
    corpus_digest: str

    def to_dict(self) -> dict[str, Any]:
        """The ``settings`` dict a checkpoint records (``layers`` as a list), in field order."""
        return {f.name: list(getattr(self, f.name)) if f.name == "layers" else getattr(self, f.name)
                for f in fields(self)}


# the settings a training checkpoint must match to resume: every field of TuneSettings
TUNE_SETTINGS = tuple(f.name for f in fields(TuneSettings))


@dataclass
class TuneProgress:
    """What the progress callback gets after each step.

    Attributes:
        step: steps done (1-based); steps: the total asked for.
        train_kl_bits: this step's ``KL(final || lens)`` per token, mean over layers (bits).
        heldout_kl_bits: ``{layer: bits}`` on the held-out texts when measured at this step, else ``None``.
        tokens: tokens trained on so far; seconds: wall time of this step.
    """

    step: int
    steps: int
    train_kl_bits: float
    heldout_kl_bits: dict[int, float] | None
    tokens: int
    seconds: float


@dataclass
class _Stream:
    """The fixed token stream: per text its ids ``[1, n]`` and the positions used (``>= skip_first``)."""

    ids: list[torch.Tensor]
    lengths: list[int]
    starts: list[int] = field(default_factory=list)  # stream offset of each text's first used token

    @property
    def total(self) -> int:
        return sum(self.lengths)


def _build_stream(model: LensModel, texts: Sequence[str], max_seq_len: int, skip_first: int) -> _Stream:
    ids, lengths = [], []
    for text in texts:
        encoded = model.encode(text, max_length=max_seq_len)  # [1, seq]
        used = max(0, int(encoded.shape[1]) - skip_first)
        if used:
            ids.append(encoded)
            lengths.append(used)
    stream = _Stream(ids, lengths)
    offset = 0
    for n in lengths:
        stream.starts.append(offset)
        offset += n
    return stream


def _record(model: LensModel, ids: torch.Tensor, layers: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Residuals ``{layer: [seq, d]}`` and the final log-probabilities ``[seq, vocab]`` (fp32), no grad."""
    top = model.n_layers - 1
    with torch.no_grad(), ActivationRecorder(model.layers, sorted(set(layers) | {top}), stop_after=top) as rec:
        model.forward(ids)
    resid = {layer: rec.activations[layer][0].detach() for layer in layers}
    with torch.no_grad():
        final = model.unembed(rec.activations[top][0]).float().log_softmax(-1)
    return resid, final


def _batch(model: LensModel, stream: _Stream, step: int, tokens_per_step: int, layers: list[int], skip_first: int
           ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Step ``step``'s tokens: residuals ``{layer: [T, d]}`` and final log-probs ``[T, vocab]``."""
    start = step * tokens_per_step
    need = tokens_per_step
    parts_h: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    parts_f: list[torch.Tensor] = []
    pos = start % stream.total
    while need > 0:
        # the text holding stream offset `pos`
        index = max(i for i, s in enumerate(stream.starts) if s <= pos)
        within = pos - stream.starts[index]
        take = min(need, stream.lengths[index] - within)
        resid, final = _record(model, stream.ids[index], layers)
        sl = slice(skip_first + within, skip_first + within + take)
        for layer in layers:
            parts_h[layer].append(resid[layer][sl])
        parts_f.append(final[sl])
        need -= take
        pos = (pos + take) % stream.total
    return {layer: torch.cat(parts_h[layer]) for layer in layers}, torch.cat(parts_f)


def _kl_nats(final_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``KL(final || softmax(logits))`` in nats (a scalar with grad)."""
    logp = logits.float().log_softmax(-1)
    return (final_logp.exp() * (final_logp - logp)).sum(-1).mean()


def heldout_kl(model: LensModel, lens: TunedLens, texts: Sequence[str], *, max_seq_len: int = 128,
               skip_first: int = 16) -> dict[int, float]:
    """Mean ``KL(final || lens)`` per layer (bits) over the positions ``>= skip_first`` of ``texts``."""
    layers = lens.source_layers
    sums = dict.fromkeys(layers, 0.0)
    count = 0
    for text in texts:
        ids = model.encode(text, max_length=max_seq_len)
        if int(ids.shape[1]) <= skip_first:
            continue
        resid, final = _record(model, ids, layers)
        final = final[skip_first:]
        with torch.no_grad():
            for layer in layers:
                logits = lens.logits(model, resid[layer][skip_first:].float(), layer)
                sums[layer] += float(_kl_nats(final, logits)) * final.shape[0]
        count += int(final.shape[0])
    if count == 0:
        raise ValueError("The held-out texts have no token past skip_first: give longer texts.")
    return {layer: sums[layer] / count / LN2 for layer in layers}


class TuneKeywords(TypedDict, total=False):
    """:func:`train_tuned_lens`'s further keywords (its Args): the step's size and schedule, the tokens used, how
    often it measures and checkpoints, whether it resumes, the seed."""

    tokens_per_step: int
    lr: float
    warmup_steps: int
    max_seq_len: int
    skip_first: int
    heldout_every: int
    checkpoint_every: int
    resume: bool
    seed: int


def train_tuned_lens(model: LensModel, texts: Sequence[str], *, layers: Sequence[int] | None = None, steps: int = 100,
                     heldout_texts: Sequence[str] = (), checkpoint_path: str | os.PathLike | None = None,
                     progress: Callable[[TuneProgress], None] | None = None,
                     **options: Unpack[TuneKeywords]) -> TunedLens:
    """Train a tuned lens for ``model`` on ``texts`` (see the module docstring).

    Args:
        model: an :class:`~jlens_core.HFLensModel` (frozen; only the translators learn).
        texts: the training corpus (e.g. ``load_corpus(..., split="fit")``).
        layers: source layers to translate (default: every layer below the last; negatives count from
            the end).
        steps: optimisation steps; tokens_per_step: tokens per step (memory: one layer's
            ``[tokens_per_step, vocab]`` logits at a time).
        lr: Adam's learning rate (after ``warmup_steps`` of linear warm-up).
        max_seq_len, skip_first: the tokens used: each text truncated, positions ``>= skip_first``.
        heldout_texts: texts to measure held-out KL on, every ``heldout_every`` steps and at the end.
        checkpoint_path: where to write the resumable state (every ``checkpoint_every`` steps).
        resume: go on from ``checkpoint_path`` when it exists (same settings, more or equal steps).
        seed: reserved for data order (kept in the settings).
        progress: called after every step with a :class:`TuneProgress`.

    Returns:
        The :class:`~jlens_core.lenses.tuned.TunedLens`, with ``settings`` and ``metrics``
        (``heldout_kl_bits`` per layer, the ``history`` of train and held-out KL).

    Raises:
        ValueError: zero training tokens, a layer outside the model, bad step counts or learning
            rate, or a checkpoint written with other settings (names the setting).
        TypeError: a keyword that is not one of :class:`TuneKeywords`.
    """
    given = checked_options("train_tuned_lens", options, TuneKeywords)
    tokens_per_step, lr = given.get("tokens_per_step", 256), given.get("lr", 1e-3)
    warmup_steps, max_seq_len, skip_first = given.get("warmup_steps", 5), given.get("max_seq_len", 128), \
        given.get("skip_first", 16)
    heldout_every, checkpoint_every = given.get("heldout_every", 10), given.get("checkpoint_every", 10)
    resume, seed = given.get("resume", True), given.get("seed", 0)
    top = model.n_layers - 1
    chosen = normalise_layers(layers, model.n_layers, below=top, name="Layer", below_name="the output layer")
    if int(steps) < 1 or int(tokens_per_step) < 1:
        raise ValueError(f"steps={steps} and tokens_per_step={tokens_per_step} must be at least 1.")
    if not lr > 0:
        raise ValueError(f"lr={lr} must be positive.")
    stream = _build_stream(model, list(texts), int(max_seq_len), int(skip_first))
    if stream.total == 0:
        raise ValueError(f"Zero training tokens: no text has more than skip_first={skip_first} tokens (max_seq_len "
                         f"{max_seq_len}); give longer or more texts.")
    settings = TuneSettings(layers=tuple(chosen), tokens_per_step=int(tokens_per_step), lr=float(lr),
                            warmup_steps=int(warmup_steps), max_seq_len=int(max_seq_len), skip_first=int(skip_first),
                            seed=int(seed), corpus_digest=prompts_digest(list(texts), len(texts)))
    run = _TuneRun(model, stream, settings, checkpoint_path)
    if resume:
        run.resume()
    heldout = list(heldout_texts)
    last_heldout: dict[int, float] | None = None
    try:
        while run.done < int(steps):
            started = time.perf_counter()
            record = run.step()
            measured = None
            if heldout and (run.done % max(1, int(heldout_every)) == 0 or run.done == int(steps)):
                measured = last_heldout = run.heldout(heldout)
                record["heldout_kl_bits"] = sum(measured.values()) / len(measured)
            if run.done % max(1, int(checkpoint_every)) == 0 or run.done == int(steps):
                run.save_checkpoint()
            if progress is not None:
                progress(TuneProgress(run.done, int(steps), record["train_kl_bits"], measured,
                                      run.done * int(tokens_per_step), time.perf_counter() - started))
    except BaseException:
        run.save_checkpoint()  # Ctrl-C, the app's Stop, a crash: the steps done so far are kept
        log.info("tuned-lens training stopped at step %d; checkpoint written", run.done)
        raise
    if heldout and last_heldout is None:  # resumed a finished run
        last_heldout = run.heldout(heldout)
    metrics: dict[str, Any] = {"history": run.history}
    if last_heldout is not None:
        metrics["heldout_kl_bits"] = {str(k): v for k, v in last_heldout.items()}
    return run.snapshot().replace(metrics=metrics)


class _TuneRun:
    """The training state: the translators ``A_l, b_l`` (from zero: the logit lens), Adam, the steps done
    and their history; written to and resumed from ``checkpoint_path`` (None: no checkpoint)."""

    def __init__(self, model: LensModel, stream: _Stream, settings: TuneSettings,
                 checkpoint_path: str | os.PathLike | None) -> None:
        self.model, self.stream, self.settings = model, stream, settings
        self.layers: list[int] = list(settings.layers)
        self.checkpoint = Path(checkpoint_path) if checkpoint_path is not None else None
        d = model.d_model
        self.params = {layer: (torch.zeros(d, d, requires_grad=True), torch.zeros(d, requires_grad=True))
                       for layer in self.layers}
        self.optimizer = torch.optim.Adam([p for pair in self.params.values() for p in pair], lr=settings.lr)
        self.done = 0
        self.history: list[dict] = []

    def resume(self) -> None:
        """Go on from the checkpoint, if there is one (its settings checked)."""
        if self.checkpoint is None or not self.checkpoint.is_file():
            return
        state = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
        check_same_settings(self.checkpoint, state["settings"], self.settings.to_dict(), TUNE_SETTINGS,
                            run="training")
        with torch.no_grad():
            for layer, (a, b) in self.params.items():
                a.copy_(state["A"][layer])
                b.copy_(state["b"][layer])
        self.optimizer.load_state_dict(state["optimizer"])
        self.done, self.history = int(state["step"]), list(state["history"])
        log.info("resumed the tuned lens at step %d from %s", self.done, self.checkpoint)

    def step(self) -> dict[str, Any]:
        """One optimisation step on step ``done``'s tokens, one layer's backward at a time; its history record."""
        settings, model = self.settings, self.model
        for group in self.optimizer.param_groups:  # linear warm-up
            group["lr"] = settings.lr * min(1.0, (self.done + 1) / max(1, settings.warmup_steps))
        self.optimizer.zero_grad(set_to_none=True)
        resid, final = _batch(model, self.stream, self.done, settings.tokens_per_step, self.layers,
                              settings.skip_first)
        total = 0.0
        for layer in self.layers:
            a, b = self.params[layer]
            h = resid[layer].float()  # [T, d]
            logits = transported_logits(model, h + h @ a.T + b)  # [T, vocab]: the translator being trained
            loss = _kl_nats(final, logits)
            loss.backward()
            total += float(loss.detach())
            del logits, loss
        self.optimizer.step()
        self.done += 1
        record: dict[str, Any] = {"step": self.done, "train_kl_bits": total / len(self.layers) / LN2}
        self.history.append(record)  # the caller may add the held-out KL to it
        return record

    def snapshot(self) -> TunedLens:
        """The lens as it stands (copies of the translators)."""
        model = self.model
        return TunedLens({layer: (a.detach().clone(), b.detach().clone()) for layer, (a, b) in self.params.items()},
                         model.d_model, target_layer=model.n_layers - 1, n_layers=model.n_layers,
                         model_name=model.name, model_fingerprint=model.fingerprint(),
                         settings={**self.settings.to_dict(), "steps": self.done})

    def heldout(self, texts: Sequence[str]) -> dict[int, float]:
        return heldout_kl(self.model, self.snapshot(), texts, max_seq_len=self.settings.max_seq_len,
                          skip_first=self.settings.skip_first)

    def save_checkpoint(self) -> None:
        if self.checkpoint is None:
            return
        state = {"A": {layer: a.detach().clone() for layer, (a, _) in self.params.items()},
                 "b": {layer: b.detach().clone() for layer, (_, b) in self.params.items()},
                 "optimizer": self.optimizer.state_dict(), "step": self.done, "settings": self.settings.to_dict(),
                 "history": self.history}
        atomic_write(self.checkpoint, lambda tmp: torch.save(state, tmp))


__all__ = ["TUNE_SETTINGS", "TuneKeywords", "TuneProgress", "TuneSettings", "heldout_kl", "train_tuned_lens"]
