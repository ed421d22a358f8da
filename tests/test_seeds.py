"""The one seeded random scheme (``jlens_core/seeds.py``): one seed derivation, one generator, one draw of unit
directions, used by every site that draws (checked by reading the source, as tests/test_kinds.py does for kind
names)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import jlens_core
from jlens_core.seeds import SEED_MODULUS, derive_seed, generator, unit_directions

PACKAGE = Path(jlens_core.__file__).resolve().parent
# Gaussian draws that are not directions: the lens check's canary probes (stored in lens files: their draw must
# not change) and the relevance rules' self-test inputs. Both take their generator from jlens_core.seeds.
RANDN_ELSEWHERE = {"seeds.py", "lenses/canary.py", "fitting/relevance.py"}


def test_derive_seed_folds_each_key_in():
    assert derive_seed(7) == 7 and derive_seed(-1) == SEED_MODULUS - 1
    assert derive_seed(7, 3) == 7 * 1_000_003 + 3
    assert derive_seed(7, 3, 11) == ((7 * 1_000_003 + 3) * 1_000_003 + 11) % 2**63
    assert derive_seed(2**70, 5) == ((2**70 % 2**63) * 1_000_003 + 5) % 2**63
    assert derive_seed(np.int64(4), np.int32(2)) == derive_seed(4, 2)
    assert len({derive_seed(0, i, j) for i in range(30) for j in range(30)}) == 900  # distinct keys, distinct seeds
    with pytest.raises(TypeError, match="not an integer"):
        derive_seed(1, 2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not an integer"):
        derive_seed(True)


def test_same_keys_same_directions_other_keys_other_directions():
    a = unit_directions(3, 32, generator(5, 1, 2))
    b = unit_directions(3, 32, generator(5, 1, 2))
    assert a.shape == (3, 32) and a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for other in (generator(5, 1, 3), generator(5, 2, 1), generator(6, 1, 2), generator(5, 1)):
        assert not torch.allclose(a, unit_directions(3, 32, other))
    torch.testing.assert_close(a.norm(dim=-1), torch.ones(3), rtol=0, atol=1e-6)
    raw = torch.randn(3, 32, generator=torch.Generator().manual_seed(derive_seed(5, 1, 2)))  # independent draw
    torch.testing.assert_close(a, raw / raw.norm(dim=-1, keepdim=True), rtol=0, atol=0)
    with pytest.raises(ValueError, match="n >= 1"):
        unit_directions(0, 32, generator(0))


def test_plain_seed_draws_what_torch_draws():
    """A seed without keys is itself: the canary's probes and the other single-seed draws are unchanged."""
    torch.testing.assert_close(torch.randn(4, generator=generator(123)),
                               torch.randn(4, generator=torch.Generator().manual_seed(123)), rtol=0, atol=0)


def _sources() -> dict[str, str]:
    return {path.relative_to(PACKAGE).as_posix(): path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py")}


def test_every_seeded_generator_and_random_direction_comes_from_seeds():
    sources = _sources()
    seeded = sorted(name for name, text in sources.items() if "manual_seed(" in text)
    assert seeded == ["seeds.py"], f"seeded outside jlens_core/seeds.py (use seeds.generator): {seeded}"
    gaussian = sorted(name for name, text in sources.items() if re.search(r"\brandn\(", text))
    assert set(gaussian) <= RANDN_ELSEWHERE, f"Gaussian draws outside jlens_core/seeds.py: {gaussian}"
    strides = sorted(name for name, text in sources.items() if re.search(r"100_?003", text) and name != "seeds.py")
    assert not strides, f"a seed derived by hand (use seeds.derive_seed): {strides}"
    users = {"interventions/lens_edits.py", "interventions/say_ranking.py", "interventions/say_success.py",
             "interventions/swap_success.py", "interventions/jspace_edits.py", "jspace/structure.py",
             "jspace/decompose.py", "experiments/introspection.py", "experiments/probe_swap.py",
             "experiments/selectivity.py", "experiments/flexible.py", "experiments/verbal_report.py"}
    for name in sorted(users):
        assert "from ..seeds import" in sources[name], f"{name} draws without jlens_core.seeds"
