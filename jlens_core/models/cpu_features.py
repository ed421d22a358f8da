"""Whether this CPU runs bf16 matrix products fast: AMX-BF16 or AVX512-BF16, detected at run time.

Older CPUs emulate bf16 in software and run its matmuls far slower than fp32, so bf16 is never assumed: the
flags are read from ``/proc/cpuinfo`` (Linux), else asked of torch (``torch.cpu._is_amx_tile_supported`` /
``_is_avx512_bf16_supported``), else taken as absent.
"""

from __future__ import annotations

import functools
from pathlib import Path

# The CPU flags (as /proc/cpuinfo names them) that give bf16 matmuls in hardware, best first.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def bf16_flag(cpuinfo: str | None) -> str | None:
    """The first of :data:`BF16_FLAGS` in ``cpuinfo`` (the text of ``/proc/cpuinfo``: its first ``flags``
    line is read), or ``None`` when it has neither or no ``flags`` line."""
    if not cpuinfo:
        return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            return next((flag for flag in BF16_FLAGS if flag in flags), None)
    return None


def _torch_bf16_flag() -> str | None:
    import torch

    cpu = getattr(torch, "cpu", None)
    for flag, probe in (("amx_bf16", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported")):
        check = getattr(cpu, probe, None)
        try:
            if check is not None and check():
                return flag
        except RuntimeError:  # a torch built without the probe's backend
            continue
    return None


@functools.cache
def cpu_bf16_flag() -> str | None:
    """This CPU's bf16 matmul flag (``"amx_bf16"``, ``"avx512_bf16"``) or ``None``: ``/proc/cpuinfo``'s flags
    where it can be read, torch's CPU probes elsewhere. Read once per process."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return _torch_bf16_flag()
    return bf16_flag(text)


__all__ = ["BF16_FLAGS", "bf16_flag", "cpu_bf16_flag"]
