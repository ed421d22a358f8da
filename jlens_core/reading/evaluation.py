"""Evaluating lenses: per-layer KL and cross-entropy over a corpus, and pass@k on latent steps.

* :func:`evaluate` - for each lens and readable layer, the mean over a corpus's tokens of
  ``KL(model final || lens)`` and of the cross-entropy of the actual next token (bits).
* :func:`pass_at_k` - for prompts whose answer needs an intermediate step (``{"prompt",
  "intermediates", "target"}``), how often each intermediate word appears among a lens's top ``k``
  at some layer, at the prompt's last position.
* :func:`load_eval_set` / :data:`EVAL_SETS` - the example sets shipped in ``assets/evaluations/``.

Ranks are 1-based over the full vocabulary (see :mod:`jlens_core.reading.readings`): an intermediate
passes at ``k`` when its best rank is ``<= k``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from .._paths import ASSETS_DIR
from .readings import (
    check_lens,
    chunk_size,
    distribution_stats,
    encode_prompt,
    model_vocab_size,
    rank_of,
    readable_layers,
    record_residuals,
)
from .tokens import word_token_ids

log = logging.getLogger(__name__)

DEFAULT_SKIP_FIRST = 16
EVAL_DIR = ASSETS_DIR / "evaluations"
EVAL_SETS: dict[str, str] = {
    "two_hop": "two-hop facts: a landmark or capital names a country, the country names the answer",
    "arithmetic_chain": "two-step arithmetic: the first operation's result is the intermediate",
    "antonym_chain": "'the opposite of the opposite of X': the antonym is the intermediate, X the answer",
    "translation_pivot": "French to Spanish word translation: the English word is the intermediate",
}
EVALUATE_COLUMNS = ("lens", "layer", "kl_bits", "ce_bits", "n_tokens", "kl_se", "ce_se", "n_texts")
PASS_COLUMNS = ("lens", "k", "pass_rate", "n_passed", "n_intermediates", "n_items")
DETAIL_COLUMNS = ("item", "lens", "role", "word", "token_ids", "best_rank", "best_layer", "final_rank")

Progress = Callable[[int, int], None]


def _as_lens_dict(lenses: Any) -> dict[str, Any]:
    if isinstance(lenses, Mapping):
        out = {str(name): lens for name, lens in lenses.items()}
    elif hasattr(lenses, "transport"):
        out = {str(getattr(lenses, "kind", "lens")): lenses}
    else:
        raise ValueError("lenses must be a dict {name: lens}, e.g. {'jacobian': lens, 'logit': "
                         "LogitLens.for_model(model)}.")
    if not out:
        raise ValueError("lenses is empty: give at least one lens, e.g. {'logit': LogitLens.for_model(model)}.")
    return out


def default_skip_first(lenses: Mapping[str, Any]) -> int:
    """The ``skip_first`` :func:`evaluate` uses when none is given.

    The largest ``settings["skip_first"]`` among the Jacobian lenses (the positions they were fitted
    at, so every lens is judged on the same tokens), or :data:`DEFAULT_SKIP_FIRST` (16, the fit's
    default) when no lens records one.
    """
    values = [int(lens.settings["skip_first"]) for lens in lenses.values()
              if isinstance(getattr(lens, "settings", None), dict) and lens.settings.get("skip_first") is not None]
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


def evaluate(model: Any, lenses: Mapping[str, Any], texts: Iterable[str] | str, *, max_seq_len: int | None = 128,
             skip_first: int | None = None, layers: Iterable[int] | None = None,
             progress: Progress | None = None) -> pd.DataFrame:
    """Per-layer mean KL and cross-entropy of each lens over a corpus.

    For every text (truncated to ``max_seq_len`` tokens) the positions counted are
    ``[skip_first, seq_len - 1)``: past the attention-sink prefix and before the last position
    (which has no next token), as in the fit (SPEC §2). At each counted position ``p`` and layer:

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
        DataFrame, one row per lens x layer (lenses in the given order, layers ascending), columns
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
    lenses = _as_lens_dict(lenses)
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("texts is empty: give at least one text to evaluate on.")
    skip = default_skip_first(lenses) if skip_first is None else int(skip_first)
    if skip < 0:
        raise ValueError(f"skip_first={skip_first} must be >= 0.")
    if max_seq_len is not None and int(max_seq_len) < skip + 2:
        raise ValueError(f"max_seq_len={max_seq_len} leaves no counted position with skip_first={skip}: "
                         f"it must be at least {skip + 2}.")
    for lens in lenses.values():
        check_lens(model, lens)
    vocab = model_vocab_size(model)
    top = model.n_layers - 1
    lens_layers = {name: readable_layers(model, lens, layers) for name, lens in lenses.items()}
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
                    final_logp = final_logits.log_softmax(-1)
                    final_p = final_logp.exp()
                    for name, lens in lenses.items():
                        for layer in lens_layers[name]:
                            if layer == top:
                                logits = final_logits
                            else:
                                logits = model.unembed(lens.transport(resid[layer][sel], layer)).float()
                            _, _, kl, ce = distribution_stats(logits, final_logp, final_p, nxt)
                            kl_acc[name, layer].add(kl)
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
            kl, ce = kl_acc[name, layer], ce_acc[name, layer]
            rows.append({"lens": name, "layer": layer, "kl_bits": kl.mean(), "ce_bits": ce.mean(),
                         "n_tokens": kl.n, "kl_se": kl.se(), "ce_se": ce.se(), "n_texts": n_used})
    frame = pd.DataFrame(rows, columns=list(EVALUATE_COLUMNS))
    frame.attrs.update({"skip_first": skip, "max_seq_len": max_seq_len, "n_skipped": n_skipped})
    return frame


# -- pass@k --------------------------------------------------------------------------------------
def _check_items(items: Any) -> list[dict]:
    if isinstance(items, (str, os.PathLike)):
        return load_eval_set(items)
    items = list(items)
    if not items:
        raise ValueError("items is empty: give at least one {'prompt', 'intermediates', 'target'} item.")
    return [_check_item(item, f"item {i}") for i, item in enumerate(items)]


def _check_item(item: Any, where: str) -> dict:
    if not isinstance(item, Mapping):
        # A malformed line of a data file is bad input (ValueError, shown by the CLI), not a caller's bug.
        raise ValueError(f"{where}: expected an object with 'prompt', 'intermediates' and 'target', got "  # noqa: TRY004
                         f"{type(item).__name__}.")
    missing = [key for key in ("prompt", "intermediates", "target") if key not in item]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; each item needs 'prompt', 'intermediates' and "
                         "'target'.")
    prompt, inter, target = item["prompt"], item["intermediates"], item["target"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}.")
    if isinstance(inter, str):
        inter = [inter]
    if not isinstance(inter, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in inter):
        raise ValueError(f"{where}: 'intermediates' must be a list of non-empty strings, got {inter!r}.")
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"{where}: 'target' must be a non-empty string, got {target!r}.")
    return {**dict(item), "prompt": prompt, "intermediates": list(inter), "target": target}


def pass_at_k_detail(model: Any, lenses: Mapping[str, Any], items: Iterable[Mapping] | str, *,
                     layers: Iterable[int] | None = None, progress: Progress | None = None) -> pd.DataFrame:
    """Best ranks of each item's intermediate and target words, per lens, at the last position.

    A word's candidates are the first token of the word with and without a leading space
    (:func:`jlens_core.reading.tokens.word_token_ids`); its rank at a layer is the better (smaller) of the
    candidates' ranks, over the full vocabulary, 1-based.

    Args:
        items: ``{"prompt", "intermediates", "target"}`` dicts, or the name/path of an eval set.
        layers: layers searched (default: every readable layer of each lens, the output included).
        progress: called as ``progress(items_done, n_items)``.

    Returns:
        DataFrame, one row per item x lens x word, columns ``item`` (index in ``items``), ``lens``,
        ``role`` (``"intermediate"`` or ``"target"``), ``word``, ``token_ids`` (the candidates),
        ``best_rank`` (best over the searched layers), ``best_layer`` (lowest layer reaching it),
        ``final_rank`` (rank in the model's own output).

    Raises:
        ValueError: malformed items, a word that cannot be tokenized, no lenses.
        LensFileError: a lens belongs to another model.
    """
    lenses = _as_lens_dict(lenses)
    items = _check_items(items)
    for lens in lenses.values():
        check_lens(model, lens)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"The model {getattr(model, 'name', model)!r} has no tokenizer to look words up with.")
    top = model.n_layers - 1
    lens_layers = {name: readable_layers(model, lens, layers) for name, lens in lenses.items()}
    all_layers = sorted({layer for ls in lens_layers.values() for layer in ls})
    rows = []
    for index, item in enumerate(items):
        words = [("intermediate", w) for w in item["intermediates"]] + [("target", item["target"])]
        try:
            candidates = [word_token_ids(tokenizer, w) for _, w in words]
        except ValueError as exc:
            raise ValueError(f"item {index}: {exc}") from None
        ids = encode_prompt(model, item["prompt"], None)  # [1, seq]
        resid = record_residuals(model, ids, all_layers)  # {layer: [seq, d_model]}
        device = resid[top].device
        cand_t = [torch.tensor(c, dtype=torch.long, device=device) for c in candidates]
        with torch.no_grad():
            final_logits = model.unembed(resid[top][-1:]).float()  # [1, vocab]
            final_ranks = [int(_best_rank(final_logits, c)[0]) for c in cand_t]
            for name, lens in lenses.items():
                ls = lens_layers[name]
                h = torch.stack([lens.transport(resid[layer][-1], layer) for layer in ls])  # [n_layers, d_model]
                logits = model.unembed(h).float()  # [n_layers, vocab]
                if top in ls:
                    logits[ls.index(top)] = final_logits[0]
                for (role, word), cands, c_t, final_rank in zip(words, candidates, cand_t, final_ranks):
                    per_layer = _best_rank(logits, c_t)  # [n_layers]
                    best = int(per_layer.min())
                    rows.append({"item": index, "lens": name, "role": role, "word": word, "token_ids": cands,
                                 "best_rank": best, "best_layer": ls[int(torch.argmax((per_layer == best).int()))],
                                 "final_rank": final_rank})
        del resid
        if progress is not None:
            progress(index + 1, len(items))
    return pd.DataFrame(rows, columns=list(DETAIL_COLUMNS))


def _best_rank(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``LongTensor[n]``: per row of ``logits [n, vocab]``, the best 1-based rank among ``candidates``."""
    ranks = torch.stack([rank_of(logits, c.expand(logits.shape[0])) for c in candidates], dim=-1)  # [n, n_cand]
    return ranks.min(-1).values


def summarize_pass_at_k(detail: pd.DataFrame, k: Sequence[int] | int = (1, 5, 10)) -> pd.DataFrame:
    """pass@k from a :func:`pass_at_k_detail` frame: the share of intermediates with best rank ``<= k``.

    Returns:
        DataFrame, one row per lens x k, columns ``lens, k, pass_rate, n_passed, n_intermediates,
        n_items``.

    Raises:
        ValueError: a ``k`` below 1, or an empty ``k``.
    """
    ks = [k] if isinstance(k, int) else [int(x) for x in k]
    if not ks or any(x < 1 for x in ks):
        raise ValueError(f"k={k} must be one or more integers >= 1 (ranks are 1-based: k=1 is top-1).")
    inter = detail[detail["role"] == "intermediate"]
    rows = []
    for name in dict.fromkeys(detail["lens"]):
        sub = inter[inter["lens"] == name]
        n_items = int(detail.loc[detail["lens"] == name, "item"].nunique())
        for kk in ks:
            n_passed = int((sub["best_rank"] <= kk).sum())
            rows.append({"lens": name, "k": kk, "pass_rate": n_passed / len(sub) if len(sub) else math.nan,
                         "n_passed": n_passed, "n_intermediates": len(sub), "n_items": n_items})
    return pd.DataFrame(rows, columns=list(PASS_COLUMNS))


def pass_at_k(model: Any, lenses: Mapping[str, Any], items: Iterable[Mapping] | str, *,
              k: Sequence[int] | int = (1, 5, 10), layers: Iterable[int] | None = None,
              progress: Progress | None = None, return_detail: bool = False
              ) -> pd.DataFrame | tuple[pd.DataFrame, pd.DataFrame]:
    """pass@k of latent intermediate steps, per lens.

    Items are ``{"prompt", "intermediates", "target"}``. An intermediate passes at ``k`` when its
    best rank over the searched layers, at the prompt's last position, is ``<= k`` (first token of
    the word, with and without a leading space; ranks 1-based over the full vocabulary). The
    target is looked up too (in the detail table) but does not enter ``pass_rate``.

    Args:
        items: the items, or the name of a shipped set (:data:`EVAL_SETS`) or a ``.jsonl`` path.
        k: one or more cut-offs.
        layers: layers searched (default: every readable layer of each lens).
        progress: called as ``progress(items_done, n_items)``.
        return_detail: also return the per-item table of :func:`pass_at_k_detail`.

    Returns:
        DataFrame ``lens, k, pass_rate, n_passed, n_intermediates, n_items`` (one row per lens x k);
        with ``return_detail``, the pair ``(summary, detail)``.

    Raises:
        ValueError: malformed items or ``k``, a word that cannot be tokenized, no lenses.
        LensFileError: a lens belongs to another model.
    """
    ks = [k] if isinstance(k, int) else list(k)
    if not ks or any(int(x) < 1 for x in ks):
        raise ValueError(f"k={k} must be one or more integers >= 1 (ranks are 1-based: k=1 is top-1).")
    detail = pass_at_k_detail(model, lenses, items, layers=layers, progress=progress)
    summary = summarize_pass_at_k(detail, ks)
    return (summary, detail) if return_detail else summary


# -- shipped evaluation sets -----------------------------------------------------------------------
def load_eval_set(name_or_path: str | os.PathLike) -> list[dict]:
    """Items of an evaluation set: a shipped name (:data:`EVAL_SETS`) or a ``.jsonl`` file.

    Each non-blank line is a JSON object ``{"prompt": str, "intermediates": [str, ...], "target":
    str}`` (other fields are kept; a single intermediate may be a plain string).

    Raises:
        FileNotFoundError: neither a shipped name nor an existing file (the message lists the names).
        ValueError: a line that is not JSON or lacks a field (the message gives file and line).
    """
    text = str(name_or_path)
    if text in EVAL_SETS or (EVAL_DIR / f"{text}.jsonl").is_file():
        path = EVAL_DIR / f"{text}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"The evaluation set {text!r} should be at {str(path)!r} but is missing: "
                                    "reinstall jlens from its source tree.")
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"No evaluation set {text!r}: give a .jsonl file or one of "
                                    f"{sorted(EVAL_SETS)}.")
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg}).") from None
            items.append(_check_item(obj, f"{path}:{lineno}"))
    if not items:
        raise ValueError(f"{path} holds no items.")
    return items


__all__ = ["DEFAULT_SKIP_FIRST", "DETAIL_COLUMNS", "EVALUATE_COLUMNS", "EVAL_DIR", "EVAL_SETS", "PASS_COLUMNS",
           "default_skip_first", "evaluate", "load_eval_set", "pass_at_k", "pass_at_k_detail",
           "summarize_pass_at_k"]
