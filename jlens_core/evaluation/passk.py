"""pass@k of latent intermediate steps, with the field's protocol (docs/method.md §8).

An item ``{"name"?, "prompt", "target"?, "intermediates": [...]}`` holds a prompt whose answer needs
steps the prompt never states. A lens finds a step when the word is among its top ``k`` at some
layer, at one **readout** position:

* ``"last"`` (default): the prompt's last token (for a prompt that stops where ``target`` begins,
  the token right before the target; the target itself is never scored);
* ``"last_newline"``: the last token that contains a newline (couplets: the end of line 1);
* an integer position (negatives count from the end), or ``{"before": "text"}``: the last token
  that ends before the first occurrence of ``text`` in the prompt.

An intermediate's rank at a layer is its best 1-based full-vocabulary rank over its **complete
single-token spellings**: the word as written, lower-cased and capitalised, each with and without a
leading space, kept only when one token stands for exactly that string
(:func:`~jlens_core.reading.tokens.spellings`). A word with no such spelling is
**unscored**: left out of every denominator and counted in the coverage columns, never scored by a
prefix. ``spelling="first_token"`` keeps the older rule (the first token of the word, with and
without a leading space; every word scored). ``synonyms="numbers_ops"`` also accepts digits <->
number words and operation names <-> symbols and verbs (plus, +, add, ...): the rank is the best
over them.

pass@k of an item is the fraction of its scored intermediates whose best rank over the chosen layers
is ``<= k``; a set's score is the mean over items with at least one scored intermediate, with a
bootstrap 95 % interval over those items.

``vocab="word"`` (the word-token readout, docs/method.md §9.1) ranks among the tokens whose text has
a letter or digit, plus every candidate spelling of the item's words (never excluded). An
intermediate is **copied** when the word, or one of its synonyms, occurs in the prompt text
(:func:`appears_in_prompt`); the summary counts the copied scored intermediates, and
``exclude_copied=True`` leaves them out of the score and the coverage (docs/method.md §8).

Sets are JSON files in the reference format ``{"items": [...], "readout"?, "synonyms"?,
"description"?}`` or JSON Lines of items (our older format); an item may carry its own ``readout``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import pandas as pd
import torch

from .._paths import ASSETS_DIR
from ..interventions.intervals import bootstrap_interval
from ..layerspec import wrap_index
from ..lenses.protocol import Lens
from ..lenses.readout import layer_logits
from ..models.model import LensModel
from ..reading.inputs import checked_lenses, encode_prompt, record_residuals
from ..reading.logit_stats import rank_of
from ..reading.readout_protocol import Readout, no_other_keywords
from ..reading.stability import HalvesArg, check_halves, resolve_halves
from ..reading.tokens import TokenDisplay, spellings
from ..reading.word_readout import check_vocab, kept_ids_mask

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger(__name__)

EVAL_DIR = ASSETS_DIR / "evaluations"
READOUT_RULES = ("last", "last_newline")
SPELLINGS = ("whole", "first_token")
SYNONYM_SETS = ("numbers_ops",)
PASS_COLUMNS = ("lens", "vocab", "k", "pass_rate", "ci_low", "ci_high", "items_scored", "n_items", "words_scored",
                "n_words", "copied", "copied_excluded")
DETAIL_COLUMNS = ("item", "name", "lens", "role", "word", "scored", "copied", "spellings", "token_ids", "position",
                  "readout_token", "best_rank", "best_layer", "final_rank", "vocab")
N_BOOT = 2000
HALF_COLUMNS = ("best_rank_even", "best_rank_odd")  # the detail's, with stability (docs/method.md §6.2)
BOTH_COLUMNS = ("found_by_both_halves", "both_ci_low", "both_ci_high")  # the summary's, with stability

Progress = Callable[[int, int], None]

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
TENS = {30: "thirty", 40: "forty", 50: "fifty", 60: "sixty", 70: "seventy", 80: "eighty", 90: "ninety",
        100: "hundred"}
OPERATION_GROUPS = (
    ("plus", "+", "add", "added", "adding", "sum"),
    ("minus", "-", "−", "subtract", "subtracted", "subtracting", "difference"),
    ("times", "*", "×", "multiply", "multiplied", "multiplying", "product"),
    ("divided", "/", "÷", "divide", "dividing", "quotient"),
)


# -- the set files -----------------------------------------------------------------------------------
def shipped_sets() -> dict[str, str]:
    """``{name: description}`` of the sets in ``assets/evaluations/`` (``.json`` files)."""
    out = {}
    for path in sorted(EVAL_DIR.glob("*.json")):
        try:
            out[path.stem] = str(json.loads(path.read_text(encoding="utf-8")).get("description", ""))
        except (OSError, ValueError):
            continue
    return out


EVAL_SETS: dict[str, str] = shipped_sets()  # {name: description} of assets/evaluations/*.json, read at import


def _resolve_path(spec: str | os.PathLike) -> Path:
    text = str(spec)
    for candidate in (EVAL_DIR / f"{text}.json", EVAL_DIR / f"{text}.jsonl"):
        if "/" not in text and candidate.is_file():
            return candidate
    path = Path(spec)
    if path.is_file():
        return path
    raise FileNotFoundError(f"No evaluation set {text!r}: give a .json or .jsonl file, or one of "
                            f"{sorted(shipped_sets())}.")


def check_readout(rule: Any, where: str = "readout") -> Any:
    """The rule itself when valid; else a one-sentence ``ValueError``."""
    if rule in READOUT_RULES or (isinstance(rule, int) and not isinstance(rule, bool)):
        return rule
    if isinstance(rule, str) and re.fullmatch(r"-?\d+", rule.strip()):
        return int(rule)
    if isinstance(rule, Mapping) and set(rule) == {"before"} and isinstance(rule["before"], str) and rule["before"]:
        return {"before": rule["before"]}
    raise ValueError(f"{where}: unknown readout rule {rule!r}; use 'last', 'last_newline', a token position, "
                     "or {'before': 'text'}.")


def check_item(item: Any, where: str) -> dict:
    """An item with ``intermediates`` as a list, checked; other fields kept.

    Raises:
        ValueError: not an object, no ``prompt`` or no ``intermediates`` (names the item), or a bad
            per-item readout.
    """
    if not isinstance(item, Mapping):
        raise ValueError(f"{where}: expected an object with 'prompt' and 'intermediates', "  # noqa: TRY004
                         f"got {type(item).__name__}.")
    missing = [key for key in ("prompt", "intermediates") if key not in item]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; each item needs 'prompt' and 'intermediates' "
                         "('target' is optional).")
    prompt, inter = item["prompt"], item["intermediates"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}.")
    if isinstance(inter, str):
        inter = [inter]
    if not isinstance(inter, (list, tuple)) or not inter or not all(isinstance(w, str) and w.strip() for w in inter):
        raise ValueError(f"{where}: 'intermediates' must be a list of non-empty strings, got {inter!r}.")
    target = item.get("target")
    if target is not None and (not isinstance(target, str) or not target.strip()):
        raise ValueError(f"{where}: 'target' must be a non-empty string when given, got {target!r}.")
    out = {**dict(item), "prompt": prompt, "intermediates": list(inter)}
    if "readout" in item:
        out["readout"] = check_readout(item["readout"], where)
    return out


def load_eval_set(spec: str | os.PathLike) -> list[dict]:
    """Items of an evaluation set: a shipped name, a ``.json`` file (``{"items": [...]}``, the
    reference's format) or a ``.jsonl`` file (one item per line).

    The set's own ``readout`` and ``synonyms`` (JSON files) are copied into every item that does not
    set its own, so the list carries the protocol with it.

    Raises:
        FileNotFoundError: no such set or file (the message lists the shipped names).
        ValueError: a file that is not JSON, has no ``items``, or an item without ``prompt`` or
            ``intermediates`` (the message names file and item).
    """
    path = _resolve_path(spec)
    text = path.read_text(encoding="utf-8")
    defaults: dict[str, Any] = {}
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno}).") from None
        if not isinstance(data, Mapping) or not isinstance(data.get("items"), list):
            raise ValueError(f"{path} has no 'items' list: an evaluation set is {{\"items\": [{{\"prompt\", "
                             "\"intermediates\", ...}, ...]}.")
        raw = list(enumerate(data["items"], 1))
        if "readout" in data and data["readout"] is not None:
            defaults["readout"] = check_readout(data["readout"], f"{path}")
        if data.get("synonyms"):
            defaults["synonyms"] = _check_synonyms(data["synonyms"])
        where = "item"
    else:
        raw = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                raw.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg}).") from None
        where = "line"
    if not raw:
        raise ValueError(f"{path} holds no items.")
    items = []
    for n, obj in raw:
        label = f"{path}:{n}" if where == "line" else f"{path} item {n}" + (
            f" ({obj.get('name')})" if isinstance(obj, Mapping) and obj.get("name") else "")
        items.append({**defaults, **check_item(obj, label)})
    return items


def decoy_items(items: Sequence[Mapping]) -> list[dict]:
    """The decoy control of pass@k (docs/method.md §8): each item with its intermediates replaced by those of
    another item of the same list, words of the same kind that are not this prompt's latent step.

    A lens that ranks a kind of word high everywhere (numbers, say) finds decoys as often as the real steps;
    one that reads the step finds the real ones more often. The decoy of item ``i`` is the intermediates of
    the first item after it (cyclically) none of whose intermediates is one of item ``i``'s intermediates or
    its target, nor appears in its prompt (:func:`appears_in_prompt`); an item without one is left out.
    Each decoy item keeps its prompt, target, readout and position in the list (``index``, so results pair
    with the real items') and records ``decoy_of`` (the other item's name, else its index).

    Returns:
        The decoy items, in order (fewer than ``items`` where some had no decoy).
    """
    decoys = []
    n = len(items)
    for i, item in enumerate(items):
        synonyms = item.get("synonyms")
        own = {str(w).strip().lower() for w in [*item["intermediates"], item.get("target") or ""]}
        for step in range(1, n):
            other = items[(i + step) % n]
            words = [str(w) for w in other["intermediates"]]
            if any(w.strip().lower() in own or appears_in_prompt(item["prompt"], w, synonyms=synonyms) for w in words):
                continue
            decoys.append({**item, "intermediates": words, "index": item.get("index", i),
                           "decoy_of": other.get("name") or (i + step) % n})
            break
    return decoys


def _check_synonyms(value: Any) -> str | None:
    if value in (None, "", "none"):
        return None
    if value not in SYNONYM_SETS:
        raise ValueError(f"Unknown synonyms {value!r}: use one of {list(SYNONYM_SETS)} or none.")
    return str(value)


def check_readout_options(readout: Any, synonyms: Any, vocab: Any) -> tuple[Any, str | None]:
    """The call-wide ``readout`` rule, ``synonyms`` set and ``vocab`` of :func:`pass_at_k` and the study, checked
    in that order; returns ``(readout, synonyms)`` normalised. Raises a one-sentence ``ValueError`` on a bad one."""
    if readout is not None:
        readout = check_readout(readout)
    synonyms = _check_synonyms(synonyms)
    check_vocab(vocab)
    return readout, synonyms


def check_items(items: Any) -> list[dict]:
    """Items checked (:func:`check_item`), or the set ``items`` names loaded (:func:`load_eval_set`).

    Raises:
        ValueError: no items, or a malformed one (the message names it).
    """
    if isinstance(items, (str, os.PathLike)):
        return load_eval_set(items)
    items = list(items)
    if not items:
        raise ValueError("items is empty: give at least one {'prompt', 'intermediates'} item.")
    return [check_item(item, f"item {i}") for i, item in enumerate(items)]


# -- words -----------------------------------------------------------------------------------------------
def number_synonyms(word: str) -> list[str]:
    """Digits <-> number words (0-20, the tens, hundred) and operation names <-> symbols and verbs."""
    w = word.strip()
    low = w.lower()
    out = [w]
    if w.isdigit():
        n = int(w)
        if n < len(NUMBER_WORDS):
            out.append(NUMBER_WORDS[n])
        elif n in TENS:
            out.append(TENS[n])
    elif low in NUMBER_WORDS:
        out.append(str(NUMBER_WORDS.index(low)))
    elif low in TENS.values():
        out.append(str(next(k for k, v in TENS.items() if v == low)))
    for group in OPERATION_GROUPS:
        if low in group:
            out.extend(g for g in group if g != low)
    return list(dict.fromkeys(out))


def word_spellings(tokenizer: Any, word: str, *, spelling: str = "whole", synonyms: str | None = None,
                   vocab_size: int | None = None) -> dict[str, int]:
    """``{spelling: token id}`` a word is scored by (empty: unscored).

    ``spelling="whole"``: the complete single-token spellings of the word (and of its synonyms);
    ``"first_token"``: the first token of the word with and without a leading space.
    """
    words = number_synonyms(word) if synonyms == "numbers_ops" else [word]
    out: dict[str, int] = {}
    rule = "first" if spelling == "first_token" else "exact"
    for w in words:
        for text, tid in spellings(tokenizer, w, rule=rule, vocab_size=vocab_size).items():
            out.setdefault(text, tid)
    return out


def appears_in_prompt(prompt: str, word: str, *, synonyms: str | None = None) -> bool:
    """Whether ``word`` (or, with ``synonyms="numbers_ops"``, one of its synonyms) is in ``prompt``: copied.

    Each form, stripped of surrounding whitespace, is searched case-insensitively; an end of the form
    that is a letter, digit or underscore must not touch another one in the prompt (a whole word:
    "Paris" is not in "Parisian"; "+" is in "3+4"). Tokenisation plays no part.
    """
    forms = number_synonyms(word) if synonyms == "numbers_ops" else [word]
    for form in forms:
        core = form.strip()
        if not core:
            continue
        left = r"(?<!\w)" if re.match(r"\w", core[0]) else ""
        right = r"(?!\w)" if re.match(r"\w", core[-1]) else ""
        if re.search(left + re.escape(core) + right, prompt, flags=re.IGNORECASE):
            return True
    return False


# -- readout positions ---------------------------------------------------------------------------------
def readout_position(model: LensModel, prompt: str, ids: torch.Tensor, rule: Any) -> int:
    """The index into ``ids [1, seq]`` (the encoded ``prompt``) where the lens is read.

    Raises:
        ValueError: an unknown rule, no newline for ``"last_newline"``, a substring not in the prompt
            or with no token before it, a position out of range.
    """
    rule = check_readout(rule)
    seq = int(ids.shape[1])
    if rule == "last":
        return seq - 1
    if isinstance(rule, int):
        return wrap_index(rule, seq, f"readout position {rule}", what="tokens", owner="the prompt")
    display = TokenDisplay.for_model(model)
    row = ids[0].tolist()
    if rule == "last_newline":
        hits = [i for i, t in enumerate(row) if t < display.vocab_size and "\n" in display.texts[t]]
        if not hits:
            raise ValueError("readout 'last_newline': the prompt has no token with a newline.")
        return hits[-1]
    text = rule["before"]
    start = prompt.find(text)
    if start < 0:
        raise ValueError(f"readout {{'before': {text!r}}}: {text!r} is not in the prompt.")
    # the encoded prefix up to the substring: its last token ends before it
    prefix: list[int] = model.encode(prompt[:start])[0].tolist() if prompt[:start] else []
    n = len(prefix)
    # merges can differ at the cut: step back until the prefix matches the full encoding
    while n > 0 and row[:n] != prefix[:n]:
        n -= 1
    if n == 0:
        raise ValueError(f"readout {{'before': {text!r}}}: no token of the prompt comes before {text!r}.")
    return n - 1


# -- one item's protocol ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ItemReadout:
    """What pass@k reads of one item (docs/method.md §8), before any lens: its words, their candidate
    spellings, where the lens is read.

    Attributes:
        name: the item's ``name``, else its 0-based index in the set (as a string).
        words: ``(role, word)`` pairs: the intermediates (``"intermediate"``), then the target (``"target"``).
        spellings: per word, ``{spelling: token id}`` it is ranked by (empty: unscored).
        copied: ``{word: whether the prompt already holds it}`` (:func:`appears_in_prompt`).
        ids: ``LongTensor[1, seq]``, the encoded prompt.
        position: the readout position, an index into ``ids[0]``.
    """

    name: str
    words: list[tuple[str, str]]
    spellings: list[dict[str, int]]
    copied: dict[str, bool]
    ids: torch.Tensor
    position: int


def item_readout(model: LensModel, item: Mapping, index: int, *, readout: Any = None, spelling: str = "whole",
                 synonyms: str | None = None) -> ItemReadout:
    """The protocol of one checked item (:func:`check_item`): words, spellings, copied flags, readout position.

    ``readout`` / ``synonyms`` override the item's own (``None``: the item's, else ``"last"`` / none).

    Raises:
        ValueError: a readout rule that does not fit the prompt (the message names the item).
    """
    name = str(item.get("name", index))
    words = [("intermediate", w) for w in item["intermediates"]]
    if item.get("target"):
        words.append(("target", item["target"]))
    item_synonyms = synonyms if synonyms is not None else item.get("synonyms")
    spelled = [word_spellings(model.tokenizer, w, spelling=spelling, synonyms=item_synonyms,
                              vocab_size=model.vocab_size) for _, w in words]
    copied = {w: appears_in_prompt(item["prompt"], w, synonyms=item_synonyms) for _, w in words}
    ids = encode_prompt(model, item["prompt"], None)  # [1, seq]
    rule = readout if readout is not None else item.get("readout", "last")
    try:
        position = readout_position(model, item["prompt"], ids, rule)
    except ValueError as exc:
        raise ValueError(f"item {name}: {exc}") from None
    return ItemReadout(name=name, words=words, spellings=spelled, copied=copied, ids=ids, position=position)


def item_kept_ids(kept_np: np.ndarray | None, spellings: Sequence[Mapping[str, int]],
                  device: torch.device) -> torch.Tensor | None:
    """``[vocab]`` 0/1 fp32 on ``device``: the ids an item's ranks count (``None`` under ``vocab="all"``).

    ``kept_np`` is the readout's mask (:func:`~jlens_core.reading.word_readout.kept_ids_mask`); every
    candidate spelling of the item's words is added to it (never excluded, docs/method.md §8).
    """
    if kept_np is None:
        return None
    kept = torch.tensor(kept_np, dtype=torch.float32, device=device)  # [vocab_size]
    for spelled in spellings:
        kept[list(spelled.values())] = 1.0
    return kept


# -- pass@k ------------------------------------------------------------------------------------------------
def best_rank(logits: torch.Tensor, candidates: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """``LongTensor[n]``: per row of ``logits [n, vocab]``, the best 1-based rank among ``candidates``.

    ``kept``: ``[vocab]`` 0/1, the ids counted above a candidate (None: all).
    """
    ranks = torch.stack([rank_of(logits, c.expand(logits.shape[0]), kept=kept) for c in candidates],
                        dim=-1)  # [n, n_cand]
    return ranks.min(-1).values


# -- the item scan: one forward per item, ranks per lens and layer (pass@k's and the study's) ---------------
@dataclass(frozen=True)
class ItemScan:
    """One item read once (:class:`ItemScanner`): its protocol, the model's own logits and every lens's.

    Attributes:
        read: the item's words, spellings and readout position (:func:`item_readout`).
        positions: the positions read (the readout alone, or every position of the prompt).
        final: ``[n_pos, vocab]`` fp32, the model's own logits at ``positions``.
        logits: ``{lens name: [n_layers, n_pos, vocab]}`` fp32 along that lens's layers (the output
            layer's row is ``final``: every lens is the model there).
        half_logits: ``{lens name: (even, odd)}``, each like ``logits``, for the lenses read with halves.
        kept: ``[vocab]`` 0/1 the ids the ranks count (``None``: all; :func:`item_kept_ids`).
        greedy: the model's greedy next token after the whole prompt (``None`` unless asked for).
    """

    read: ItemReadout
    positions: list[int]
    final: torch.Tensor
    logits: dict[str, torch.Tensor]
    half_logits: dict[str, tuple[torch.Tensor, torch.Tensor]]
    kept: torch.Tensor | None
    greedy: int | None = None

    def ranks(self, lens: str, spelled: Mapping[str, int], *, half: int | None = None) -> np.ndarray:
        """``int64 [n_layers, n_pos]``: the best 1-based rank of a word's spellings (``{text: id}``, not
        empty) under ``lens`` (or its ``half``: 0 even, 1 odd) at each layer and position."""
        logits = self.logits[lens] if half is None else self.half_logits[lens][half]
        cands = torch.tensor(list(spelled.values()), dtype=torch.long, device=logits.device)
        ranks = best_rank(logits.reshape(-1, logits.shape[-1]), cands, self.kept)
        return ranks.reshape(logits.shape[0], logits.shape[1]).cpu().numpy()

    def final_ranks(self, spelled: Mapping[str, int]) -> np.ndarray:
        """``int64 [n_pos]``: the word's best rank in the model's own output at each position."""
        cands = torch.tensor(list(spelled.values()), dtype=torch.long, device=self.final.device)
        return best_rank(self.final, cands, self.kept).cpu().numpy()


@dataclass(frozen=True)
class ItemScanner:
    """The scan pass@k and the study share (docs/method.md §8): per item, its readout (:func:`item_readout`),
    one forward, and every lens's logits at every layer (the readout, :func:`~jlens_core.lenses.readout.layer_logits`).

    Args:
        model: the model the lenses belong to.
        lenses, lens_layers: ``{name: lens}`` and ``{name: layers read}`` (:func:`checked_lenses`).
        readout, spelling, synonyms: the checked protocol (:func:`check_readout_options`).
        kept_np: the readout's vocabulary mask (:func:`~jlens_core.reading.word_readout.kept_ids_mask`).
        halves: ``{lens name: (even, odd)}`` also read (``ItemScan.half_logits``).
        all_positions: read every position, not the readout alone.
        greedy: run the whole prompt and keep the model's greedy next token (else the forward stops at
            the last position read: causal, nothing after it is needed).
    """

    model: LensModel
    lenses: Mapping[str, Lens]
    lens_layers: Mapping[str, list[int]]
    readout: Any = None
    spelling: str = "whole"
    synonyms: str | None = None
    kept_np: np.ndarray | None = None
    halves: Mapping[str, tuple[Lens, Lens]] = field(default_factory=dict)
    all_positions: bool = False
    greedy: bool = False

    def __call__(self, item: Mapping, index: int) -> ItemScan:
        """Scan one checked item (``index``: its place in the set, the name of an unnamed item).

        Raises:
            ValueError: a readout rule that does not fit the prompt (the message names the item).
        """
        model, top = self.model, self.model.n_layers - 1
        read = item_readout(model, item, index, readout=self.readout, spelling=self.spelling, synonyms=self.synonyms)
        seq = int(read.ids.shape[1])
        positions = list(range(seq)) if self.all_positions else [read.position]
        all_layers = sorted({layer for ls in self.lens_layers.values() for layer in ls})
        end = seq if self.greedy else max(positions) + 1
        resid = record_residuals(model, read.ids[:, :end], all_layers)  # one forward: {layer: [end, d_model]}
        with torch.no_grad():
            final = model.unembed(resid[top][positions]).float()  # [n_pos, vocab]
            greedy = int(model.unembed(resid[top][seq - 1]).float().argmax()) if self.greedy else None

            def read_lens(lens: Lens, ls: list[int]) -> torch.Tensor:  # [n_layers, n_pos, vocab]
                logits = layer_logits(lens, model, resid, ls, positions).float()
                if top in ls:
                    logits[ls.index(top)] = final
                return logits

            logits = {name: read_lens(lens, self.lens_layers[name]) for name, lens in self.lenses.items()}
            half_logits = {name: (read_lens(pair[0], self.lens_layers[name]), read_lens(pair[1], self.lens_layers[name]))
                           for name, pair in self.halves.items()}
        return ItemScan(read=read, positions=positions, final=final, logits=logits, half_logits=half_logits,
                        kept=item_kept_ids(self.kept_np, read.spellings, final.device), greedy=greedy)


class ProtocolKeywords(TypedDict, total=False):
    """The :class:`~jlens_core.reading.readout_protocol.Readout`'s fields as keywords, one by one (a keyword wins
    over the readout's field)."""

    spelling: str
    synonyms: str | None
    vocab: str


class PassAtKOptions(ProtocolKeywords, total=False):
    """:func:`pass_at_k`'s further keywords (see its Args)."""

    k: Sequence[int] | int
    exclude_copied: bool
    set_name: str | None
    stability: bool
    halves: HalvesArg


def readout_of(readout: Readout | Any, keywords: dict[str, Any]) -> Readout:
    """The call's :class:`Readout`: ``readout`` itself, or a readout rule (the older spelling) as its position,
    with the fields ``keywords`` names (``spelling=``, ``vocab=``, ``k=``, ...) taken out of it."""
    base = readout if isinstance(readout, Readout) else Readout(position=readout)
    return base.updated(keywords)


def pass_at_k_detail(model: LensModel, lenses: Mapping[str, Lens], items: Iterable[Mapping] | str,
                     readout: Readout | Any = None, *, layers: Iterable[int] | None = None,
                     progress: Progress | None = None, stability: bool = False, halves: HalvesArg = None,
                     **options: Unpack[ProtocolKeywords]) -> pd.DataFrame:
    """Best ranks of each item's intermediate and target words, per lens, at the readout position.

    Args:
        items: items (dicts), or the name / path of a set (:func:`load_eval_set`).
        readout: the :class:`~jlens_core.reading.readout_protocol.Readout` (position, spelling, synonyms, vocab;
            its ``k`` is not used here), or a readout rule alone (its ``position``; the older spelling);
            ``spelling=``, ``synonyms=``, ``vocab=`` give its fields one by one.
        layers: layers searched (default: every readable layer of each lens, the output included).
        readout's position: a readout rule for every item (overrides the set's and the items'); default: the
            item's, else the set's, else ``"last"``.
        spelling: ``"whole"`` (complete single-token spellings) or ``"first_token"``.
        synonyms: ``"numbers_ops"`` or ``None``; default: the item's (from its set).
        vocab: ``"all"`` (default) or ``"word"``: rank among the word tokens plus the item's candidate
            spellings (docs/method.md §9.1).
        stability: also rank each word under the split halves of the lenses that keep them
            (``lens.halves()``, docs/method.md §6.2, §8): ``best_rank_even`` / ``best_rank_odd``, the best
            rank over the same layers under each half (NaN for a lens without halves: one sentence logged).
        halves: ``{lens name: (even, odd)}`` (or one pair for one lens): the halves to use (implies stability).

    Returns:
        DataFrame, one row per item x lens x word, columns :data:`DETAIL_COLUMNS`: ``scored`` (the
        word has a spelling), ``copied`` (it appears in the prompt, :func:`appears_in_prompt`),
        ``spellings`` / ``token_ids`` (what it is ranked by), ``position`` and ``readout_token``
        (where it was read), ``best_rank`` (best over the layers; NaN unscored), ``best_layer``
        (lowest layer reaching it), ``final_rank`` (in the model's own output), ``vocab``; with stability,
        ``best_rank_even`` and ``best_rank_odd`` after them (a frame without stability has neither column).

    Raises:
        ValueError: malformed items, an unknown readout / spelling / synonyms / vocab, a readout
            substring not in its prompt (the message names the item), no lenses, a ``"word"`` readout
            that keeps no token.
        LensFileError: a lens belongs to another model.
    """
    keywords: dict[str, Any] = dict(options)
    protocol = readout_of(readout, keywords)
    no_other_keywords("pass_at_k_detail", keywords)
    spelling, vocab = protocol.spelling, protocol.vocab
    if spelling not in SPELLINGS:
        raise ValueError(f"Unknown spelling {spelling!r}: use 'whole' (complete single-token spellings) or "
                         "'first_token'.")
    readout, synonyms = check_readout_options(protocol.position, protocol.synonyms, vocab)
    lenses, lens_layers = checked_lenses(model, lenses, layers)
    chosen_halves, _ = resolve_halves(lenses, stability=bool(stability), halves=halves)
    for lens_name, pair in chosen_halves.items():
        check_halves(lens_name, lenses[lens_name], pair, lens_layers[lens_name])
    with_halves = bool(chosen_halves) or bool(stability)  # the columns, NaN for a lens without halves
    items = check_items(items)
    display = TokenDisplay.for_model(model)
    scan = ItemScanner(model, lenses, lens_layers, readout=readout, spelling=spelling, synonyms=synonyms,
                       kept_np=kept_ids_mask(display, vocab, model.vocab_size), halves=chosen_halves)
    rows = []
    for index, item in enumerate(items):
        seen = scan(item, index)
        read, position = seen.read, seen.read.position
        for lens_name in lenses:
            ls = lens_layers[lens_name]
            for (role, word), spelled in zip(read.words, read.spellings):
                row = {"item": int(item.get("index", index)), "name": read.name, "lens": lens_name, "role": role,
                       "word": word, "scored": bool(spelled), "copied": read.copied[word],
                       "spellings": list(spelled), "token_ids": list(spelled.values()),
                       "position": position, "readout_token": display.texts[int(read.ids[0, position])],
                       "best_rank": math.nan, "best_layer": None, "final_rank": math.nan, "vocab": vocab}
                if spelled:
                    per_layer = seen.ranks(lens_name, spelled)[:, 0]  # [n_layers]
                    best = int(per_layer.min())
                    row.update(best_rank=best, best_layer=ls[int(np.argmax(per_layer == best))],
                               final_rank=int(seen.final_ranks(spelled)[0]))
                if with_halves:
                    row.update(best_rank_even=math.nan, best_rank_odd=math.nan)
                    if spelled and lens_name in seen.half_logits:
                        row.update(best_rank_even=int(seen.ranks(lens_name, spelled, half=0).min()),
                                   best_rank_odd=int(seen.ranks(lens_name, spelled, half=1).min()))
                rows.append(row)
        del seen
        if progress is not None:
            progress(index + 1, len(items))
    return pd.DataFrame(rows, columns=list(DETAIL_COLUMNS) + (list(HALF_COLUMNS) if with_halves else []))




def summarize_pass_at_k(detail: pd.DataFrame, k: Sequence[int] | int = (1, 5, 10), *, n_boot: int = N_BOOT,
                        seed: int = 0, exclude_copied: bool = False) -> pd.DataFrame:
    """pass@k per lens from a :func:`pass_at_k_detail` frame (see the module docstring).

    Args:
        detail: a :func:`pass_at_k_detail` frame; one without ``copied`` / ``vocab`` columns (an
            older CSV) counts no word as copied and its readout as ``"all"``.
        exclude_copied: leave the copied intermediates out of the score and the coverage.

    Returns:
        DataFrame, one row per lens x k, columns :data:`PASS_COLUMNS` (then, when ``detail`` has the halves'
        ranks, ``found_by_both_halves`` with its bootstrap ``both_ci_low``/``both_ci_high``: the same mean of
        the items' fractions of intermediates that *each* half lens ranks within the top k at some searched
        layer, docs/method.md §8; NaN for a lens without halves): ``vocab`` (the readout),
        ``pass_rate`` (mean over scored items of the fraction of their scored intermediates found),
        its bootstrap ``ci_low``/``ci_high``, ``items_scored``/``n_items`` and
        ``words_scored``/``n_words`` (coverage; with ``exclude_copied`` the copied words are not
        scored), ``copied`` (scored intermediates that appear in the prompt, excluded or not) and
        ``copied_excluded`` (``exclude_copied``).

    Raises:
        ValueError: a ``k`` below 1, or an empty ``k``.
    """
    ks = [k] if isinstance(k, int) else [int(x) for x in k]
    if not ks or any(x < 1 for x in ks):
        raise ValueError(f"k={k} must be one or more integers >= 1 (ranks are 1-based: k=1 is top-1).")
    inter = detail[detail["role"] == "intermediate"]
    with_halves = all(column in detail for column in HALF_COLUMNS)
    copied_col = (inter["copied"].astype(bool) if "copied" in inter
                  else pd.Series(False, index=inter.index))  # [n_intermediate_rows]
    rows = []
    for name in dict.fromkeys(detail["lens"]):
        sub = inter[inter["lens"] == name]
        scored = sub[sub["scored"].astype(bool)]
        n_copied = int(copied_col[scored.index].sum())
        if exclude_copied:
            scored = scored[~copied_col[scored.index]]
        lens_rows = detail[detail["lens"] == name]
        vocab = str(lens_rows["vocab"].iloc[0]) if "vocab" in detail and len(lens_rows) else "all"
        n_items = int(lens_rows["item"].nunique())
        for kk in ks:
            per_item = (scored["best_rank"] <= kk).groupby(scored["item"]).mean()  # [items_scored]
            low, high = bootstrap_interval(per_item.to_numpy(), n_boot=n_boot, seed=seed)
            rows.append({"lens": name, "vocab": vocab, "k": kk,
                         "pass_rate": float(per_item.mean()) if len(per_item) else math.nan,
                         "ci_low": low, "ci_high": high, "items_scored": len(per_item), "n_items": n_items,
                         "words_scored": len(scored), "n_words": len(sub), "copied": n_copied,
                         "copied_excluded": bool(exclude_copied)})
            if with_halves:
                rows[-1].update(_both_halves(scored, kk, n_boot=n_boot, seed=seed))
    return pd.DataFrame(rows, columns=list(PASS_COLUMNS) + (list(BOTH_COLUMNS) if with_halves else []))


def _both_halves(scored: pd.DataFrame, k: int, *, n_boot: int, seed: int) -> dict[str, float]:
    """``found_by_both_halves`` and its interval over the ``scored`` intermediates (NaN: a lens without halves)."""
    has = scored["best_rank_even"].notna() & scored["best_rank_odd"].notna()
    if not has.any():
        return {"found_by_both_halves": math.nan, "both_ci_low": math.nan, "both_ci_high": math.nan}
    rows = scored[has]
    both = ((rows["best_rank_even"] <= k) & (rows["best_rank_odd"] <= k)).groupby(rows["item"]).mean()  # [items]
    low, high = bootstrap_interval(both.to_numpy(), n_boot=n_boot, seed=seed)
    return {"found_by_both_halves": float(both.mean()), "both_ci_low": low, "both_ci_high": high}


def pass_at_k(model: LensModel, lenses: Mapping[str, Lens], items: Iterable[Mapping] | str,
              readout: Readout | Any = None, *, layers: Iterable[int] | None = None, n_boot: int = N_BOOT,
              seed: int = 0, progress: Progress | None = None, return_detail: bool = False,
              **options: Unpack[PassAtKOptions]) -> pd.DataFrame | tuple[pd.DataFrame, pd.DataFrame]:
    """pass@k of latent intermediate steps, per lens, with the protocol of the module docstring.

    Args:
        items: the items, or the name of a shipped set or a ``.json`` / ``.jsonl`` path.
        readout: the :class:`~jlens_core.reading.readout_protocol.Readout` (its ``k``: the cut-offs), or a readout
            rule alone (the older spelling); ``k=``, ``spelling=``, ``synonyms=``, ``vocab=`` give its fields one
            by one.
        k: one or more cut-offs (default 1, 5, 10).
        layers: layers searched (default: every readable layer of each lens).
        readout, spelling, synonyms: see :func:`pass_at_k_detail` (default: the set's own).
        n_boot, seed: the bootstrap of the interval over items.
        progress: called as ``progress(items_done, n_items)``.
        return_detail: also return the per-word table of :func:`pass_at_k_detail`, with a ``set`` column
            first (``set_name``), as ``pass_at_k_detail.csv`` has it: ``macro_comparison`` and
            ``gap_comparison`` take it as it is.
        vocab: ``"all"`` (default) or ``"word"``: the readout (:func:`pass_at_k_detail`); the table's
            ``vocab`` column says which.
        exclude_copied: leave intermediates that appear in the prompt out of the score and coverage
            (:func:`summarize_pass_at_k`); the ``copied`` column counts them either way.
        set_name: the detail's ``set`` (default: the set's file stem when ``items`` names one, else
            ``"items"``); give the real set's name to a decoy run so that the two pair up.
        stability, halves: also score each lens's split halves (:func:`pass_at_k_detail`): the summary
            gains ``found_by_both_halves`` with its interval.

    Returns:
        DataFrame with columns :data:`PASS_COLUMNS` (one row per lens x k); with ``return_detail``,
        the pair ``(summary, detail)``.
    """
    keywords: dict[str, Any] = dict(options)
    protocol = readout_of(readout, keywords)
    exclude_copied, set_name = bool(keywords.pop("exclude_copied", False)), keywords.pop("set_name", None)
    stability, halves = bool(keywords.pop("stability", False)), keywords.pop("halves", None)
    no_other_keywords("pass_at_k", keywords)
    k = (1, 5, 10) if protocol.k is None else protocol.k
    ks = [k] if isinstance(k, int) else list(k)
    if not ks or any(int(x) < 1 for x in ks):
        raise ValueError(f"k={k} must be one or more integers >= 1 (ranks are 1-based: k=1 is top-1).")
    detail = pass_at_k_detail(model, lenses, items, protocol, layers=layers, progress=progress, stability=stability,
                              halves=halves)
    summary = summarize_pass_at_k(detail, ks, n_boot=n_boot, seed=seed, exclude_copied=exclude_copied)
    if set_name is None:
        set_name = Path(items).stem if isinstance(items, str) else "items"
    return (summary, detail.assign(set=set_name)[["set", *detail.columns]]) if return_detail else summary


def pass_at_k_sets(model: LensModel, lenses: Mapping[str, Lens], sets: Sequence[tuple[str, Iterable[Mapping] | str]], *,
                   progress: Callable[[str, int, int], None] | None = None,
                   **options: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """pass@k over several sets, as ``jlens eval`` and the app's Evaluate page run it.

    Args:
        sets: ``(set name, items)`` pairs (items as :func:`pass_at_k` takes them).
        progress: called as ``progress(set name, items_done, n_items)``: with 0 before a set's first item,
            then after every item.
        options: :func:`pass_at_k`'s keywords (``k``, ``readout``, ``vocab``, ``exclude_copied``, ...).

    Returns:
        ``(summary, detail)``: the sets' summaries with a ``set`` column first, followed by their
        :func:`macro_mean` when there are several sets; the per-word details with their ``set``.

    Raises:
        ValueError: no sets, or what :func:`pass_at_k` raises.
    """
    if not sets:
        raise ValueError("No evaluation sets given: give at least one (name, items) pair.")
    tables, details = [], []
    for name, items in sets:
        items = check_items(items)
        if progress is not None:
            progress(name, 0, len(items))
        report = None if progress is None else functools.partial(progress, name)
        table, detail = pass_at_k(model, lenses, items, progress=report, return_detail=True, set_name=name,
                                  **options)
        table.insert(0, "set", name)
        tables.append(table)
        details.append(detail)
    summary = pd.concat(tables, ignore_index=True)
    if len(sets) > 1:
        summary = pd.concat([summary, macro_mean(summary)], ignore_index=True)
    return summary, pd.concat(details, ignore_index=True)


def macro_mean(per_set: pd.DataFrame) -> pd.DataFrame:
    """The macro mean over sets of a ``set, lens, k, pass_rate, ...`` frame: one row per lens x k,
    ``set = "macro mean"``, ``pass_rate`` the unweighted mean of the sets' scores (NaN sets left out)."""
    rows = []
    for (lens, kk), part in per_set.groupby(["lens", "k"], sort=False):
        row = {"set": "macro mean", "lens": lens, "k": kk, "pass_rate": float(part["pass_rate"].mean()),
               "items_scored": int(part["items_scored"].sum()), "n_items": int(part["n_items"].sum()),
               "words_scored": int(part["words_scored"].sum()), "n_words": int(part["n_words"].sum())}
        for column in ("vocab", "copied_excluded"):  # one readout per table: carried, not averaged
            if column in part:
                row[column] = part[column].iloc[0]
        if "copied" in part:
            row["copied"] = int(part["copied"].sum())
        if "found_by_both_halves" in part:  # with stability: the same unweighted mean (docs/method.md §8)
            row["found_by_both_halves"] = float(part["found_by_both_halves"].mean())
        rows.append(row)
    return pd.DataFrame(rows)


__all__ = [
    "BOTH_COLUMNS",
    "DETAIL_COLUMNS",
    "EVAL_DIR",
    "EVAL_SETS",
    "HALF_COLUMNS",
    "PASS_COLUMNS",
    "READOUT_RULES",
    "SPELLINGS",
    "SYNONYM_SETS",
    "ItemReadout",
    "ItemScan",
    "ItemScanner",
    "PassAtKOptions",
    "ProtocolKeywords",
    "appears_in_prompt",
    "best_rank",
    "bootstrap_interval",
    "check_item",
    "check_items",
    "check_readout",
    "check_readout_options",
    "decoy_items",
    "item_kept_ids",
    "item_readout",
    "load_eval_set",
    "macro_mean",
    "number_synonyms",
    "pass_at_k",
    "pass_at_k_detail",
    "pass_at_k_sets",
    "readout_of",
    "readout_position",
    "shipped_sets",
    "summarize_pass_at_k",
    "word_spellings",
]
