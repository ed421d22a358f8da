"""The relevance column of the conformance suite (issue #31 §1; tests/test_conformance.py builds the models).

For each architecture that passes the J conformance checks, ``rules="relevance"`` either

* passes: the forward values under the rules equal the model's own, and ``jacobian_for_prompt``
  (prefix cache, dropped last token, batched cotangents) equals the docs/method.md §2 definition
  computed on the full sequence with the same rules on, within 1e-4 relative Frobenius; or
* is refused with the one-sentence ``ValueError`` that names the part the rules do not cover.

That the rules themselves are right is tested family by family against hand-written rules in
tests/test_relevance.py. ``JLENS_CONFORMANCE=sample`` runs the sample of test_conformance; a table::

    python tests/test_relevance_conformance.py [--full] > relevance-conformance.md
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

if __name__ == "__main__":
    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    os.path.dirname(os.path.abspath(__file__))]

from conftest import make_tokenizer
from helpers import rel_frob
from test_conformance import (
    REL_TOL,
    SEQ,
    SKIP,
    Result,
    _first_line,
    _params,
    _Skip,
    build,
    definition,
    prompt,
)
from test_conformance import main as conformance_table

from jlens_core import HFLensModel
from jlens_core.fitting.estimator import jacobian_for_prompt
from jlens_core.fitting.relevance import relevance_rules
from jlens_core.models.model import UnsupportedModelError


def check_relevance(arch: str) -> Result:
    """``passed`` / ``unsupported`` (refused) (the one-sentence reason) / ``skipped``; raises ``AssertionError`` on a failure."""
    start = time.time()
    try:
        hf = build(arch)
        model = HFLensModel(hf, make_tokenizer(), name=f"tiny-{arch}")
    except (_Skip, UnsupportedModelError) as exc:
        return Result(arch, "skipped", f"no J conformance: {_first_line(exc)}", time.time() - start)
    ids = prompt()
    top = model.n_layers - 1
    try:
        got = jacobian_for_prompt(model, ids, skip_first=SKIP, dim_batch=32, max_seq_len=SEQ, rules="relevance")
    except ValueError as exc:
        text = str(exc)
        assert text.startswith("The relevance rules") and text.endswith(".") and text.count(". ") == 0, text
        return Result(arch, "unsupported", text.split(": ", 1)[1], time.time() - start)
    with torch.no_grad():
        before = hf(input_ids=ids, use_cache=False).logits
    with relevance_rules(model), torch.no_grad():
        during = hf(input_ids=ids, use_cache=False).logits
    assert torch.equal(before, during), f"{arch}: the rules change the forward values"
    sources = list(range(top))
    with relevance_rules(model):
        ref = definition(model, ids, sources, top)
    worst = max(rel_frob(got.jacobians[i], ref[i]) for i in sources)
    assert worst <= REL_TOL, f"{arch}: relevance jacobian_for_prompt differs from its definition by {worst:.2e}"
    return Result(arch, "passed", "", time.time() - start)


@pytest.mark.parametrize("arch", _params())
def test_relevance_conformance(arch):
    result = check_relevance(arch)
    if result.outcome == "skipped":
        pytest.skip(f"{arch}: {result.reason}")


def main(argv: list[str]) -> int:
    return conformance_table(argv, check_relevance, {"unsupported": "refused"})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
