"""``read_prompt`` / ``read_prompts``: a prompt read through lenses at every layer x position (docs/method.md §6).

For every readable layer ``l`` and position ``p`` of a prompt, the lens distribution is
``softmax(unembed(J_l @ h_l[p]))`` (``J_l = I`` for the logit lens) and the model's final
distribution is ``softmax(unembed(h_{L-1}[p]))``, the model's own output. From them:

* ``top_ids`` / ``top_tokens`` / ``top_probs``: the ``top_k`` most probable tokens of the lens;
* ``entropy_bits``: entropy of the lens distribution, in bits;
* ``kl_bits``: ``KL(final || lens)`` in bits (0 at the model's output layer);
* ``ce_bits``: cross-entropy of the actual next token ``-log2 p_lens(x[p+1])`` (NaN at the last
  position, which has no next token);
* ``next_token_rank``: rank of the actual next token (missing at the last position);
* ``final_top1_rank``: rank of the model's final top-1 token at that position;
* ``rank_<token>``: rank of each pinned token.

Ranks and the statistic kernels: :mod:`~jlens_core.reading.logit_stats`; the result:
:class:`~jlens_core.reading.prompt_reading.PromptReading`.

Memory: residuals are recorded once (``layers x seq x d_model``); logits are computed for a chunk of
positions and a group of layers at a time (at most ``CHUNK_ELEMENTS`` logits per array, one array per
reading thread: on the CPU one per core, at most ``MAX_READING_WORKERS``; the statistics then pass over
``STATS_BLOCK_ELEMENTS`` of them at a time, a block that stays in the CPU's cache), and only the
returned statistics are kept, so ``layers x positions x vocab`` is never held.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch
from jaxtyping import Int

from ..lenses.protocol import Lens
from ..models.model import LensModel
from .edit_hooks import check_edits
from .generation import Generation
from .inputs import checked_lenses, encode_prompt, model_vocab_size, record_residuals, resolve_positions
from .prompt_reading import PromptReading, lens_skip_first
from .readout_protocol import Readout, no_other_keywords
from .row_arrays import ReadingArrays, RowGroupReader, RowLayout, Targets, read_rows
from .stability import (
    STABILITY_K,
    HalvesArg,
    Stability,
    check_halves,
    check_stability_k,
    half_marks,
    resolve_halves,
)
from .tokens import TokenDisplay, display_ids, encode_plain, token_id
from .word_readout import check_vocab, kept_ids_mask

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger(__name__)


def _resolve_pinned(model: LensModel, display: TokenDisplay, pinned: Iterable[str | int]) -> dict[str, int]:
    out: dict[str, int] = {}
    if isinstance(pinned, (str, int)):
        pinned = [pinned]
    for token in pinned:
        name = str(token)
        try:
            out[name] = token_id(model.tokenizer, token, rule="first", vocab_size=display.vocab_size)
        except ValueError as exc:
            raise ValueError(f"Unknown pinned token {token!r}: {exc}") from None
        if isinstance(token, str) and token not in display.token_to_id:
            n_tokens = len(encode_plain(model.tokenizer, token))
            if n_tokens > 1:
                log.info("pinned %r spans %d tokens; its rank is that of its first token %r", token, n_tokens,
                         display.texts[out[name]])
    return out



class ReadOptions(TypedDict, total=False):
    """:func:`read_prompt`'s further keywords (see its Args); ``top_k`` and ``vocab`` are the :class:`Readout`'s
    ``k`` and ``vocab`` given one by one (a keyword wins over the readout's field)."""

    top_k: int
    vocab: str
    pinned: Iterable[str | int]
    show_whitespace: bool
    max_seq_len: int | None
    word_like: bool
    n_prompt: int | None
    stability_k: int
    reuse: Mapping[str, PromptReading]


def read_prompt(model: LensModel, lens: Lens, text: str | Sequence[int] | Int[torch.Tensor, "*shape"] | Generation,
                readout: Readout | None = None, *, layers: Iterable[int] | None = None,
                positions: Iterable[int] | None = None, edits: Iterable[Any] | None = None, stability: bool = False,
                halves: tuple[Lens, Lens] | None = None, **options: Unpack[ReadOptions]) -> PromptReading:
    """Read a prompt through a lens at every layer x position (docs/method.md §6).

    Args:
        model: an :class:`~jlens_core.HFLensModel` (or anything with its interface and a tokenizer).
        lens: a :class:`~jlens_core.JacobianLens` or :class:`~jlens_core.LogitLens` for ``model``.
        text: the prompt (or its token ids, ``[seq]`` or ``[1, seq]``), tokenized with the model's
            special tokens (e.g. BOS); or a :class:`~jlens_core.reading.generation.Generation`, read as
            prompt + continuation in one pass.
        readout: the :class:`~jlens_core.reading.readout_protocol.Readout` (its ``k``: tokens kept per cell, default
            10; its ``vocab``); ``top_k=`` and ``vocab=`` give the same one by one.
        top_k: tokens kept per cell (capped at the vocabulary size).
        layers: layers to read (default all of ``lens.layers``; negatives count from the end).
            Layers a Jacobian lens was not fitted at are absent, never read as a logit lens.
        positions: positions to read (default all; negatives count from the end).
        pinned: tokens whose rank to track in a ``rank_<token>`` column each: an id, a raw vocabulary
            entry (``"ĠParis"``), or a string whose first token is used (``" Paris"``, see
            :func:`jlens_core.reading.tokens.token_id`, ``rule="first"``).
        show_whitespace: display whitespace as glyphs (``·`` ``↵`` ``→``) in token strings.
        max_seq_len: truncate the prompt to this many tokens (default: no truncation).
        word_like: restrict the top-k lists to word-like tokens (:func:`~jlens_core.reading.tokens.is_word_like`,
            stricter than ``vocab="word"``: a display filter); probabilities stay those of the full
            softmax and ranks are those ``vocab`` gives.
        n_prompt: with token ids, how many of them are the prompt (the rest are marked ``generated``);
            taken from a ``Generation``; default: all of them.
        edits: residual edits (:mod:`jlens_core.reading.edit_hooks`) applied during the forward pass: the
            reading is of the edited stream, and "final" means the edited model's own output.
        vocab: ``"all"`` (default) or ``"word"``: the word-token readout
            (:mod:`~jlens_core.reading.word_readout`, docs/method.md §9.1) leaves tokens whose text has
            no letter or digit out of the top-k lists and out of every rank; entropy, KL and CE stay
            over the full distribution.
        stability: add stability marks (docs/method.md §6.2) from the lens's split halves
            (``lens.halves()``); a lens without halves is read without marks, and the reading's
            ``stability_note`` says why (logged as a warning too).
        halves: ``(even_lens, odd_lens)`` to judge stability with (implies ``stability``), instead of
            ``lens.halves()``.
        stability_k: a cell is stable when its shown token is within the top ``stability_k`` under both
            halves (1: top-1 under both).

    Returns:
        A :class:`PromptReading` (its ``.frame`` is the long DataFrame; positions before the lens's
        ``skip_first`` are marked ``fitted = False``; with stability, :attr:`PromptReading.stability`
        holds the marks and the frame four more columns).

    Raises:
        ValueError: empty text, ``top_k < 1``, bad layers or positions, an unknown pinned token, an
            unknown ``vocab`` or a ``"word"`` readout that keeps no token, ``stability_k < 1``, or
            halves that do not fit the lens.
        LensFileError: the lens belongs to another model.
    """
    return read_prompts(model, {"lens": lens}, text, readout, layers=layers, positions=positions, edits=edits,
                        stability=stability, halves=halves, **options)["lens"]


def read_prompts(model: LensModel, lenses: Mapping[str, Lens] | Lens,
                 text: str | Sequence[int] | Int[torch.Tensor, "*shape"] | Generation,
                 readout: Readout | None = None, *, layers: Iterable[int] | None = None,
                 positions: Iterable[int] | None = None, edits: Iterable[Any] | None = None, stability: bool = False,
                 halves: HalvesArg = None, **options: Unpack[ReadOptions]) -> dict[str, PromptReading]:
    """Read one prompt through several lenses at once: :func:`read_prompt` for each, sharing the work.

    The lenses share one forward pass, the model's final distribution and its output row (the same
    for every lens), and their layers are unembedded together, several lenses' rows per matrix
    product. Each reading equals :func:`read_prompt` of that lens alone (the same arithmetic, row by
    row). The arguments are :func:`read_prompt`'s; ``layers`` applies to every lens.

    Args:
        lenses: ``{name: lens}`` (or one lens, named by its kind), e.g. ``{"logit": LogitLens.for_model(model),
            "jacobian": lens}``.
        stability: stability marks for every lens that keeps halves (the others get a
            ``stability_note``).
        halves: ``{name: (even, odd)}`` (or one pair when one lens is read): the halves to judge those
            lenses with (implies stability for them).
        reuse: ``{name: PromptReading}``, readings of some of these lenses taken before with the same arguments
            (stability aside): those lenses are not read again, only their stability marks are computed, and each
            comes back as a copy of its reading with the marks attached (the given ones are not changed). What the
            app does to add the marks to the readings it has drawn: a third of the work instead of all of it.

    Returns:
        ``{name: PromptReading}`` in the order of ``lenses``.

    Raises:
        ValueError: no lens, empty text, ``top_k < 1``, bad layers or positions, an unknown pinned token,
            an unknown ``vocab`` or a ``"word"`` readout that keeps no token; a ``reuse`` reading of a lens not
            read, or taken with other arguments (which one differs).
        LensFileError: a lens belongs to another model.
    """
    keywords: dict[str, Any] = dict(options)
    readout = (readout or Readout()).updated(keywords, {"top_k": "k"})
    if isinstance(readout.k, tuple):  # several cut-offs are pass@k's; a reading keeps one top k per cell
        raise TypeError(f"A reading keeps one top_k per cell, not {readout.k!r}: give one number, e.g. Readout(k=10).")
    top_k, vocab = 10 if readout.k is None else readout.k, readout.vocab
    pinned, show_whitespace = keywords.pop("pinned", ()), keywords.pop("show_whitespace", False)
    max_seq_len, word_like = keywords.pop("max_seq_len", None), keywords.pop("word_like", False)
    n_prompt, stability_k = keywords.pop("n_prompt", None), keywords.pop("stability_k", STABILITY_K)
    reuse = dict(keywords.pop("reuse", None) or {})
    no_other_keywords("read_prompts", keywords)
    check_vocab(vocab)
    stability_k = check_stability_k(stability_k)
    lens_map, lens_layers = checked_lenses(model, lenses, layers)
    chosen_halves, stability_notes = resolve_halves(lens_map, stability=bool(stability), halves=halves)
    for name, pair in chosen_halves.items():
        check_halves(name, lens_map[name], pair, lens_layers[name])
    source, n_prompt = _check_arguments(text, n_prompt, top_k=top_k, max_seq_len=max_seq_len)
    vocab_size = model_vocab_size(model)
    display = TokenDisplay.for_model(model)
    kept = kept_ids_mask(display, vocab, vocab_size)  # bool[vocab_size], None for "all"
    pins = _resolve_pinned(model, display, pinned)
    ids = encode_prompt(model, source, max_seq_len)  # [1, seq]
    seq_len = int(ids.shape[1])
    pos_list = resolve_positions(seq_len, positions)
    layout = RowLayout(lens_layers)
    n_prompt = seq_len if n_prompt is None else min(int(n_prompt), seq_len)
    edit_list = check_edits(model, edits)
    resid = record_residuals(model, ids, layout.all_layers, edits=edit_list, n_prompt=n_prompt)  # {layer: [seq, d]}
    targets = _targets(ids[0].to(resid[model.n_layers - 1].device), pos_list, pins, display,
                       k=min(int(top_k), vocab_size), vocab_size=vocab_size, word_like=word_like, kept=kept)
    shown_text = source if isinstance(source, str) else model.decode(ids[0].tolist())
    fields: dict[str, Any] = {"show_whitespace": bool(show_whitespace), "word_like": bool(word_like),
                              "n_prompt": n_prompt, "edits": [repr(e) for e in edit_list], "vocab": vocab}
    _check_reuse(reuse, lens_map, layout, ids, targets, fields)
    read_layout = RowLayout({name: layers for name, layers in layout.layer_lists.items() if name not in reuse})
    results = ReadingArrays(read_layout.n_rows, len(pos_list), targets, vocab_size)
    if read_layout.n_rows:
        read_rows(model, RowGroupReader(model, {n: lens_map[n] for n in read_layout.layer_lists}, read_layout, resid,
                                        results, vocab_size))
    shown = {name: reuse[name].top_ids[:, :, 0] if name in reuse else results.top_ids[read_layout.rows(name), :, 0]
             for name in chosen_halves}
    marks = {name: half_marks(model, pair, resid, layout.layer_lists[name], targets.positions, shown[name],
                              kept=targets.kept, mask=targets.mask, stability_k=stability_k, vocab_size=vocab_size)
             for name, pair in chosen_halves.items()}  # from the same residuals, after the reading's own arrays
    made = _assemble_readings(model, {n: lens_map[n] for n in read_layout.layer_lists}, read_layout, results, ids,
                              display, text=shown_text, **fields)
    readings = {name: copy.copy(reuse[name]) if name in reuse else made[name] for name in lens_map}
    return _with_stability(readings, marks, stability_notes)


def _check_reuse(reuse: Mapping[str, PromptReading], lenses: Mapping[str, Lens], layout: RowLayout, ids: torch.Tensor,
                 targets: Targets, fields: Mapping[str, Any]) -> None:
    """Raise unless every ``reuse`` reading is of a lens read here, with this call's prompt and arguments.

    Raises:
        ValueError: a name not among the lenses, or the first field that differs (one sentence).
    """
    want = {"input_ids": ids[0].cpu().numpy(), "positions": targets.positions.cpu().numpy(), "top_k": targets.k,
            "pinned": dict(zip(targets.pin_names, targets.pin_ids.tolist())), **fields}
    for name, reading in reuse.items():
        if name not in lenses:
            raise ValueError(f"reuse names {name!r}, which is not among the lenses read ({list(lenses)}).")
        if not isinstance(reading, PromptReading):
            raise TypeError(f"reuse[{name!r}] is a {type(reading).__name__}, not a PromptReading.")
        for field_name, value in {"layers": layout.layer_lists[name], **want}.items():
            if not _same(getattr(reading, field_name), value):
                raise ValueError(f"reuse[{name!r}] was read with another {field_name} ({getattr(reading, field_name)!r} "
                                 f"against {value!r}): reuse only readings taken with the same arguments.")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return bool(a == b)


def _with_stability(readings: dict[str, PromptReading], marks: Mapping[str, Stability],
                    notes: Mapping[str, str]) -> dict[str, PromptReading]:
    """The readings with their stability marks and notes attached (the others untouched)."""
    for name, reading in readings.items():
        reading.stability = marks.get(name)
        reading.stability_note = notes.get(name, "")
    return readings


def _check_arguments(text: str | Sequence[int] | torch.Tensor | Generation, n_prompt: int | None, *, top_k: int,
                     max_seq_len: int | None) -> tuple[str | Sequence[int] | np.ndarray | torch.Tensor, int | None]:
    """``(text, n_prompt)`` with a :class:`Generation` unpacked into its ids and prompt length.

    Raises:
        ValueError: an empty text, a negative or contradicting ``n_prompt``, ``top_k < 1`` or ``max_seq_len < 1``.
    """
    source: str | Sequence[int] | np.ndarray | torch.Tensor
    if isinstance(text, Generation):
        if n_prompt is not None and int(n_prompt) != text.n_prompt:
            raise ValueError(f"n_prompt={n_prompt} contradicts the generation's {text.n_prompt} prompt tokens.")
        n_prompt, source = text.n_prompt, text.ids
    else:
        source = text
    if isinstance(source, str) and not source:
        raise ValueError("The prompt is empty: give some text to read.")
    if n_prompt is not None and int(n_prompt) < 0:
        raise ValueError(f"n_prompt={n_prompt} must be >= 0.")
    if int(top_k) < 1:
        raise ValueError(f"top_k={top_k} must be at least 1.")
    if max_seq_len is not None and int(max_seq_len) < 1:
        raise ValueError(f"max_seq_len={max_seq_len} must be at least 1 (or None for no truncation).")
    return source, n_prompt


def _targets(ids_row: torch.Tensor, pos_list: list[int], pins: dict[str, int], display: TokenDisplay, *, k: int,
             vocab_size: int, word_like: bool, kept: np.ndarray | None) -> Targets:
    """The read positions, their next tokens, the pinned ids and the top-k settings, on ``ids_row``'s device.

    ``ids_row``: ``LongTensor[seq]`` the prompt. ``kept``: ``bool[vocab_size]`` the ids of the word-token
    readout (None: all): ranks count only them above a token, and top-k lists only them. With
    ``word_like`` top-k lists only word-like tokens (and ``k`` is capped at how many there are).
    """
    device, seq_len = ids_row.device, int(ids_row.shape[0])
    pos_t = torch.tensor(pos_list, dtype=torch.long, device=device)  # [n_pos]
    next_t = torch.where(pos_t + 1 < seq_len, ids_row[(pos_t + 1).clamp_max(seq_len - 1)],
                         torch.full_like(pos_t, -1))  # [n_pos]
    pin_names = list(pins)
    pin_t = torch.tensor([pins[n] for n in pin_names], dtype=torch.long, device=device)  # [n_pinned]
    mask = kept_t = None
    if kept is not None:
        mask = torch.tensor(kept, device=device)  # [vocab_size] bool (a copy: the cached mask is read-only)
        kept_t = mask.to(torch.float32)  # [vocab_size] 0/1, the weights of the rank counts
    if word_like:
        mask_np = display.word_like_mask()[:vocab_size]
        word_like_t = torch.as_tensor(np.pad(mask_np, (0, vocab_size - len(mask_np))), device=device)  # [vocab_size]
        mask = word_like_t if mask is None else mask & word_like_t
    if mask is not None:
        k = max(1, min(k, int(mask.sum())))
    return Targets(pos_t, next_t, pin_names, pin_t, mask, k, kept_t)


def _assemble_readings(model: LensModel, lenses: Mapping[str, Lens], layout: RowLayout, results: ReadingArrays,
                       ids: torch.Tensor, display: TokenDisplay, *, text: str, show_whitespace: bool, word_like: bool,
                       n_prompt: int, edits: list[str], vocab: str) -> dict[str, PromptReading]:
    """One :class:`PromptReading` per lens, from its rows of ``results``; no two share a mutable array.

    ``ids``: ``LongTensor[1, seq]`` the prompt read; the keyword arguments are the readings' fields
    (``display`` the cached one, shared). Each reading's ``skip_first`` is its lens's
    (:func:`~jlens_core.reading.prompt_reading.lens_skip_first`).
    """
    input_ids = ids[0].cpu().numpy().astype(np.int64)
    strings = display.strings(show_whitespace)
    tokens = display_ids(display, input_ids, show_whitespace=show_whitespace)
    targets = results.targets
    readings = {}
    for name, lens in lenses.items():
        readings[name] = PromptReading(
            model_name=str(model.name), lens_kind=str(lens.kind),
            input_ids=input_ids, tokens=list(tokens), layers=list(layout.layer_lists[name]),
            positions=targets.positions.cpu().numpy().astype(np.int64), output_layer=model.n_layers - 1,
            top_k=targets.k, show_whitespace=show_whitespace, word_like=word_like,
            pinned=dict(zip(targets.pin_names, targets.pin_ids.tolist())),
            next_ids=targets.next_ids.cpu().numpy().astype(np.int64), vocab_strings=strings,
            text=text, n_prompt=n_prompt, edits=list(edits), vocab=vocab, display=display,
            skip_first=lens_skip_first(lens), **results.reading_fields(layout.rows(name)))
    return readings


__all__ = ["read_prompt", "read_prompts"]
