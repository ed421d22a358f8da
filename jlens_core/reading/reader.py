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

Ranks and the statistic kernels: :mod:`~jlens_core.reading.logit_stats`; the result:
:class:`~jlens_core.reading.prompt_reading.PromptReading`.

Memory: residuals are recorded once (``layers x seq x d_model``); logits are computed for a chunk of
positions and a group of layers at a time (at most ``CHUNK_ELEMENTS`` logits per array, one array per
reading thread: on the CPU one per core, at most ``MAX_READING_WORKERS``; the statistics then pass over
``STATS_BLOCK_ELEMENTS`` of them at a time, a block that stays in the CPU's cache), and only the
returned statistics are kept, so ``layers x positions x vocab`` is never held.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from . import logit_stats
from .edits import check_edits
from .generation import Generation
from .inputs import (
    as_lens_dict,
    check_lens,
    encode_prompt,
    model_vocab_size,
    readable_layers,
    record_residuals,
    resolve_positions,
)
from .logit_stats import centred_logit_stats, chunk_size, final_distribution, rank_of
from .openmp_workers import run_in_workers
from .prompt_reading import PromptReading
from .tokens import TokenDisplay, display_ids, encode_plain, token_id_for

log = logging.getLogger(__name__)


def _resolve_pinned(model: Any, display: TokenDisplay, pinned: Iterable[str | int]) -> dict[str, int]:
    out: dict[str, int] = {}
    if isinstance(pinned, (str, int)):
        pinned = [pinned]
    for token in pinned:
        name = str(token)
        try:
            out[name] = token_id_for(model.tokenizer, token, vocab_size=display.vocab_size)
        except ValueError as exc:
            raise ValueError(f"Unknown pinned token {token!r}: {exc}") from None
        if isinstance(token, str) and token not in display.token_to_id:
            n_tokens = len(encode_plain(model.tokenizer, token))
            if n_tokens > 1:
                log.info("pinned %r spans %d tokens; its rank is that of its first token %r", token, n_tokens,
                         display.texts[out[name]])
    return out



def read_prompt(model: Any, lens: Any, text: str | Sequence[int] | torch.Tensor | Generation, *, top_k: int = 10,
                layers: Iterable[int] | None = None, positions: Iterable[int] | None = None,
                pinned: Iterable[str | int] = (), show_whitespace: bool = False,
                max_seq_len: int | None = None, word_like: bool = False, n_prompt: int | None = None,
                edits: Iterable[Any] | None = None) -> PromptReading:
    """Read a prompt through a lens at every layer x position (SPEC §6).

    Args:
        model: an :class:`~jlens_core.HFLensModel` (or anything with its interface and a tokenizer).
        lens: a :class:`~jlens_core.JacobianLens` or :class:`~jlens_core.LogitLens` for ``model``.
        text: the prompt (or its token ids, ``[seq]`` or ``[1, seq]``), tokenized with the model's
            special tokens (e.g. BOS); or a :class:`~jlens_core.reading.generation.Generation`, read as
            prompt + continuation in one pass.
        top_k: tokens kept per cell (capped at the vocabulary size).
        layers: layers to read (default all of ``lens.layers``; negatives count from the end).
            Layers a Jacobian lens was not fitted at are absent, never read as a logit lens.
        positions: positions to read (default all; negatives count from the end).
        pinned: tokens whose rank to track in a ``rank_<token>`` column each: an id, a raw vocabulary
            entry (``"ĠParis"``), or a string whose first token is used (``" Paris"``, see
            :func:`jlens_core.reading.tokens.token_id_for`).
        show_whitespace: display whitespace as glyphs (``·`` ``↵`` ``→``) in token strings.
        max_seq_len: truncate the prompt to this many tokens (default: no truncation).
        word_like: restrict the top-k lists to word-like tokens (:func:`~jlens_core.reading.tokens.is_word_like`);
            probabilities stay those of the full softmax and ranks stay over the full vocabulary.
        n_prompt: with token ids, how many of them are the prompt (the rest are marked ``generated``);
            taken from a ``Generation``; default: all of them.
        edits: residual edits (:mod:`jlens_core.reading.edits`) applied during the forward pass: the
            reading is of the edited stream, and "final" means the edited model's own output.

    Returns:
        A :class:`PromptReading` (its ``.frame`` is the long DataFrame).

    Raises:
        ValueError: empty text, ``top_k < 1``, bad layers or positions, an unknown pinned token.
        LensFileError: the lens belongs to another model.
    """
    return read_prompts(model, {"lens": lens}, text, top_k=top_k, layers=layers, positions=positions,
                        pinned=pinned, show_whitespace=show_whitespace, max_seq_len=max_seq_len,
                        word_like=word_like, n_prompt=n_prompt, edits=edits)["lens"]


def read_prompts(model: Any, lenses: Mapping[str, Any] | Any, text: str | Sequence[int] | torch.Tensor | Generation,
                 *, top_k: int = 10, layers: Iterable[int] | None = None, positions: Iterable[int] | None = None,
                 pinned: Iterable[str | int] = (), show_whitespace: bool = False,
                 max_seq_len: int | None = None, word_like: bool = False, n_prompt: int | None = None,
                 edits: Iterable[Any] | None = None) -> dict[str, PromptReading]:
    """Read one prompt through several lenses at once: :func:`read_prompt` for each, sharing the work.

    The lenses share one forward pass, the model's final distribution and its output row (the same
    for every lens), and their layers are unembedded together, several lenses' rows per matrix
    product. Each reading equals :func:`read_prompt` of that lens alone (the same arithmetic, row by
    row). The arguments are :func:`read_prompt`'s; ``layers`` applies to every lens.

    Args:
        lenses: ``{name: lens}`` (or one lens, named by its kind), e.g. ``{"logit": LogitLens.for_model(model),
            "jacobian": lens}``.

    Returns:
        ``{name: PromptReading}`` in the order of ``lenses``.

    Raises:
        ValueError: no lens, empty text, ``top_k < 1``, bad layers or positions, an unknown pinned token.
        LensFileError: a lens belongs to another model.
    """
    lens_map = as_lens_dict(lenses)
    if isinstance(text, Generation):
        if n_prompt is not None and int(n_prompt) != text.n_prompt:
            raise ValueError(f"n_prompt={n_prompt} contradicts the generation's {text.n_prompt} prompt tokens.")
        n_prompt, text = text.n_prompt, text.ids
    if isinstance(text, str) and not text:
        raise ValueError("The prompt is empty: give some text to read.")
    if n_prompt is not None and int(n_prompt) < 0:
        raise ValueError(f"n_prompt={n_prompt} must be >= 0.")
    if int(top_k) < 1:
        raise ValueError(f"top_k={top_k} must be at least 1.")
    if max_seq_len is not None and int(max_seq_len) < 1:
        raise ValueError(f"max_seq_len={max_seq_len} must be at least 1 (or None for no truncation).")
    for lens in lens_map.values():
        check_lens(model, lens)
    vocab = model_vocab_size(model)
    display = TokenDisplay.for_model(model)
    pins = _resolve_pinned(model, display, pinned)
    ids = encode_prompt(model, text, max_seq_len)  # [1, seq]
    seq_len = int(ids.shape[1])
    pos_list = resolve_positions(seq_len, positions)
    layer_lists = {name: readable_layers(model, lens, layers) for name, lens in lens_map.items()}
    top = model.n_layers - 1
    k = min(int(top_k), vocab)

    n_prompt = seq_len if n_prompt is None else min(int(n_prompt), seq_len)
    edit_list = check_edits(model, edits)
    all_layers = sorted(set().union(*layer_lists.values()))
    resid = record_residuals(model, ids, all_layers, edits=edit_list, n_prompt=n_prompt)  # {layer: [seq, d]}
    device = resid[top].device
    ids_row = ids[0].to(device)  # [seq]
    pos_t = torch.tensor(pos_list, dtype=torch.long, device=device)  # [n_pos]
    next_t = torch.where(pos_t + 1 < seq_len, ids_row[(pos_t + 1).clamp_max(seq_len - 1)],
                         torch.full_like(pos_t, -1))  # [n_pos]
    pin_names = list(pins)
    pin_t = torch.tensor([pins[n] for n in pin_names], dtype=torch.long, device=device)  # [n_pinned]
    mask = None
    if word_like:
        mask_np = display.word_like_mask()[:vocab]
        mask = torch.as_tensor(np.pad(mask_np, (0, vocab - len(mask_np))), device=device)  # [vocab] bool
        k = max(1, min(k, int(mask.sum())))

    # Every lens's layers are rows of one set of arrays (lens after lens); each reading gets its slice.
    row_lens: list[str] = []  # [n_rows] the lens of each row
    row_layer: list[int] = []  # [n_rows] the layer of each row
    first_row: dict[str, int] = {}
    for name, layer_list in layer_lists.items():
        first_row[name] = len(row_lens)
        row_lens += [name] * len(layer_list)
        row_layer += layer_list
    n_rows, n_p = len(row_lens), len(pos_list)
    top_ids = np.zeros((n_rows, n_p, k), dtype=np.int64)
    top_probs = np.zeros((n_rows, n_p, k), dtype=np.float32)
    entropy = np.zeros((n_rows, n_p))
    kl = np.zeros((n_rows, n_p))
    ce = np.zeros((n_rows, n_p))
    next_rank = np.zeros((n_rows, n_p))
    final_rank = np.zeros((n_rows, n_p), dtype=np.int64)
    pin_ranks = {name: np.zeros((n_rows, n_p), dtype=np.int64) for name in pin_names}
    final_top1 = np.zeros(n_p, dtype=np.int64)
    per_row_arrays = [top_ids, top_probs, entropy, kl, ce, next_rank, final_rank, *pin_ranks.values()]

    block = max(1, logit_stats.STATS_BLOCK_ELEMENTS // vocab)  # logit rows per statistics block

    def write_stats(rows: list[int], sl: slice, z: torch.Tensor, final_p: torch.Tensor,
                    final_neg_entropy: torch.Tensor, nxt: torch.Tensor, f_top1: torch.Tensor,
                    arrays: dict[str, torch.Tensor]) -> None:
        # z: [g, c, vocab] fp32 logits of the rows ``rows`` at positions sl, passed to write_block in
        # blocks of at most STATS_BLOCK_ELEMENTS logits: several rows of all c positions, or (c past a
        # block) one row's run of positions
        c = z.shape[1]
        n_pos, n_layers = min(c, block), max(1, block // c)
        for b0 in range(0, len(rows), n_layers):
            for p0 in range(0, c, n_pos):
                p1 = min(c, p0 + n_pos)
                write_block(rows[b0: b0 + n_layers], slice(sl.start + p0, sl.start + p1), z[b0: b0 + n_layers, p0:p1],
                            final_p[p0:p1], final_neg_entropy[p0:p1], nxt[p0:p1], f_top1[p0:p1], arrays)

    def write_block(rows: list[int], sl: slice, z: torch.Tensor, final_p: torch.Tensor,
                    final_neg_entropy: torch.Tensor, nxt: torch.Tensor, f_top1: torch.Tensor,
                    arrays: dict[str, torch.Tensor]) -> None:
        # the rows are disjoint between workers, so their writes into the result arrays never meet
        g = z.shape[0]
        scratch = reused(arrays, "scratch", z.shape, z.dtype, z.device)
        log_norm, ent, kld, cel = centred_logit_stats(z, final_p, final_neg_entropy, nxt, scratch)  # z centred
        entropy[rows, sl] = ent.double().cpu().numpy()
        kl[rows, sl] = kld.double().cpu().numpy()
        ce[rows, sl] = cel.double().cpu().numpy()
        nr = rank_of(z, nxt.clamp_min(0).expand(g, -1), scratch).double()
        next_rank[rows, sl] = torch.where(nxt >= 0, nr, torch.full_like(nr, float("nan"))).cpu().numpy()
        final_rank[rows, sl] = rank_of(z, f_top1.expand(g, -1), scratch).cpu().numpy()
        for j, name in enumerate(pin_names):
            pin_ranks[name][rows, sl] = rank_of(z, pin_t[j].expand(g, z.shape[1]), scratch).cpu().numpy()
        if mask is None:
            top_z, indices = z.topk(k, dim=-1)  # [g, c, k]
        else:
            indices = torch.where(mask, z, scratch.fill_(float("-inf"))).topk(k, dim=-1)[1]
            top_z = z.gather(-1, indices)
        top_ids[rows, sl] = indices.cpu().numpy()
        top_probs[rows, sl] = (top_z - log_norm[..., None]).exp().cpu().numpy()

    # One logits array holds at most CHUNK_ELEMENTS: ``c`` positions of ``group`` rows at a time,
    # unembedded by one matmul (a few large products run far closer to the matmul peak than one per layer).
    rows_per_array = chunk_size(vocab)
    takes_out = "out" in inspect.signature(model.unembed).parameters  # HFLensModel does; a protocol model may not

    def reused(arrays: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        # One array per role and worker for every group (grown when needed): a fresh 64 MB array per
        # group costs more in page faults than its arithmetic.
        n = math.prod(shape)
        array = arrays.get(name)
        if array is None or array.numel() < n or array.dtype != dtype or array.device != device:
            array = arrays[name] = torch.empty(n, dtype=dtype, device=device)
        return array[:n].view(shape)

    def unembed_into_reused(carried: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        if not takes_out:
            return model.unembed(carried)
        dtype = getattr(model, "dtype", carried.dtype)
        return model.unembed(carried, out=reused(arrays, "logits", (carried.shape[0], vocab), dtype, carried.device))

    def read_group(task: tuple, arrays: dict[str, torch.Tensor]) -> None:
        # one group of rows at one chunk of positions: transported, unembedded by one matmul, its statistics
        rows, (sl, sel, final_p, final_neg_entropy, nxt, f_top1) = task
        carried = torch.cat([lens_map[row_lens[r]].transport(resid[row_layer[r]][sel], row_layer[r])
                             for r in rows])  # [g * c, d_model]
        z = unembed_into_reused(carried, arrays).float().view(len(rows), len(sel), -1)  # [g, c, vocab]
        write_stats(rows, sl, z, final_p, final_neg_entropy, nxt, f_top1, arrays)

    # The output row is the model's own distribution whatever the lens: read once, copied to the others.
    top_rows = [r for r in range(n_rows) if row_layer[r] == top]
    lens_rows = [r for r in range(n_rows) if row_layer[r] != top]
    main_arrays: dict[str, torch.Tensor] = {}
    worker_arrays: list[dict[str, torch.Tensor]] = []
    with torch.no_grad():
        for start in range(0, n_p, rows_per_array):
            sl = slice(start, start + rows_per_array)
            sel = pos_t[sl]  # [c]
            nxt = next_t[sl]  # [c]
            c = int(sel.numel())
            final_logits = model.unembed(resid[top][sel]).float()  # [c, vocab]
            final_p, final_neg_entropy = final_distribution(final_logits)
            f_top1 = final_logits.argmax(-1)  # [c]
            final_top1[sl] = f_top1.cpu().numpy()
            if top_rows:  # KL exactly 0
                write_stats(top_rows[:1], sl, final_logits[None], final_p, final_neg_entropy, nxt, f_top1, main_arrays)
                kl[top_rows[0], sl] = 0.0
            group = max(1, rows_per_array // c)
            chunk = (sl, sel, final_p, final_neg_entropy, nxt, f_top1)
            tasks = [(lens_rows[g0: g0 + group], chunk) for g0 in range(0, len(lens_rows), group)]
            run_in_workers(tasks, read_group, worker_arrays, device)
    for r in top_rows[1:]:
        for array in per_row_arrays:
            array[r] = array[top_rows[0]]

    input_ids = ids[0].cpu().numpy().astype(np.int64)
    strings = display.strings(show_whitespace)
    tokens = display_ids(display, input_ids, show_whitespace=show_whitespace)
    shown_text = text if isinstance(text, str) else model.decode(input_ids.tolist())
    readings = {}
    for name, lens in lens_map.items():
        rs = slice(first_row[name], first_row[name] + len(layer_lists[name]))
        readings[name] = PromptReading(
            text=shown_text, model_name=str(getattr(model, "name", "")),
            lens_kind=str(getattr(lens, "kind", type(lens).__name__)), input_ids=input_ids, tokens=list(tokens),
            layers=list(layer_lists[name]), positions=np.asarray(pos_list, dtype=np.int64), output_layer=top,
            top_k=k, show_whitespace=bool(show_whitespace), word_like=bool(word_like), pinned=dict(pins),
            top_ids=top_ids[rs].copy(), top_probs=top_probs[rs].copy(), entropy_bits=entropy[rs].copy(),
            kl_bits=kl[rs].copy(), ce_bits=ce[rs].copy(), next_token_rank=next_rank[rs].copy(),
            final_top1_rank=final_rank[rs].copy(), pinned_ranks={n: a[rs].copy() for n, a in pin_ranks.items()},
            next_ids=next_t.cpu().numpy().astype(np.int64), final_top1_ids=final_top1.copy(), vocab_strings=strings,
            n_prompt=n_prompt, edits=[repr(e) for e in edit_list])
    return readings


__all__ = ["read_prompt", "read_prompts"]
