"""What the CLI's commands share: progress bars, CSV tables written atomically, ``--lens`` and ``--readout``
values resolved, the ``--vocab`` choices. Imports neither torch nor pandas at module level (the parser is built
from it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._atomic import atomic_write
from .main import CLIError

if TYPE_CHECKING:
    from ..lenses.experts import ExpertLens
    from ..lenses.protocol import Lens
    from ..lenses.tuned import TunedLens
    from ..models.model import LensModel


def vocab_choices() -> list[str]:
    """``--vocab``'s choices: the readout vocabularies (:data:`~jlens_core.reading.readout_protocol.VOCABS`)."""
    from ..reading.readout_protocol import VOCABS

    return list(VOCABS)


def write_csv(frame: Any, path: Path, **options: Any) -> None:
    """``frame.to_csv(path, index=False, **options)``, atomically (a reader never sees half a table)."""
    atomic_write(path, lambda tmp: frame.to_csv(tmp, index=False, **options), shared=True)


def resolve_lenses(specs: list[str], model: LensModel, shrinkage: list[float] | None = None) -> dict[str, Lens]:
    """``--lens`` values to ``{name: lens}``: ``logit``, ``default`` (the shipped Jacobian lens),
    ``tuned`` (the shipped tuned lens), a lens file (Jacobian or tuned) or a tuned-lens folder.

    A lens is named by its kind (``jacobian``, ``relevance``, ``tuned``, ``jacobian++`` for a combined J++
    file, :func:`~jlens_core.lenses.kinds.lens_kind`) unless two of a kind are given, then by its file name.
    Each Jacobian lens also appears shrunk, ``(1 - a) J + a I``, once per ``shrinkage`` value.
    """
    from ..lenses.kinds import BASELINE, lens_kind
    from ..lenses.lens import JacobianLens, LogitLens
    from ..lenses.loading import default_lens, default_tuned_lens, load_lens

    loaded: list[tuple[str, str, Lens]] = []
    for spec in specs:
        if spec == BASELINE:  # the word "logit": the logit lens
            loaded.append((BASELINE, spec, LogitLens.for_model(model)))
            continue
        found: JacobianLens | ExpertLens | TunedLens | None
        if spec in ("default", "tuned"):
            found = default_lens(model) if spec == "default" else default_tuned_lens(model)
            if found is None:
                what = "" if spec == "default" else "tuned "
                raise CLIError(f"No shipped {what}lens for {model.name!r}: give a lens file, or 'logit'.")
        else:
            found = load_lens(spec, model=model)
        loaded.append((lens_kind(found), spec, found))  # a combined J++ / R++ file goes by its expert kind
    kinds = [kind for kind, _, _ in loaded]
    lenses: dict[str, Lens] = {}
    for kind, spec, lens in loaded:
        name = kind if kinds.count(kind) == 1 or spec in ("default", "tuned", "logit") else Path(spec).stem
        lenses[name] = lens
        if isinstance(lens, JacobianLens):  # shrinkage is the Jacobian lens's
            for alpha in shrinkage or []:
                lenses[f"{name} (shrink {alpha:g})"] = lens.with_shrinkage(alpha)
    return lenses


def parse_readout(value: str | None) -> Any:
    """``--readout``: ``last``, ``last_newline``, an integer, or ``before:TEXT``."""
    if value is None:
        return None
    if value.startswith("before:"):
        return {"before": value[len("before:"):]}
    from ..evaluation.passk import check_readout

    return check_readout(value, "--readout")


def progress_bar(total: int, desc: str, disabled: bool, unit: str = "text") -> Any:
    """A tqdm bar on stderr (``None`` when ``disabled``)."""
    if disabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def advance(bar: Any, done: int, total: int) -> None:
    """Set ``bar`` to ``done`` of ``total`` (a progress callback's two numbers)."""
    bar.total = total
    bar.n = done
    bar.refresh()


__all__ = ["advance", "parse_readout", "progress_bar", "resolve_lenses", "vocab_choices", "write_csv"]
