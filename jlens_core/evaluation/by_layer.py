"""Evaluating lenses: per-layer KL and cross-entropy over a corpus.

:func:`evaluate` - for each lens and readable layer, the mean over a corpus's tokens of
``KL(model final || lens)`` and of the cross-entropy of the actual next token (bits). pass@k of
latent intermediate steps and the shipped sets (``pass_at_k``, ``load_eval_set``, ``EVAL_SETS``)
live in :mod:`jlens_core.evaluation.passk`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pandas as pd
import torch

from ..lenses.protocol import Lens, recorded_skip_first
from ..models.model import LensModel
from ..reading.inputs import checked_lenses, encode_prompt, model_vocab_size, record_residuals
from ..reading.logit_stats import centred_logit_stats, chunk_size, final_distribution

log = logging.getLogger(__name__)

DEFAULT_SKIP_FIRST = 16
EVALUATE_COLUMNS = ("lens", "layer", "kl_bits", "ce_bits", "n_tokens", "kl_se", "ce_se", "n_texts")

Progress = Callable[[int, int], None]




def default_skip_first(lenses: Mapping[str, Lens]) -> int:
    """The ``skip_first`` :func:`evaluate` uses when none is given.

    The largest ``skip_first`` among the lenses (the positions they were fitted at, so every lens is judged
    on the same tokens), or :data:`DEFAULT_SKIP_FIRST` (16, the fit's default) when no lens records one.
    """
    values = [value for value in map(recorded_skip_first, lenses.values()) if value is not None]
    return max(values) if values else DEFAULT_SKIP_FIRST


class _Moments:
    """Running count, sum and sum of squares (fp64) of a per-token statistic."""

    __slots__ = ("n", "s1", "s2")

    def __init__(self) -> None:
        self.n, self.s1, self.s2 = 0, 0.0, 0.0

    def add(self, values: torch.Tensor) -> None:
        v = values.double()
        self.n += int(v.numel())
        self.s1 += float(v.sum())
        self.s2 += float((v * v).sum())

    def mean(self) -> float:
        return self.s1 / self.n if self.n else math.nan

    def se(self) -> float:
        if self.n < 2:
            return math.nan
        var = max(0.0, (self.s2 - self.s1 * self.s1 / self.n) / (self.n - 1))
        return math.sqrt(var / self.n)


class Evaluation(pd.DataFrame):
    """What :func:`evaluate` returns: its table, a DataFrame (slices and copies stay one), that draws itself."""

    @property
    def _constructor(self):  # type: ignore[override]
        return Evaluation

    def figure(self) -> Any:
        """Per-layer KL and cross-entropy curves per lens, with standard-error bars, as a Plotly figure (the
        app's Evaluate page; :func:`~jlens_core.figures.evaluation.eval_curves_figure`)."""
        from ..figures.evaluation import eval_curves_figure

        return eval_curves_figure(self)


def evaluate(model: LensModel, lenses: Mapping[str, Lens], texts: Iterable[str] | str, *, max_seq_len: int | None = 128,
             skip_first: int | None = None, layers: Iterable[int] | None = None,
             progress: Progress | None = None) -> Evaluation:
    """Per-layer mean KL and cross-entropy of each lens over a corpus.

    For every text (truncated to ``max_seq_len`` tokens) the positions counted are
    ``[skip_first, seq_len - 1)``: past the attention-sink prefix and before the last position
    (which has no next token), as in the fit (docs/method.md §2). At each counted position ``p`` and layer:

    * ``KL(final || lens)`` in bits, with ``final`` the model's own output distribution;
    * cross-entropy ``-log2 p_lens(x[p+1])`` of the actual next token, in bits.

    Args:
        model: an :class:`~jlens_core.HFLensModel`.
        lenses: ``{name: lens}`` (a single lens is named by its ``kind``).
        texts: the corpus (a single string is one text).
        max_seq_len: tokens per text (``None``: no truncation).
        skip_first: positions skipped at the start of each text; default
            :func:`default_skip_first` (the Jacobian lenses' fit setting, else 16).
        layers: restrict to these layers (default: every readable layer of each lens).
        progress: called as ``progress(texts_done, n_texts)`` after each text.

    Returns:
        An :class:`Evaluation` (a DataFrame whose ``figure()`` draws it), one row per lens x layer (lenses in the given order, layers ascending), columns
        ``lens, layer, kl_bits, ce_bits, n_tokens, kl_se, ce_se, n_texts``: means over all counted
        tokens, their standard errors ``sd / sqrt(n_tokens)`` (tokens taken as independent; tokens
        of one text are correlated, so read them as a lower bound), tokens and texts counted. The
        last layer's row is the model itself (``kl_bits`` 0, ``ce_bits`` the model's loss).
        ``frame.attrs`` holds ``skip_first``, ``max_seq_len``, ``n_skipped`` (texts with no counted
        position or that could not be encoded).

    Raises:
        ValueError: no texts, no lenses, bad ``skip_first``/``max_seq_len``, or no text with a
            counted position.
        LensFileError: a lens belongs to another model.
    """
    lenses, lens_layers = checked_lenses(model, lenses, layers)
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("texts is empty: give at least one text to evaluate on.")
    skip = default_skip_first(lenses) if skip_first is None else int(skip_first)
    if skip < 0:
        raise ValueError(f"skip_first={skip_first} must be >= 0.")
    if max_seq_len is not None and int(max_seq_len) < skip + 2:
        raise ValueError(f"max_seq_len={max_seq_len} leaves no counted position with skip_first={skip}: "
                         f"it must be at least {skip + 2}.")
    vocab = model_vocab_size(model)
    top = model.n_layers - 1
    all_layers = sorted({layer for ls in lens_layers.values() for layer in ls})
    kl_acc = {(name, layer): _Moments() for name, ls in lens_layers.items() for layer in ls}
    ce_acc = {(name, layer): _Moments() for name, ls in lens_layers.items() for layer in ls}
    n_used, n_skipped = 0, 0
    step = chunk_size(vocab)

    for index, text in enumerate(texts):
        try:
            ids = encode_prompt(model, text, max_seq_len)  # [1, seq]
        except ValueError as exc:
            log.warning("text %d skipped: %s", index, exc)
            n_skipped += 1
            ids = None
        if ids is not None and ids.shape[1] - 1 - skip <= 0:
            log.info("text %d skipped: %d tokens leave no position past skip_first=%d and before the last",
                     index, ids.shape[1], skip)
            n_skipped += 1
            ids = None
        if ids is not None:
            seq_len = int(ids.shape[1])
            resid = record_residuals(model, ids, all_layers)  # {layer: [seq, d_model]}
            device = resid[top].device
            ids_row = ids[0].to(device)
            with torch.no_grad():
                for start in range(skip, seq_len - 1, step):
                    sel = torch.arange(start, min(start + step, seq_len - 1), device=device)  # [c]
                    nxt = ids_row[sel + 1]  # [c]
                    final_logits = model.unembed(resid[top][sel]).float()  # [c, vocab]
                    final_p, final_neg_entropy = final_distribution(final_logits)
                    scratch = torch.empty_like(final_logits)  # reused by every layer (no fresh pages each)
                    for name, lens in lenses.items():
                        for layer in lens_layers[name]:
                            if layer == top:
                                logits = final_logits.clone()
                            else:
                                logits = lens.logits(model, resid[layer][sel], layer).float()
                            _, _, kl, ce = centred_logit_stats(logits, final_p, final_neg_entropy, nxt, scratch)
                            kl_acc[name, layer].add(torch.zeros_like(kl) if layer == top else kl)
                            ce_acc[name, layer].add(ce)
                            del logits
            n_used += 1
            del resid
        if progress is not None:
            progress(index + 1, len(texts))

    if n_used == 0:
        raise ValueError(f"None of the {len(texts)} texts has a position to evaluate: with skip_first={skip} a "
                         f"text needs at least {skip + 2} tokens. Use longer texts or a smaller skip_first.")
    if n_skipped:
        log.info("evaluate: %d of %d texts skipped (too short or empty)", n_skipped, len(texts))
    rows = []
    for name, ls in lens_layers.items():
        for layer in ls:
            kl_m, ce_m = kl_acc[name, layer], ce_acc[name, layer]
            rows.append({"lens": name, "layer": layer, "kl_bits": kl_m.mean(), "ce_bits": ce_m.mean(),
                         "n_tokens": kl_m.n, "kl_se": kl_m.se(), "ce_se": ce_m.se(), "n_texts": n_used})
    frame = Evaluation(rows, columns=list(EVALUATE_COLUMNS))
    frame.attrs.update({"skip_first": skip, "max_seq_len": max_seq_len, "n_skipped": n_skipped})
    return frame


# -- pass@k --------------------------------------------------------------------------------------
__all__ = ["DEFAULT_SKIP_FIRST", "EVALUATE_COLUMNS", "Evaluation", "default_skip_first", "evaluate"]
