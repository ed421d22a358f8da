"""A trial's edit as URL keys: the link from an experiment's trial to Inspect with the same swap applied
(docs/experiments.md, "Open a trial in Inspect").

:func:`trial_edit` gives the :class:`TrialEdit` of one trial row (the swap its arm ran: the two tokens as the
experiment spelt them, the band, the scale, the lens whose read directions it used); :meth:`TrialEdit.query` writes
it as URL keys (:data:`EDIT_KEYS`), :meth:`TrialEdit.from_query` reads them back, checking each value (a visitor can
type anything), and :meth:`TrialEdit.build` makes the :class:`~jlens_core.interventions.lens_edits.Swap` on a model,
checking the tokens and the band against it. No key names a file: the tokens go to the tokenizer only.

Arms whose edit is not one lens's coordinate swap (random directions, the J-space probe and concept-vector arms with
their clamps, the injections of verbal introspection, the J-space ablations) need the experiment's own vectors, which a
URL cannot carry: :func:`trial_edit` returns ``None`` for them, and the server holds their edits instead
(:class:`HeldTrials`: the edit objects the trial ran, :attr:`ExperimentResult.trial_edits`, under a random token).
The link then carries ``edit=held`` and ``edit_trial=TOKEN`` (:class:`HeldRef`); it works while the server that ran
the experiment runs, and afterwards says so in one sentence.
"""

from __future__ import annotations

import math
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..interventions.lens_edits import MAX_ALPHA, Swap
from ..interventions.read_directions import check_layers
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.tokens import token_id
from .core import ExperimentResult, readable_layers, word_ids

EDIT_KEYS = ("edit", "edit_a", "edit_b", "edit_layers", "edit_alpha", "edit_lens", "edit_trial")
HELD = "held"  # the ``edit`` value of a link to a trial whose edits the server holds
MAX_HELD = 256  # trials a server holds for links (the oldest go first)
_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,64}")
MAX_TOKEN_CHARS = 100  # one vocabulary token; longer text in a URL is not one
LOGIT = "logit"
# arm -> (which lens: the experiment's or the logit lens, where the swap's source token comes from)
SWAP_ARMS = {"J-lens swap": "lens", "logit-lens swap": LOGIT, "unrelated swap": "lens", "answer swap": "lens"}


@dataclass(frozen=True)
class TrialEdit:
    """One trial's coordinate swap, as Inspect's Intervene panel runs it.

    Attributes:
        source, replacement: the tokens A and B (each one vocabulary token, spelt as the experiment used it).
        layers: ``(first, last)``: the band, every layer between them edited.
        alpha: the swap's scale (1 exchanges the coordinates).
        lens: the name of the lens whose read directions the swap uses (``"jacobian"``, ``"logit"`` ...).
        kind: ``"swap"`` (the only kind a link carries in this version).
    """

    source: str
    replacement: str
    layers: tuple[int, int]
    alpha: float = 1.0
    lens: str = "jacobian"
    kind: str = "swap"

    def query(self) -> dict[str, str]:
        """The URL keys (:data:`EDIT_KEYS`) that :meth:`from_query` reads back to this edit."""
        return {"edit": self.kind, "edit_a": self.source, "edit_b": self.replacement,
                "edit_layers": f"{self.layers[0]}-{self.layers[1]}", "edit_alpha": f"{self.alpha:g}",
                "edit_lens": self.lens}

    @classmethod
    def from_query(cls, query: Mapping[str, Any]) -> TrialEdit | None:
        """The edit the URL keys describe (``None`` when there is no ``edit`` key).

        Raises:
            ValueError: a key missing or out of range (one sentence naming it and what to give).
        """
        kind = query.get("edit")
        if not kind:
            return None
        if kind != "swap":
            raise ValueError(f"The link's edit {str(kind)[:40]!r} is not one Inspect can apply: only 'swap' or "
                             f"{HELD!r}.")
        tokens = []
        for key in ("edit_a", "edit_b"):
            value = query.get(key)
            if not isinstance(value, str) or not value or len(value) > MAX_TOKEN_CHARS:
                raise ValueError(f"The link's {key} is missing or too long: give one vocabulary token.")
            tokens.append(value)
        match = re.fullmatch(r"(\d{1,4})-(\d{1,4})", str(query.get("edit_layers") or ""))
        if not match or int(match.group(1)) > int(match.group(2)):
            raise ValueError(f"The link's edit_layers {str(query.get('edit_layers'))[:40]!r} is not a layer range: "
                             "write it as FIRST-LAST, e.g. '20-26'.")
        try:
            alpha = float(query.get("edit_alpha") or "1")
        except ValueError:
            alpha = math.nan
        if not math.isfinite(alpha) or not 0 <= alpha <= MAX_ALPHA:
            raise ValueError(f"The link's edit_alpha {str(query.get('edit_alpha'))[:40]!r} is not a scale in "
                             f"[0, {MAX_ALPHA:g}].")
        lens = str(query.get("edit_lens") or "jacobian")
        if len(lens) > MAX_TOKEN_CHARS:
            raise ValueError("The link's edit_lens is too long: give a loaded lens's name.")
        return cls(tokens[0], tokens[1], (int(match.group(1)), int(match.group(2))), alpha, lens, "swap")

    def build(self, model: LensModel, lens: Lens) -> list[Swap]:
        """The edit on ``model`` along ``lens``'s read directions (every prompt position but the first).

        Raises:
            ValueError: a layer outside the lens, a token that is not one vocabulary token here (one sentence).
        """
        readable = readable_layers(lens)
        if self.layers[0] not in readable or self.layers[1] not in readable:
            raise ValueError(f"The band {self.layers[0]}-{self.layers[1]} is outside the lens's source layers "
                             f"{readable[0]}-{readable[-1]}: give a band inside them.")
        layers = check_layers(model, lens, list(range(self.layers[0], self.layers[1] + 1)))
        return [Swap(model, lens, self.source, self.replacement, self.alpha, layers=layers)]

    def __str__(self) -> str:
        return (f"swap {self.source!r} → {self.replacement!r} along the {self.lens} lens at layers "
                f"{self.layers[0]}-{self.layers[1]} (α = {self.alpha:g})")


@dataclass(frozen=True)
class HeldRef:
    """A link to a trial whose edits the server holds (``edit=held``, ``edit_trial=TOKEN``)."""

    token: str

    def query(self) -> dict[str, str]:
        return {"edit": HELD, "edit_trial": self.token}


@dataclass(frozen=True)
class HeldTrial:
    """One trial's edits as the server holds them.

    Attributes:
        token: the random key a link names; model_key: the model they are bound to (the app's model key);
        edits: the residual edits the trial ran (objects of :mod:`jlens_core.reading.edit_hooks`'s protocol);
        label: one line naming the experiment, the arm and the item.
    """

    token: str
    model_key: str
    edits: tuple[Any, ...]
    label: str

    def __str__(self) -> str:
        return self.label


class HeldTrials:
    """The trials a server holds so that a link can replay them: the newest :data:`MAX_HELD`, by random token.

    Holding the same edits again gives the same token (a page redrawn does not fill the store). Thread-safe: the
    app's sessions share one store.
    """

    def __init__(self, max_entries: int = MAX_HELD) -> None:
        self.max_entries = int(max_entries)
        self._held: OrderedDict[str, HeldTrial] = OrderedDict()
        self._tokens: dict[tuple[str, tuple[int, ...]], str] = {}
        self._lock = threading.Lock()

    def hold(self, model_key: str, edits: Sequence[Any], label: str) -> HeldRef:
        """Hold ``edits`` (bound to the model of ``model_key``) and return the link's reference to them.

        Raises:
            ValueError: no edits (a trial that ran none needs no link).
        """
        edits = tuple(edits)
        if not edits:
            raise ValueError("This trial ran no edit: there is nothing to hold for a link.")
        key = (str(model_key), tuple(id(e) for e in edits))
        with self._lock:
            token = self._tokens.get(key)
            # ids are stable while the edits are held (the store keeps them alive); `is` never compares tensors
            if token is not None and token in self._held and all(
                    a is b for a, b in zip(self._held[token].edits, edits, strict=True)):
                self._held.move_to_end(token)
                return HeldRef(token)
            token = secrets.token_urlsafe(18)
            self._held[token] = HeldTrial(token, str(model_key), edits, str(label))
            self._tokens[key] = token
            while len(self._held) > self.max_entries:
                _, dropped = self._held.popitem(last=False)
                self._tokens.pop((dropped.model_key, tuple(id(e) for e in dropped.edits)), None)
            return HeldRef(token)

    def get(self, ref: HeldRef, model_key: str) -> HeldTrial:
        """The held trial ``ref`` names, for the model of ``model_key``.

        Raises:
            ValueError: a token this server does not hold (restarted, or too many trials opened since), or one held
                for another model (one sentence each).
        """
        with self._lock:
            held = self._held.get(ref.token)
        if held is None:
            raise ValueError("This server no longer holds the trial's edits (it restarted, or more than "
                             f"{self.max_entries} trials were opened since): run the experiment again and open the "
                             "trial from its table.")
        if held.model_key != str(model_key):
            raise ValueError("The trial's edits were made on another model than the one loaded here: load the model "
                             "the experiment ran on, then open the link again.")
        return held

    def __len__(self) -> int:
        return len(self._held)


def edit_request(query: Mapping[str, Any]) -> TrialEdit | HeldRef | None:
    """What a link's URL keys ask Inspect to apply: a coordinate swap (:class:`TrialEdit`), a held trial
    (:class:`HeldRef`), or ``None`` when there is no ``edit`` key.

    Raises:
        ValueError: a key missing, malformed or out of range (one sentence naming it).
    """
    if query.get("edit") != HELD:
        return TrialEdit.from_query(query)
    token = query.get("edit_trial")
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError("The link's edit_trial is missing or malformed: open the trial again from the Experiments "
                         "page.")
    return HeldRef(token)


def held_label(result: ExperimentResult, trial: Mapping[str, Any]) -> str:
    """One line naming a trial whose edits are held: the experiment, the arm, the item and the target."""
    target = trial.get("target")
    return (f"{result.name}: the {trial.get('arm', '?')} arm on {trial.get('item', '?')}"
            + (f" (target {str(target).strip()!r})" if target not in (None, "") else "")
            + f", band {result.band.label}")


def _spelt(model: LensModel, word: str) -> str:
    """The spelling of ``word`` the experiments swap (its first single-token spelling), else the word as is."""
    found = word_ids(model, word)
    return next(iter(found)) if found else word


def _token(model: LensModel, text: str, token: int) -> str:
    """``text`` when it names ``token`` (its decoded spelling, readable in a URL), else ``<id:N>``."""
    try:
        if token_id(model.tokenizer, text, rule="word", vocab_size=model.vocab_size) == int(token):
            return text
    except ValueError:
        pass
    return f"<id:{int(token)}>"


def trial_edit(model: LensModel, result: ExperimentResult, trial: Mapping[str, Any]) -> TrialEdit | None:
    """The swap one row of ``result.trials`` ran, or ``None`` when its arm is not one lens's coordinate swap.

    Covers probe-swap (J-lens, logit-lens, unrelated and answer swaps), verbal-report and flexible-generalization
    (J-lens and logit-lens swaps), and selectivity-language's J-lens language swap (under either task: the trial
    row's ``prompt`` is that task's prompt).
    """
    arm = str(trial.get("arm", ""))
    layers = (int(result.band.layers[0]), int(result.band.layers[-1]))
    alpha = float(result.settings.get("alpha", 1.0))
    if result.name == "selectivity-language":  # the language swap, on the task's own prompt (trial["prompt"])
        if not arm.startswith("J-lens swap"):
            return None
        return TrialEdit(_spelt(model, str(trial["source"])), _spelt(model, str(trial["target"])), layers, alpha,
                         result.lens)
    if arm not in SWAP_ARMS or result.name not in ("probe-swap", "verbal-report", "flexible-generalization"):
        return None
    which = SWAP_ARMS[arm]
    lens = LOGIT if which == LOGIT else result.lens
    if result.name == "probe-swap":
        if arm == "answer swap":
            said = result.gate[result.gate["item"] == trial["item"]].iloc[0]
            source = _token(model, str(said["model_says"]), int(said["model_says_id"]))
            replacement = _spelt(model, str(trial["target"]))
        elif arm == "unrelated swap":
            source = _spelt(model, str(trial["source"]))
            replacement = _token(model, str(trial["null_token"]), int(trial["null_id"]))
        else:
            source, replacement = _spelt(model, str(trial["source"])), _spelt(model, str(trial["swap_to"]))
    elif arm in ("unrelated swap", "answer swap"):
        return None
    elif result.name == "verbal-report":
        source, replacement = str(trial["source"]), _spelt(model, str(trial["target"]))
    else:
        source, replacement = _spelt(model, str(trial["source"])), _spelt(model, str(trial["swapped_in"]))
    return TrialEdit(source, replacement, layers, alpha, lens)


__all__ = ["EDIT_KEYS", "HELD", "MAX_HELD", "HeldRef", "HeldTrial", "HeldTrials", "TrialEdit", "edit_request",
           "held_label", "trial_edit"]
