"""Labelled pass@k items read once, for learning from them (docs/method.md §8, §9.1 expert weights).

:func:`read_labelled_items` runs each item of one or more evaluation sets through the model once and
keeps what pass@k needs of it under any lens that transports residuals linearly: the residuals of
the chosen source layers at the item's readout position, the token ids of each scored intermediate's
candidate spellings, the readout's kept ids and each intermediate's rank in the model's own output.
The protocol is :mod:`jlens_core.evaluation.passk`'s (:func:`~jlens_core.evaluation.passk.item_readout`):
readout positions, complete single-token spellings, synonyms and the ``vocab`` readout. Learning code
(:mod:`jlens_core.fitting.expert_weights`) then never runs the model again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.model import LensModel
from ..reading.inputs import record_residuals
from ..reading.logit_stats import rank_of
from ..reading.tokens import TokenDisplay
from ..reading.word_readout import check_vocab, kept_ids_mask
from .passk import item_kept_ids, item_readout, load_eval_set

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class LabelledReadout:
    """One labelled item read at its readout position.

    Attributes:
        set_name: the set it comes from (a shipped set's name, else the file's stem).
        index: its 0-based index in that set.
        name: its ``name``, else its index (as a string).
        prompt: the prompt text (the split between training and held-out items hashes it).
        layers: the source layers whose residuals :attr:`residuals` holds, ascending.
        residuals: ``[len(layers), d_model]`` fp32 on the CPU: ``h_l`` at the readout position.
        candidates: one ``LongTensor[n_spellings]`` per **scored** intermediate (the unscored are left out).
        final_ranks: ``LongTensor[n_scored]``: each scored intermediate's best 1-based rank in the model's
            own output (the output layer's row of pass@k), under the readout.
        kept: ``[vocab]`` 0/1 fp32 on the CPU, the ids a rank counts under ``vocab="word"`` (the word
            tokens plus the item's candidate spellings); ``None`` under ``vocab="all"``.
    """

    set_name: str
    index: int
    name: str
    prompt: str
    layers: tuple[int, ...]
    residuals: torch.Tensor
    candidates: tuple[torch.Tensor, ...]
    final_ranks: torch.Tensor
    kept: torch.Tensor | None

    @property
    def key(self) -> str:
        """``"set:index"``, the item's name in a lens file's ``weight_items``."""
        return f"{self.set_name}:{self.index}"

    @property
    def scored(self) -> bool:
        """Whether at least one intermediate has a candidate spelling (pass@k counts the item)."""
        return bool(self.candidates)


def set_name_of(spec: str) -> str:
    """The name a set goes by: a shipped set's own name, a file's stem."""
    return Path(str(spec)).stem


def read_labelled_items(model: LensModel, sets: Iterable[str], layers: Sequence[int], *, vocab: str = "all",
                        progress: Progress | None = None) -> list[LabelledReadout]:
    """Every item of ``sets`` read once at its readout position (see the module docstring).

    Args:
        model: the model the items are read with.
        sets: names of shipped sets (``assets/evaluations``) or ``.json`` / ``.jsonl`` paths
            (:func:`~jlens_core.evaluation.passk.load_eval_set`); repeated names count once.
        layers: source layers whose residuals to keep (non-negative, below the last layer).
        vocab: ``"all"`` or ``"word"``, the readout ranks are counted under (docs/method.md §9.1).
        progress: called as ``progress(items_done, n_items)``.

    Returns:
        One :class:`LabelledReadout` per item, sets in the order given, items in file order (unscored
        items included: their ``candidates`` are empty).

    Raises:
        FileNotFoundError: an unknown set name or a missing file (one sentence listing the shipped sets).
        ValueError: no set, a malformed set, an unknown ``vocab``, a layer outside
            ``[0, n_layers - 1)``, or a set none of whose items has a scorable intermediate.
    """
    check_vocab(vocab)
    specs = list(dict.fromkeys(str(s) for s in sets))
    if not specs:
        raise ValueError("No labelled set given: name one or more sets, e.g. two_hop,association.")
    top = model.n_layers - 1
    layers = sorted({int(layer) for layer in layers})
    bad = [layer for layer in layers if not 0 <= layer < top]
    if bad or not layers:
        raise ValueError(f"Source layers {bad or layers} are not in [0, {top}): the items are read below the "
                         "model's last layer.")
    loaded = []
    for spec in specs:
        loaded.append((set_name_of(spec), load_eval_set(spec)))
    kept_np = kept_ids_mask(TokenDisplay.for_model(model), vocab, model.vocab_size)  # bool[vocab] or None
    n_total = sum(len(items) for _, items in loaded)
    out: list[LabelledReadout] = []
    done = 0
    for set_name, items in loaded:
        n_scored = 0
        for index, item in enumerate(items):
            read = item_readout(model, item, index)
            spelled = [sp for (role, _), sp in zip(read.words, read.spellings) if role == "intermediate" and sp]
            resid = record_residuals(model, read.ids[:, : read.position + 1], layers)  # causal: no more needed
            device = resid[top].device
            kept = item_kept_ids(kept_np, read.spellings, device)  # [vocab] or None
            candidates = tuple(torch.tensor(list(sp.values()), dtype=torch.long) for sp in spelled)
            with torch.no_grad():
                final = model.unembed(resid[top][read.position:read.position + 1]).float()  # [1, vocab]
                final_ranks = _best_ranks(final, candidates, kept)  # [n_scored]
            out.append(LabelledReadout(
                set_name=set_name, index=index, name=read.name, prompt=str(item["prompt"]), layers=tuple(layers),
                residuals=torch.stack([resid[layer][read.position] for layer in layers]).float().cpu(),
                candidates=candidates, final_ranks=final_ranks.cpu(),
                kept=None if kept is None else kept.cpu()))
            n_scored += bool(candidates)
            done += 1
            if progress is not None:
                progress(done, n_total)
        if not n_scored:
            raise ValueError(f"The set {set_name!r} has no scorable item: none of its {len(items)} items has an "
                             "intermediate with a single-token spelling in this model's tokenizer.")
    return out


def _best_ranks(logits: torch.Tensor, candidates: Sequence[torch.Tensor], kept: torch.Tensor | None) -> torch.Tensor:
    """``LongTensor[n_candidates]``: per candidate set, its best rank in ``logits [1, vocab]`` (``kept``: see
    :func:`~jlens_core.reading.logit_stats.rank_of`)."""
    if not candidates:
        return torch.zeros(0, dtype=torch.long)
    return torch.stack([rank_of(logits.expand(len(c), -1), c.to(logits.device), kept=kept).min()
                        for c in candidates])


__all__ = ["LabelledReadout", "read_labelled_items", "set_name_of"]
