"""reading/openmp_workers: one reading thread per core, each with its own OpenMP thread count."""

from __future__ import annotations

import pytest
import torch

from jlens_core import LogitLens
from jlens_core.reading import logit_stats, openmp_workers
from jlens_core.reading.openmp_workers import reading_workers, run_in_workers
from jlens_core.reading.reader import read_prompts

TEXT = "The capital of France is Paris. Water boils at one hundred degrees."


def test_run_in_workers_reads_every_task_once_and_raises_a_workers_error(monkeypatch):
    import threading

    cpu = torch.device("cpu")
    if openmp_workers._thread_openmp_setter() is None:
        pytest.skip("no OpenMP runtime whose per-thread count can be set (not Linux)")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert reading_workers(cpu, 10) == 4 and reading_workers(cpu, 2) == 2 and reading_workers(torch.device("meta"), 10) == 1
    seen, threads, arrays = [], set(), []

    def work(task, scratch):
        scratch.setdefault("n", 0)
        scratch["n"] += 1
        seen.append(task)
        threads.add(threading.get_ident())
        assert not torch.is_grad_enabled()

    run_in_workers(list(range(20)), work, arrays, cpu)
    assert sorted(seen) == list(range(20)) and len(arrays) == 4 and sum(a.get("n", 0) for a in arrays) == 20
    assert threading.get_ident() not in threads

    def fail(task, scratch):
        if task == 3:
            raise ValueError("task 3 cannot be read")

    with pytest.raises(ValueError, match="task 3 cannot be read"):
        run_in_workers(list(range(8)), fail, [], cpu)


def test_reading_workers_leave_the_thread_count_of_other_threads_alone(llama):
    # a worker sets its own OpenMP count only: threads started later (the app starts one per script
    # run) still get the process's count, and so does the caller
    import threading

    if openmp_workers._thread_openmp_setter() is None:
        pytest.skip("no OpenMP runtime whose per-thread count can be set (not Linux)")
    session_threads = torch.get_num_threads()  # the test session runs on one
    chunk = logit_stats.CHUNK_ELEMENTS
    torch.set_num_threads(2)  # two workers, one thread each
    logit_stats.CHUNK_ELEMENTS = 3 * llama.vocab_size  # several row groups
    try:
        assert openmp_workers.reading_workers(torch.device("cpu"), 5) == 2
        read_prompts(llama, {"logit": LogitLens.for_model(llama)}, TEXT)
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [2] and torch.get_num_threads() == 2
    finally:
        logit_stats.CHUNK_ELEMENTS = chunk
        torch.set_num_threads(session_threads)

