"""One checkpoint per machine, and agreeing on it before a sharded fit resumes (docs/method.md §3.1).

Under ``torchrun`` on several machines each node's local rank 0 writes the checkpoint to its own
``checkpoint_path`` (every rank holds the same all-reduced state at a sync, so the copies are equal);
a node whose disk is not shared with rank 0 keeps its own copy. Rendezvous ranks are not tied to
machines (``c10d`` orders nodes by host name and process id), so after a node is lost and the job
restarts, global rank 0 may sit on a machine whose copy is behind, or has none. Before resuming,
:func:`agree_on_checkpoint` makes every rank go on from the most advanced copy any rank can read, and
rewrites the copies that were behind.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._atomic import atomic_write

_CHUNK = 64 << 20  # bytes per broadcast: bounds the extra (GPU) memory of sending a large checkpoint


def _local_copy(path: Path, read: Callable[[bytes], dict], check: Callable[[dict], None] | None):
    """(bytes, payload, summary) of this rank's copy; summary is what the others need to choose."""
    if not path.exists():
        return None, None, {"present": False}
    try:
        data = path.read_bytes()
        payload = read(data)
        if check is not None:
            check(payload)
    except (OSError, ValueError) as exc:
        return None, None, {"present": True, "error": str(exc)}
    return data, payload, {"present": True, "next_idx": int(payload["next_idx"]),
                           "sha256": hashlib.sha256(data).hexdigest()}


def broadcast_bytes(world: Any, data: bytes | None, src: int) -> bytes:
    """Collective: ``src``'s ``data`` on every rank, sent in chunks (CUDA tensors under NCCL)."""
    import torch

    size = int(world.broadcast_object(len(data) if data is not None else None, src=src))
    device = "cuda" if world.dist.get_backend() == "nccl" else "cpu"
    out = bytearray(size)
    for start in range(0, size, _CHUNK):
        n = min(_CHUNK, size - start)
        if world.rank == src:
            assert data is not None
            chunk = torch.frombuffer(bytearray(data[start: start + n]), dtype=torch.uint8).to(device)
        else:
            chunk = torch.empty(n, dtype=torch.uint8, device=device)
        world.dist.broadcast(chunk, src=src)
        out[start: start + n] = chunk.cpu().numpy().tobytes()
    return bytes(out)


def agree_on_checkpoint(world: Any, path: str | os.PathLike, read: Callable[[bytes], dict],
                        check: Callable[[dict], None] | None = None) -> dict | None:
    """Collective: the checkpoint every rank resumes from, or ``None`` where no rank has one.

    Each rank reads its own ``path`` (``read`` turns the file's bytes into the payload, ``check``
    refuses one made with other settings or prompts). The copy with the largest ``next_idx`` wins
    (the lowest rank among equals); ranks whose copy differs receive it, and the writers among them
    (each node's local rank 0) replace their file with it.

    Raises:
        ValueError: on every rank, when any rank's copy cannot be read or belongs to another fit; the
            message names the rank and says why.
    """
    path = Path(path)
    data, payload, mine = _local_copy(path, read, check)
    summaries = world.gather_objects(mine)
    bad = [(rank, s) for rank, s in enumerate(summaries) if "error" in s]
    if bad:
        rank, summary = bad[0]
        raise ValueError(f"Rank {rank} of {world.size} cannot resume: {summary['error']}")
    present = [(s["next_idx"], -rank, rank) for rank, s in enumerate(summaries) if s["present"]]
    if not present:
        return None
    src = max(present)[2]
    best = summaries[src]["sha256"]
    needy = [rank for rank, s in enumerate(summaries) if s.get("sha256") != best]
    if not needy:
        return payload
    received = broadcast_bytes(world, data if world.rank == src else None, src=src)
    if world.rank in needy:
        payload = read(received)
        if world.local_rank == 0:
            def write(tmp: str) -> None:
                Path(tmp).write_bytes(received)

            atomic_write(path, write)
    world.dist.barrier()  # a node's other ranks read its copy only once it is there
    return payload


__all__ = ["agree_on_checkpoint", "broadcast_bytes"]
