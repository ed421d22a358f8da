"""Resuming from a checkpoint: what both :func:`~jlens_core.fitting.fit.fit` and
:func:`~jlens_core.fitting.tuning.train_tuned_lens` check before going on from one (docs/method.md §3).

A checkpoint records the settings that shape the result; resuming with another value of any of them
is a ``ValueError`` naming the setting, and a digest of the prompts it has seen tells whether it was
made on the same corpus, in the same order.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def prompts_digest(prompts: Sequence, upto: int) -> str:
    """sha256 (hex) of the first ``upto`` prompts (texts, or token-id sequences): tells whether a checkpoint
    was made on this prompt list."""
    digest = hashlib.sha256()
    for prompt in prompts[:upto]:
        digest.update((prompt if isinstance(prompt, str) else repr(list(prompt))).encode("utf-8", "replace"))
        digest.update(b"\x00")
    return digest.hexdigest()


def _describe(value: Any) -> str:
    if isinstance(value, dict):  # a model fingerprint says nothing to a reader
        return "another model" if "row_norms" in value else str(value)
    return repr(value)


def check_same_settings(path: str | os.PathLike, saved: Mapping[str, Any], wanted: Mapping[str, Any],
                        keys: Iterable[str], *, run: str = "fit") -> None:
    """Raise if the checkpoint at ``path`` was made with other ``keys`` settings than this ``run`` wants.

    Model fingerprints (``model_fingerprint``) compare with
    :func:`~jlens_core.models.model.same_fingerprint` (equal up to rounding), everything else with ``==``.

    Raises:
        ValueError: names the first differing setting, both values, and how to start over, e.g. "The
            checkpoint 'fit.ckpt' was made with skip_first=2, this fit asks for skip_first=3. ...".
    """
    for key in keys:
        if saved.get(key) == wanted.get(key):
            continue
        if key == "model_fingerprint":
            from ..models.model import same_fingerprint

            if same_fingerprint(saved.get(key), wanted.get(key)):
                continue
        raise ValueError(
            f"The checkpoint {str(path)!r} was made with {key}={_describe(saved.get(key))}, this {run} asks "
            f"for {key}={_describe(wanted.get(key))}. Use the same setting to resume, or start over "
            "with resume=False (CLI: --no-resume) or another checkpoint path.")


__all__ = ["check_same_settings", "prompts_digest"]
