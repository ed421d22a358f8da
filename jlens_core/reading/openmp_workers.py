"""The per-thread OpenMP pool that reads row groups side by side on the CPU.

Each worker thread sets its own OpenMP thread count (``omp_set_num_threads`` of the runtime torch
loaded), never the process-wide one: a Streamlit server starts a thread per script run, and those
must keep the process's count.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

# Most reading threads on the CPU (each holds its own CHUNK_ELEMENTS logits array).
MAX_READING_WORKERS = 8


@functools.cache
def _thread_openmp_setter() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch runs on, or None where it cannot be found.

    It sets the calling thread's own OpenMP thread count. ``torch.set_num_threads`` would also set
    the process-wide count that every thread started later begins with (a Streamlit server starts one
    per script run), so a worker must not call it.
    """
    try:
        with open("/proc/self/maps") as maps:  # Linux: the runtime torch loaded, not another copy
            paths = sorted({line.split()[-1] for line in maps if any(
                name in line for name in ("libgomp", "libiomp", "libomp"))})
        return ctypes.CDLL(paths[0]).omp_set_num_threads if paths else None
    except (OSError, AttributeError):
        return None


def reading_workers(device: torch.device, n_tasks: int) -> int:
    """Threads that read row groups side by side: 1 off the CPU; on the CPU one per intra-op thread.

    Each worker runs its matrix products and statistics on ``torch.get_num_threads() // workers``
    threads. Two single-threaded workers keep two cores busy where one two-threaded product waits at
    every step for its slower half: whenever another process (the app's browser) takes a core, only
    one worker slows down. 1 where the calling thread's OpenMP count cannot be set on its own.
    """
    if device.type != "cpu" or _thread_openmp_setter() is None:
        return 1
    return max(1, min(torch.get_num_threads(), n_tasks, MAX_READING_WORKERS))


def run_in_workers(tasks: list[Any], work: Callable[[Any, dict[str, torch.Tensor]], None],
                   worker_arrays: list[dict[str, torch.Tensor]], device: torch.device) -> None:
    """``work(task, arrays)`` for every task, in :func:`reading_workers` threads taking the next task in turn.

    ``worker_arrays[i]`` is worker ``i``'s own scratch (created here if missing, kept for the next call).
    Gradients are off in every worker. The first exception raised by ``work`` is re-raised here once
    every worker has stopped.
    """
    n_workers = reading_workers(device, len(tasks))
    while len(worker_arrays) < n_workers:
        worker_arrays.append({})
    if n_workers == 1:
        for task in tasks:
            work(task, worker_arrays[0])
        return
    threads_each = max(1, torch.get_num_threads() // n_workers)
    queue = iter(tasks)
    lock = threading.Lock()
    errors: list[BaseException] = []
    set_threads = _thread_openmp_setter()

    def worker(arrays: dict[str, torch.Tensor]) -> None:
        torch.get_num_threads()  # torch sets a new thread's OpenMP count on first use: before ours
        if set_threads is not None:  # found: reading_workers gave more than one worker
            set_threads(threads_each)
        with torch.no_grad():
            while not errors:
                with lock:
                    task = next(queue, None)
                if task is None:
                    return
                try:
                    work(task, arrays)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                    errors.append(exc)

    threads = [threading.Thread(target=worker, args=(worker_arrays[i],), name=f"jlens-read-{i}", daemon=True)
               for i in range(n_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


__all__ = ["MAX_READING_WORKERS", "reading_workers", "run_in_workers"]
