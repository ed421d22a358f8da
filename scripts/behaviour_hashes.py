"""Print sha256 hashes of readings, a fit, pass@k, a study, a swap and a make-it-say run, to check that a
refactor leaves behaviour bit-identical: run it before and after (``PYTHONPATH=<tree> python
scripts/behaviour_hashes.py``) and compare the lines. Takes about two minutes on two CPU cores.

Hashed: every array, number and string the results hold (timings left out), walked recursively.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
from pathlib import Path

import numpy as np
import torch

SKIP = ("time", "timing", "seconds", "elapsed", "wall")  # attribute names whose values are clocks


def _feed(h: hashlib._Hash, obj: object, seen: set[int], depth: int = 0) -> None:
    if depth > 12:
        return
    if obj is None or isinstance(obj, (bool, int, str)):
        h.update(repr(obj).encode())
    elif isinstance(obj, float):
        h.update(b"nan" if math.isnan(obj) else repr(obj).encode())
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(str((obj.dtype, obj.shape)).encode())
        h.update(np.ascontiguousarray(obj).tobytes() if obj.dtype != object else repr(obj.tolist()).encode())
    elif isinstance(obj, np.generic):
        h.update(repr(obj.item()).encode())
    elif type(obj).__name__ in ("DataFrame", "Series"):
        h.update(obj.to_csv().encode())  # type: ignore[attr-defined]
    elif isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            if isinstance(key, str) and any(s in key.lower() for s in SKIP):
                continue
            h.update(repr(key).encode())
            _feed(h, obj[key], seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        h.update(f"{type(obj).__name__}{len(items)}".encode())
        for item in items:
            _feed(h, item, seen, depth + 1)
    elif isinstance(obj, Path):
        h.update(obj.name.encode())
    elif callable(obj) and not hasattr(obj, "__dict__"):
        h.update(type(obj).__name__.encode())
    elif id(obj) in seen:
        h.update(b"<seen>")
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        seen.add(id(obj))
        h.update(type(obj).__name__.encode())
        fields = ({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj)
                  else dict(vars(obj)))
        fields = {k: v for k, v in fields.items() if not k.startswith("_") and k not in ("model", "lens", "tokenizer")
                  and type(v).__module__.split(".")[0] not in ("transformers",)
                  and not (hasattr(v, "transport") or hasattr(v, "unembed"))}
        _feed(h, fields, seen, depth + 1)
    else:
        h.update(repr(type(obj)).encode())


def digest(obj: object) -> str:
    h = hashlib.sha256()
    _feed(h, obj, set())
    return h.hexdigest()[:16]


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from jlens_core.evaluation.passk import load_eval_set, pass_at_k
    from jlens_core.evaluation.study import study
    from jlens_core.fitting.fit import fit
    from jlens_core.interventions.compare import compare_runs
    from jlens_core.interventions.lens_edits import Swap
    from jlens_core.interventions.say import make_it_say
    from jlens_core.interventions.swap_success import load_swap_set, swap_success
    from jlens_core.lenses.loading import load_lens
    from jlens_core.models.loading import load_model
    from jlens_core.reading.reader import read_prompt

    model = load_model()
    lenses = {"J": load_lens(model=model), "R": load_lens(model=model, variant="relevance"),
              "J++": load_lens(model=model, variant="jpp")}
    prompts = ["The capital of the country where the Eiffel Tower stands is", "Two plus three equals"]
    for name, lens in lenses.items():
        for i, prompt in enumerate(prompts):
            print(f"reading {name} {i}", digest(read_prompt(model, lens, prompt, top_k=5)))
    j = lenses["J"]
    print("reading J stability", digest(read_prompt(model, j, prompts[0], top_k=5, stability=True)))

    from conftest import make_tiny

    tiny = make_tiny()
    small = fit(tiny, ["The capital of Italy is Rome. Water boils at one hundred degrees.",
                       "Once upon a time there was a small model that read every layer of itself."],
                skip_first=2, max_seq_len=16, dim_batch=16)
    print("tiny fit", digest({layer: small.matrix(layer) for layer in small.layers}))

    items = load_eval_set("association")[:6]
    summary, detail = pass_at_k(model, lenses, items, k=(1, 5), n_boot=50, return_detail=True)
    print("pass@k summary", digest(summary))
    print("pass@k detail", digest(detail))
    out = study(model, {"J": j, "R": lenses["R"]}, {"association": items}, k=5, n_boot=50)
    print("study", digest(out))
    swap = Swap(model, j, "France", "Germany", alpha=1.0)
    print("swap bases", digest(swap.bases), swap.skipped_layers)
    print("swap run", digest(compare_runs(model, prompts[0], [swap])))
    report = swap_success(model, {"J": j}, load_swap_set("swaps")[:3], alphas=(1,))
    print("swap_success", digest(report.summary), digest(report.items))
    result = make_it_say(model, j, "The capital city of Japan is", "Paris", max_replays=2, continuation_tokens=2)
    print("make_it_say", digest(result))
    print("make_it_say message", hashlib.sha256(result.message.encode()).hexdigest()[:16])


if __name__ == "__main__":
    main()
