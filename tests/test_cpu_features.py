"""bf16 hardware detection (jlens_core.models.cpu_features) and the fit dtype it decides (fitting.precision)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny

from jlens_core.fitting import precision
from jlens_core.fitting.precision import compute_model, resolve_fit_dtype
from jlens_core.models.cpu_features import bf16_flag

INTEL = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\nmodel name\t: X\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
OLD = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def test_bf16_flag_from_cpuinfo_text():
    assert bf16_flag(INTEL) == "amx_bf16"
    assert bf16_flag(ZEN4) == "avx512_bf16"
    assert bf16_flag(OLD) is None
    assert bf16_flag("") is None and bf16_flag(None) is None
    assert bf16_flag("processor : 0\n") is None  # no flags line
    assert bf16_flag("flags : avx512_bf16x\n") is None  # whole names only


def test_auto_fit_dtype_follows_the_flags_and_the_decision():
    model = tiny("llama")
    assert resolve_fit_dtype("auto", model, cpuinfo=OLD, cpu_default=True) == "float32"  # never assumed
    assert resolve_fit_dtype("auto", model, cpuinfo=ZEN4, cpu_default=True) == "bfloat16"
    assert resolve_fit_dtype("auto", model, cpuinfo=INTEL, cpu_default=True) == "bfloat16"
    assert resolve_fit_dtype("auto", model, cpuinfo=INTEL, cpu_default=False) == "float32"
    assert resolve_fit_dtype("float32", model, cpuinfo=INTEL, cpu_default=True) == "float32"
    assert resolve_fit_dtype("bfloat16", model, cpuinfo=OLD) == "bfloat16"  # asked for: runs (with a warning)
    with pytest.raises(ValueError, match="dtype='half'"):
        resolve_fit_dtype("half", model)


def test_bf16_model_fits_in_bf16_and_refuses_fp32():
    model = tiny("llama")
    twin = compute_model(model, "bfloat16")
    assert twin.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert compute_model(model, "bfloat16") is twin  # kept for the next fit
    assert compute_model(model, "float32") is model
    assert resolve_fit_dtype("auto", twin, cpuinfo=OLD) == "bfloat16"
    with pytest.raises(ValueError, match="load the model in float32"):
        resolve_fit_dtype("float32", twin)
    # the twin's weights are the model's, rounded to bf16
    w, w16 = model.head.weight, twin.head.weight
    assert torch.equal(w.to(torch.bfloat16), w16) and w16.data_ptr() != w.data_ptr()


def test_a_bf16_fit_records_its_dtype_and_stays_near_fp32(monkeypatch):
    from jlens_core import fit

    model = tiny("llama")
    prompts = ["The capital of France is Paris. The capital of Italy is Rome. Water boils at one hundred."] * 2
    lens32 = fit(model, prompts, skip_first=2, dtype="float32")
    lens16 = fit(model, prompts, skip_first=2, dtype="bfloat16")
    assert lens32.fit_settings.dtype == "float32" and lens16.fit_settings.dtype == "bfloat16"
    for layer in lens32.source_layers:
        a, b = lens32.matrix(layer), lens16.matrix(layer)
        rel = float((a - b).norm() / a.norm())
        assert 0 < rel < 0.05  # bf16 rounding, not another quantity
    monkeypatch.setattr(precision, "CPU_BF16_DEFAULT", False)
    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    assert fit(model, prompts[:1], skip_first=2).fit_settings.dtype == "float32"  # auto, resolved and recorded


def test_the_cpu_default_and_its_environment_override(monkeypatch):
    model = tiny("llama")
    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    assert precision.CPU_BF16_DEFAULT is True  # decided by bench/bf16_fit.py: 20 prompts within 0.102 of the SE
    assert resolve_fit_dtype("auto", model, cpuinfo=ZEN4) == "bfloat16"
    assert resolve_fit_dtype("auto", model, cpuinfo=OLD) == "float32"  # never assumed
    monkeypatch.setenv(precision.CPU_BF16_ENV, "0")
    assert resolve_fit_dtype("auto", model, cpuinfo=ZEN4) == "float32"
    assert resolve_fit_dtype("bfloat16", model, cpuinfo=ZEN4) == "bfloat16"  # an explicit ask wins
    monkeypatch.setenv(precision.CPU_BF16_ENV, "1")
    monkeypatch.setattr(precision, "CPU_BF16_DEFAULT", False)
    assert resolve_fit_dtype("auto", model, cpuinfo=ZEN4) == "bfloat16"
    assert resolve_fit_dtype("auto", model, cpuinfo=OLD) == "float32"  # the variable does not invent hardware
    monkeypatch.setenv(precision.CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match="JLENS_CPU_BF16='yes' is neither 0 nor 1"):
        resolve_fit_dtype("auto", model, cpuinfo=ZEN4)
