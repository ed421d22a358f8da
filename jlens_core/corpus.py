"""Text corpora for fitting and evaluating lenses.

The built-in corpus (``"stdlib-docs"``) is real human-written English that every machine with
Python has offline: the docstrings of the Python standard library's modules, classes and
functions, read from its source files with :mod:`ast` (nothing is imported). The texts depend on
the Python version; the order is fixed (sorted by a hash of the text, which mixes modules).

``split="fit"`` / ``split="eval"`` give two disjoint, deterministic parts of any corpus (about
80 % / 20 %, decided by a hash of each text), so a lens can be evaluated on texts it was not fitted on.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import logging
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

BUILTIN_CORPUS = "stdlib-docs"
SPLITS = (None, "fit", "eval", "all")
EVAL_FRACTION_MOD = 5  # one text in five goes to "eval"
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo",
               "__pycache__", "ensurepip", "pydoc_data"}


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def in_split(text: str, split: str | None) -> bool:
    """Whether ``text`` belongs to ``split`` (``None``/"all": every text; "fit" and "eval" are disjoint)."""
    if split in (None, "all"):
        return True
    is_eval = int(_text_hash(text)[:8], 16) % EVAL_FRACTION_MOD == 0
    if split == "eval":
        return is_eval
    if split == "fit":
        return not is_eval
    raise ValueError(f"split={split!r} is not one of {SPLITS}.")


@functools.lru_cache(maxsize=1)
def heldout_score(prompt: str, seed: int) -> float:
    """A number in [0, 1) fixed by ``prompt`` and ``seed`` (SHA-256 of ``"<seed>\\0<prompt>"``, first 8 bytes):
    the seeded split of labelled items into training and held-out ones (docs/method.md §9.1, expert weights)."""
    digest = hashlib.sha256(f"{int(seed)}\0{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def check_heldout_fraction(heldout_fraction: float) -> float:
    """``heldout_fraction`` as a float, for :func:`heldout_score` splits.

    Raises:
        ValueError: it is not strictly between 0 and 1.
    """
    fraction = float(heldout_fraction)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"The held-out fraction {heldout_fraction} must lie strictly between 0 and 1.")
    return fraction


def _stdlib_docstrings() -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_PARTS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    texts.append(inspect.cleandoc(doc))
    return tuple(texts)


def _paragraphs(raw: str) -> list[str]:
    return [p.strip() for p in raw.replace("\r\n", "\n").split("\n\n") if p.strip()]


def _read_jsonl(path: Path, field: str) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({exc.msg}).") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(f"{path}:{lineno} has no string field {field!r}.")  # noqa: TRY004
            texts.append(record[field])
    return texts


def _hf_dataset(name: str, field: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{name!r} is not a file, and reading Hugging Face datasets needs the `datasets` "
                         "package (pip install datasets).") from None
    dataset_name, _, config = name.partition(":")
    try:
        data = datasets.load_dataset(dataset_name, config or None, split="train")
    except Exception as exc:  # noqa: BLE001 -- any hub/dataset failure becomes one sentence
        raise ValueError(f"Could not load the corpus {name!r}: it is not a built-in corpus or a file, and the "
                         f"Hugging Face hub did not provide it ({exc}). Use {BUILTIN_CORPUS!r}, a .txt or a "
                         ".jsonl file.") from None
    return [row[field] for row in data if isinstance(row.get(field), str)]


def load_corpus(spec: str = BUILTIN_CORPUS, *, n: int | None = None, min_chars: int = 400,
                split: str | None = None, field: str = "text") -> list[str]:
    """Texts to fit or evaluate on, in a deterministic order.

    Args:
        spec: ``"stdlib-docs"`` (built-in), a ``.txt`` file (one prompt per paragraph, paragraphs
            split by blank lines), a ``.jsonl`` file (a ``field`` string per line), or a Hugging
            Face dataset name (``name`` or ``name:config``; needs the hub).
        n: keep the first ``n`` texts (after filtering and splitting).
        min_chars: drop texts shorter than this (for the built-in corpus, 400 characters is about
            100 tokens; a 128-token fit wants at least ~500).
        split: ``None``/"all", or "fit" / "eval" for the disjoint 80 / 20 parts.

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: an empty result (with what was tried), a bad file, a bad split.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}.")
    if n is not None and n < 1:
        raise ValueError(f"n={n} must be >= 1 (or None for all texts).")
    path = Path(str(spec)).expanduser()
    if spec == BUILTIN_CORPUS:
        raw = _stdlib_docstrings()
        ordered = sorted(set(raw), key=_text_hash)  # de-duplicated, modules mixed, fixed order
    elif path.suffix == ".txt" or (path.exists() and path.suffix not in (".jsonl", ".json")):
        if not path.is_file():
            raise FileNotFoundError(f"No corpus file at {str(spec)!r}.")
        ordered = _paragraphs(path.read_text(encoding="utf-8"))
    elif path.suffix in (".jsonl", ".json"):
        if not path.is_file():
            raise FileNotFoundError(f"No corpus file at {str(spec)!r}.")
        ordered = _read_jsonl(path, field)
    else:
        ordered = _hf_dataset(str(spec), field)
    if not ordered:
        raise ValueError(f"The corpus {str(spec)!r} is empty: it holds no text.")
    texts = [t for t in ordered if len(t) >= min_chars and in_split(t, split)]
    if n is not None:
        texts = texts[:n]
    if not texts:
        raise ValueError(f"The corpus {str(spec)!r} has no text of at least {min_chars} characters"
                         f"{'' if split in (None, 'all') else f' in the {split!r} split'}: lower min_chars or "
                         "give a larger corpus.")
    log.info("Corpus %s: %d texts (min_chars=%d, split=%s).", spec, len(texts), min_chars, split)
    return texts
