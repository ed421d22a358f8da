"""Layer lists: the one normalisation of a list of layer indices, and the command-line layer spec.

:func:`normalise_layers` is the one place a list of layer indices is checked and normalised
(negatives count from the end, de-duplicated, sorted); :func:`resolve_layers` adds the Jacobian
lens's target layer (docs/method.md §2). Everything that takes ``layers=`` goes through them.

:func:`parse_layer_spec` reads a layer selection written on the command line: ``"0,4,8"``,
``"0:12"``, ``"0:12:2"``, ``"-1"``, ``"all"`` (``jlens dump|fit|eval|tune --layers``).

Grammar: comma-separated parts; each part is

* ``all``: every layer ``0 .. n_layers-1``;
* an integer ``i``: one layer; negatives count from the end (``-1`` is the last layer);
* a slice ``start:stop`` or ``start:stop:step`` with Python meaning (``stop`` excluded, any of the
  three may be left out: ``":4"``, ``"8:"``, ``"::2"``); negative ``start`` / ``stop`` count from
  the end. ``step`` must be positive.

The result is de-duplicated and sorted. Indices out of ``[-n_layers, n_layers)`` (for a slice's
``stop``: out of ``[-n_layers, n_layers]``), an empty part, a slice that selects nothing, or an
empty selection are a ``ValueError`` that names the bad part.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_INT = re.compile(r"^[+-]?\d+$")


def wrap_index(value, n: int, name: str, what: str = "layers", owner: str = "the model") -> int:
    """``value`` as an index into ``n`` items, negatives counting from the end.

    Raises:
        ValueError: ``value`` outside ``[-n, n)``, e.g. "source layer 7 is out of range: the model has
            4 layers (valid: -4..3)." (``name`` starts the sentence; ``what`` / ``owner`` name the items).
    """
    i = int(value)
    if not -n <= i < n:
        raise ValueError(f"{name} is out of range: {owner} has {n} {what} (valid: {-n}..{n - 1}).")
    return i % n


def normalise_layers(layers: Iterable[int] | None, n_layers: int, *, below: int | None = None,
                     name: str = "Layer", below_name: str = "the target layer") -> list[int]:
    """``layers`` as sorted, de-duplicated, non-negative indices into a model with ``n_layers`` layers.

    Args:
        layers: layer indices, negatives counting from the end (``-1`` is the last layer); ``None``
            for every layer (every layer below ``below`` when it is given).
        n_layers: the model's number of decoder layers (``>= 1``).
        below: when given (a non-negative index), every layer must be ``< below``: a lens carries
            earlier layers to a later one (docs/method.md §2).
        name: how the error messages name one entry, e.g. ``"source layer"``.
        below_name: how the error messages name ``below``.

    Returns:
        A non-empty sorted list of distinct indices in ``[0, n_layers)`` (and ``< below``).

    Raises:
        ValueError: an index outside ``[-n_layers, n_layers)`` ("Layer 9 is out of range: the model
            has 4 layers (valid: -4..3)."), an index not below ``below`` (names it and what it
            resolved to), an empty list, or ``below=0`` with ``layers=None``.
    """
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive integer, not {n_layers!r}.")
    top = n_layers if below is None else below
    if layers is None:
        if top < 1:
            raise ValueError(f"{below_name} {below} leaves no layer below it: give a later one.")
        return list(range(top))
    chosen: set[int] = set()
    for layer in layers:
        i = wrap_index(layer, n_layers, f"{name} {layer}")
        if i >= top:
            raise ValueError(f"{name} {layer} (= {i}) is not below {below_name} {below}: "
                             "a lens carries earlier layers to a later one.")
        chosen.add(i)
    if not chosen:
        raise ValueError(f"The list of layers is empty: give at least one {name.lower()}, or None for all.")
    return sorted(chosen)


def resolve_layers(n_layers: int, source_layers: Iterable[int] | None = None,
                   target_layer: int | None = None) -> tuple[list[int], int]:
    """Normalise a Jacobian lens's layers (docs/method.md §2): ``(source_layers, target_layer)``.

    ``target_layer`` defaults to the last layer and ``source_layers`` to every layer below it;
    negatives count from the end; sources are de-duplicated and sorted (:func:`normalise_layers`).

    Raises:
        ValueError: an index out of ``[-n_layers, n_layers)``, an empty source list, or a source
            ``>=`` the target; the message names the bad value.
    """
    if target_layer is None:
        target_layer = n_layers - 1
    target = wrap_index(target_layer, n_layers, f"target_layer={target_layer}")
    if source_layers is not None:
        source_layers = list(source_layers)  # an iterator is read once, below
    if source_layers == []:
        raise ValueError("source_layers is empty: give at least one layer below the target, or None for all.")
    if source_layers is None and target == 0:
        raise ValueError(f"target_layer={target_layer} leaves no layer below it to be a source.")
    sources = normalise_layers(source_layers, n_layers, below=target, name="source layer")
    return sources, target


def _parse_int(text: str, part: str, what: str) -> int | None:
    text = text.strip()
    if text == "":
        return None
    if not _INT.match(text):
        raise ValueError(f"Layer spec part {part!r}: {what} {text!r} is not an integer "
                         "(write e.g. '0,4,8', '0:12', '0:12:2', '-1' or 'all').")
    return int(text)


def _split(spec: str) -> list[tuple[str, list[int | None] | None]]:
    """Syntax check: ``[(part, None)]`` for ``all``, ``[(part, [i])]`` or ``[(part, [start, stop, step])]``."""
    if not isinstance(spec, str):
        raise TypeError(f"Layer spec must be a string such as '0,4,8' or '0:12', not {type(spec).__name__}.")
    if not spec.strip():
        raise ValueError("Layer spec is empty: write e.g. '0,4,8', '0:12', '0:12:2', '-1' or 'all'.")
    out: list[tuple[str, list[int | None] | None]] = []
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            raise ValueError(f"Layer spec {spec!r} has an empty part (two commas in a row, or a trailing comma).")
        if part.lower() == "all":
            out.append((part, None))
            continue
        pieces = part.split(":")
        if len(pieces) == 1:
            value = _parse_int(pieces[0], part, "layer")
            out.append((part, [value]))
            continue
        if len(pieces) > 3:
            raise ValueError(f"Layer spec part {part!r} has more than two ':' (a slice is start:stop[:step]).")
        start = _parse_int(pieces[0], part, "start")
        stop = _parse_int(pieces[1], part, "stop")
        step = _parse_int(pieces[2], part, "step") if len(pieces) == 3 else None
        if step is not None and step <= 0:
            raise ValueError(f"Layer spec part {part!r}: step {step} must be a positive integer.")
        out.append((part, [start, stop, step]))
    return out


def check_layer_spec(spec: str) -> None:
    """Check the syntax of ``spec`` without knowing the model's depth (before a slow model load).

    Raises:
        ValueError: the spec is not well formed; the message names the bad part.
    """
    _split(spec)


def parse_layer_spec(spec: str, n_layers: int) -> list[int]:
    """Resolve a layer spec (see the module docstring) against a model with ``n_layers`` layers.

    Args:
        spec: e.g. ``"0,4,8"``, ``"0:12"``, ``"0:12:2"``, ``"-1"``, ``"-4:"``, ``"all"``.
        n_layers: the model's number of decoder layers (``>= 1``).

    Returns:
        Sorted, de-duplicated, non-negative layer indices (never empty).

    Raises:
        ValueError: bad syntax, an index out of range, a slice selecting nothing, or an empty
            selection; the message names the bad part and the valid range.
    """
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive integer, not {n_layers!r}.")
    valid = f"the model has {n_layers} layers (valid: {-n_layers}..{n_layers - 1})"
    chosen: set[int] = set()
    for part, values in _split(spec):
        if values is None:
            chosen.update(range(n_layers))
            continue
        if len(values) == 1:
            (index,) = values
            if index is None:
                raise ValueError(f"Layer spec part {part!r} is empty.")
            if not -n_layers <= index < n_layers:
                raise ValueError(f"Layer {index} (in layer spec part {part!r}) is out of range: {valid}.")
            chosen.add(index % n_layers)
            continue
        start, stop, step = values
        if start is not None and not -n_layers <= start < n_layers:
            raise ValueError(f"Slice start {start} (in layer spec part {part!r}) is out of range: {valid}.")
        if stop is not None and not -n_layers <= stop <= n_layers:
            raise ValueError(f"Slice stop {stop} (in layer spec part {part!r}) is out of range: the model has "
                             f"{n_layers} layers (a stop may be {-n_layers}..{n_layers}; it is excluded).")
        selected = range(n_layers)[slice(start, stop, step)]
        if len(selected) == 0:
            raise ValueError(f"Layer spec part {part!r} selects no layer of a {n_layers}-layer model "
                             "(a slice's stop is excluded: '2:5' is layers 2, 3, 4).")
        chosen.update(selected)
    return sorted(chosen)


def fit_source_layers(spec: str | None, n_layers: int, target_layer: int = -1) -> list[int] | None:
    """The source layers a fit's layer ``spec`` names (``jlens fit --layers``, the app's Fit page) for a model of
    ``n_layers`` layers, without the target itself (a spec such as ``"0:"`` names it); ``None`` (every layer below
    the target) for no spec. A spec that names only the target is kept, so the fit refuses it in one sentence.

    Raises:
        ValueError: a bad spec (:func:`parse_layer_spec`).
    """
    if spec is None or not spec.strip():
        return None
    sources = parse_layer_spec(spec, n_layers)
    target = target_layer % n_layers
    return [s for s in sources if s != target] or sources

