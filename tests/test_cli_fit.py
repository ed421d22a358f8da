"""Issue #5: ``jlens fit`` / ``jlens merge`` on a tiny model saved to a folder and corpora written here.

The fits run in-process through :func:`jlens_core.cli.main.main` where a process boundary does not
matter, and as ``python -m jlens_core`` subprocesses where it does (SIGKILL, exit codes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, free_port, make_hf_model, make_tokenizer, save_tiny
from helpers import cli_fit_cache

from jlens_core import JacobianLens
from jlens_core.cli.main import build_parser, main
from jlens_core.fitting.fit import read_checkpoint

REPO = Path(__file__).resolve().parents[1]
MAX_SEQ, SKIP = 24, 4
N_LAYERS, D = 4, 32
SOURCES, TARGET = [0, 1, 2], 3
RECORD_KEYS = {"prompt_index", "layer", "seq_len", "n_valid", "seconds", "jacobian_norm", "rel_change",
               "half", "half_rel_diff"}  # the split halves (docs/method.md §3.3): the prompt's half, their difference


def make_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct paragraphs of 30 words drawn from the tokenizer's training text (> MAX_SEQ tokens)."""
    rng = random.Random(seed)
    words = CORPUS.split()
    return [" ".join(rng.choice(words) for _ in range(30)) for _ in range(n)]


def write_corpus(path: Path, texts: list[str]) -> Path:
    path.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-fit")
    model_dir = root / "tiny-llama"
    save_tiny(model_dir)
    texts = make_texts(200)
    return {"root": root, "model": str(model_dir), "texts": texts,
            "corpus": str(write_corpus(root / "corpus.txt", texts))}


def fit_args(work, out, *extra, corpus=None) -> list[str]:
    return ["fit", "--model", work["model"], "--corpus", corpus or work["corpus"], "--out", str(out),
            "--min-chars", "0", "--split", "all", "--max-seq-len", str(MAX_SEQ), "--skip-first", str(SKIP),
            "--no-progress", *extra]


def sub_env() -> dict:
    # GLOO_SOCKET_IFNAME: torchrun's ranks talk over loopback, never the machine's network address
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                GLOO_SOCKET_IFNAME="lo",
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def run_jlens(*args, timeout=300) -> subprocess.CompletedProcess:
    """``python -m jlens_core ARGS`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "jlens_core", *args], check=False, cwd=REPO, env=sub_env(),
                          capture_output=True, text=True, timeout=timeout)


def sidecars(out: Path) -> tuple[Path, Path, Path]:
    stem = out.name[: -len(out.suffix)]
    return (out.with_name(f"{stem}.diagnostics.jsonl"), out.with_name(f"{stem}.status.json"),
            out.with_name(f"{stem}.ckpt"))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def max_abs_diff(a: JacobianLens, b: JacobianLens) -> float:
    assert a.source_layers == b.source_layers
    return max(float((a.jacobians[layer] - b.jacobians[layer]).abs().max()) for layer in a.source_layers)


def assert_same_halves(a: JacobianLens, b: JacobianLens) -> None:
    """The split halves (docs/method.md §3.3) of two fits of the same prompts agree (to the all-reduce's rounding)."""
    assert a.half_prompts == b.half_prompts and a.halves() is not None
    for x, y in zip(a.halves(), b.halves()):
        assert max_abs_diff(x, y) <= 1e-6


@pytest.fixture(scope="module")
def reference(work):
    """One uninterrupted in-process fit per prompt count, cached: ``reference(n) -> JacobianLens``."""
    return cli_fit_cache(work, fit_args)


# -- an independent computation of per-prompt Jacobians (docs/method.md §2, by full autograd Jacobians) -------------

def naive_prompt_jacobians(hf_model, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """``J_l[i, j] = mean_{p in V} sum_{p' in V} d h_T[p', i] / d h_l[p, j]`` from the full Jacobian."""
    layers = hf_model.model.layers
    seq = ids.shape[1]
    valid = list(range(SKIP, seq - 1))
    out = {}
    for source in SOURCES:
        captured = {}

        def grab(module, args, output, key, captured=captured):
            captured[key] = output[0] if isinstance(output, tuple) else output

        handles = [layers[source].register_forward_hook(lambda m, a, o: grab(m, a, o, "h_l"))]
        with torch.no_grad():
            hf_model(input_ids=ids, use_cache=False)
        handles.pop().remove()
        h_l = captured["h_l"].detach()

        def suffix(x, source=source, captured=captured):
            def replace(module, args, output):
                return (x,) + tuple(output[1:]) if isinstance(output, tuple) else x

            hs = [layers[source].register_forward_hook(replace),
                  layers[TARGET].register_forward_hook(lambda m, a, o: grab(m, a, o, "h_T"))]
            try:
                hf_model(input_ids=ids, use_cache=False)
            finally:
                for h in hs:
                    h.remove()
            return captured["h_T"][0, valid]  # [n_valid, d]

        full = torch.autograd.functional.jacobian(suffix, h_l, vectorize=True)  # [nV, d, 1, seq, d]
        block = full[:, :, 0][:, :, valid]  # [p', i, p, j]
        out[source] = block.sum(dim=0).mean(dim=1).double()  # sum over targets p', mean over sources p
    return out


def test_fit_writes_lens_diagnostics_and_status_that_match_an_independent_computation(work, tmp_path):
    n = 3
    out = tmp_path / "lens.safetensors"
    assert main(fit_args(work, out, "--n-prompts", str(n))) == 0
    lens = JacobianLens.load(out)
    assert (lens.n_prompts, lens.source_layers, lens.target_layer, lens.d_model) == (n, SOURCES, TARGET, D)
    assert lens.stop_reason is None

    hf, tok = make_hf_model("llama"), make_tokenizer()
    per_prompt, seq_lens = [], []
    for text in work["texts"][:n]:
        ids = torch.tensor([tok(text)["input_ids"][:MAX_SEQ]])
        seq_lens.append(ids.shape[1])
        per_prompt.append(naive_prompt_jacobians(hf, ids))
    for layer in SOURCES:
        expected = sum(p[layer] for p in per_prompt) / n
        torch.testing.assert_close(lens.jacobians[layer].double(), expected, rtol=1e-5, atol=1e-6)

    diag_path, status_path, _ = sidecars(out)
    records = read_jsonl(diag_path)
    assert [(r["prompt_index"], r["layer"]) for r in records] == [(p, la) for p in range(n) for la in SOURCES]
    for rec in records:
        p, layer = rec["prompt_index"], rec["layer"]
        assert set(rec) == RECORD_KEYS | ({"prompt_hash"} if layer == SOURCES[0] else set())  # once per prompt
        assert rec["seq_len"] == seq_lens[p] == MAX_SEQ
        assert rec["n_valid"] == MAX_SEQ - 1 - SKIP
        assert math.isfinite(rec["seconds"]) and rec["seconds"] >= 0
        jac = per_prompt[p][layer]
        assert rec["jacobian_norm"] == pytest.approx(float(jac.norm()) / math.sqrt(D), rel=1e-5)
        if p == 0:
            assert rec["rel_change"] is None
        else:
            before = sum(q[layer] for q in per_prompt[:p]) / p
            rel = float((jac - before).norm() / ((p + 1) * before.norm()))
            assert rec["rel_change"] == pytest.approx(rel, rel=1e-4)
    assert lens.diagnostics == records  # kept with the lens as well

    status = json.loads(status_path.read_text())
    assert status["state"] == "done"
    assert (status["n_done"], status["n_total"], status["next_idx"]) == (n, n, n)
    assert status["lens"] == str(out) and status["stop_reason"] is None and status["world_size"] == 1
    assert status["max_rel_change"] == pytest.approx(max(r["rel_change"] for r in records if r["prompt_index"] == n - 1))


def test_layers_and_target_layer_options_select_what_is_fitted(work, tmp_path, reference):
    full = reference(4)
    out = tmp_path / "some.safetensors"
    assert main(fit_args(work, out, "--n-prompts", "4", "--layers", "0,2")) == 0
    some = JacobianLens.load(out)
    assert some.source_layers == [0, 2] and some.target_layer == TARGET
    for layer in (0, 2):
        torch.testing.assert_close(some.jacobians[layer], full.jacobians[layer], rtol=0, atol=1e-6)
    out2 = tmp_path / "target.safetensors"
    assert main(fit_args(work, out2, "--n-prompts", "2", "--target-layer", "-2")) == 0
    lens = JacobianLens.load(out2)
    assert (lens.source_layers, lens.target_layer) == ([0, 1], 2)


def test_method_option_changes_speed_not_the_lens(work, tmp_path, reference):
    default = reference(3)  # --method auto: the fused backward on this llama
    assert default.fit_plan.method == "auto"
    for method in ("fused", "batched"):
        out = tmp_path / f"{method}.safetensors"
        assert main(fit_args(work, out, "--n-prompts", "3", "--method", method)) == 0
        lens = JacobianLens.load(out)
        assert lens.fit_plan.method == method
        assert max_abs_diff(lens, default) <= 1e-6


def signal_fit_midway(args: list[str], status_path: Path, stderr_path: Path, sig: int, *, after: int,
                      launcher: list[str] = ()) -> subprocess.Popen:
    """Run ``jlens fit args`` (behind ``launcher``), send ``sig`` once its status counts ``after`` prompts.

    Returns the ended process; fails the test when the fit ends on its own first.
    """
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen([*launcher, sys.executable, "-m", "jlens_core", *args], cwd=REPO, env=sub_env(),
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 240  # a hang guard, not a measurement
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    status = json.loads(status_path.read_text())
                except (OSError, ValueError):
                    status = {}
                if status.get("n_done", 0) >= after:
                    break
                time.sleep(0.01)
            assert proc.poll() is None, "the fit ended before it could be signalled: " + stderr_path.read_text()
            proc.send_signal(sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc


def checkpointed_fit(work, tmp_path, name: str, n: int):
    """(lens path, checkpoint path, diagnostics path, status path, arguments) of an ``n``-prompt fit that
    checkpoints after every prompt."""
    out, ckpt = tmp_path / f"{name}.safetensors", tmp_path / f"{name}-run.ckpt"
    diag_path, status_path, _ = sidecars(out)
    args = fit_args(work, out, "--n-prompts", str(n), "--checkpoint", str(ckpt), "--checkpoint-every", "1")
    return out, ckpt, diag_path, status_path, args


@pytest.mark.slow
def test_fit_killed_with_sigkill_and_resumed_equals_the_uninterrupted_fit(work, tmp_path, reference):
    n = 200
    out, ckpt, diag_path, status_path, args = checkpointed_fit(work, tmp_path, "killed", n)
    proc = signal_fit_midway(args, status_path, tmp_path / "stderr.txt", signal.SIGKILL, after=5)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert json.loads(status_path.read_text())["state"] == "running"  # a killed fit cannot say more
    saved = read_checkpoint(ckpt)
    k = saved["next_idx"]
    assert 4 <= k < n and saved["n_done"] == k  # the status may run one checkpoint ahead of the file

    assert main(args) == 0
    resumed = JacobianLens.load(out)
    assert resumed.n_prompts == n
    assert max_abs_diff(resumed, reference(n)) <= 1e-6
    # it did resume: the first k prompts' records are those of the killed run, not recomputed
    records = read_jsonl(diag_path)
    assert records[: 3 * k] == saved["diagnostics"]
    assert [(r["prompt_index"], r["layer"]) for r in records] == [(p, la) for p in range(n) for la in SOURCES]
    assert json.loads(status_path.read_text())["state"] == "done"


@pytest.mark.slow
def test_sigint_stops_the_fit_with_its_checkpoint_even_when_started_with_sigint_ignored(work, tmp_path, reference):
    # A background job of a non-interactive shell (``jlens fit ... &`` in a script, CI) starts with
    # SIGINT ignored; the app's Stop and Ctrl-C must still stop the fit and keep its checkpoint.
    n = 200
    out, ckpt, _, status_path, args = checkpointed_fit(work, tmp_path, "stopped", n)
    signal_fit_midway(args, status_path, tmp_path / "stderr.txt", signal.SIGINT, after=3,
                      launcher=["bash", "-c", 'trap "" INT; exec "$@"', "bash"])
    status = json.loads(status_path.read_text())
    assert status["state"] == "stopped", (tmp_path / "stderr.txt").read_text()
    saved = read_checkpoint(ckpt)
    assert 3 <= saved["n_done"] < n
    assert main(args) == 0  # resumes from the checkpoint
    assert max_abs_diff(JacobianLens.load(out), reference(n)) <= 1e-6


def test_merge_of_two_shard_files_equals_one_fit(work, tmp_path, reference, capsys):
    texts = work["texts"][:16]
    a, b, merged = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "merged.safetensors"
    assert main(fit_args(work, a, corpus=str(write_corpus(tmp_path / "first.txt", texts[:10])))) == 0
    assert main(fit_args(work, b, corpus=str(write_corpus(tmp_path / "second.txt", texts[10:])))) == 0
    assert main(["merge", str(a), str(b), "--out", str(merged)]) == 0
    lens = JacobianLens.load(merged)
    assert lens.n_prompts == 16
    assert max_abs_diff(lens, reference(16)) <= 1e-6
    # shards of other layers are refused
    c = tmp_path / "c.safetensors"
    assert main(fit_args(work, c, "--layers", "0,1", corpus=str(tmp_path / "second.txt"))) == 0
    capsys.readouterr()
    assert main(["merge", str(a), str(c), "--out", str(tmp_path / "bad.safetensors")]) == 2
    assert "jlens merge: error: Cannot merge lenses of layers [0, 1, 2] and [0, 1]." in capsys.readouterr().err
    assert not (tmp_path / "bad.safetensors").exists()


def test_stop_at_delta_stops_on_repeated_prompts_and_records_why(work, tmp_path, reference):
    out = tmp_path / "same.safetensors"
    corpus = write_corpus(tmp_path / "same.txt", [work["texts"][0]] * 20)
    assert main(fit_args(work, out, "--stop-at-delta", "1e-6", "--stop-patience", "3", corpus=str(corpus))) == 0
    lens = JacobianLens.load(out)
    # prompt 0 has no relative change; prompts 1, 2, 3 change the mean by ~0: three in a row, stop
    assert lens.n_prompts == 4
    assert lens.stop_reason.startswith("max relative change of the running mean below 1e-06 for 3 prompts")
    diag_path, status_path, _ = sidecars(out)
    records = read_jsonl(diag_path)
    assert sorted({r["prompt_index"] for r in records}) == [0, 1, 2, 3]
    assert all(r["rel_change"] < 1e-6 for r in records if r["prompt_index"] > 0)
    status = json.loads(status_path.read_text())
    assert status["state"] == "done" and status["stop_reason"] == lens.stop_reason
    torch.testing.assert_close(lens.jacobians[1], reference(1).jacobians[1], rtol=0, atol=1e-6)

    # the same threshold on varied prompts does not stop: the repetition is what stopped it
    varied = tmp_path / "varied.safetensors"
    assert main(fit_args(work, varied, "--n-prompts", "8", "--stop-at-delta", "1e-6", "--stop-patience", "3")) == 0
    assert JacobianLens.load(varied).n_prompts == 8 and JacobianLens.load(varied).stop_reason is None


# -- torchrun: K ranks, gloo on CPU ---------------------------------------------------------------------

def torchrun_cmd(*args, nproc: int = 2) -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc-per-node", str(nproc), *args]


def run_torchrun(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(*args), check=False, cwd=REPO, env=sub_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_torchrun_two_ranks_equals_a_one_process_fit(work, tmp_path, reference):
    n = 13  # odd: rank 1 has one prompt less
    out = tmp_path / "sharded.safetensors"
    proc = run_torchrun("-m", "jlens_core", *fit_args(work, out, "--n-prompts", str(n), "--checkpoint-every", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lens = JacobianLens.load(out)
    assert lens.n_prompts == n
    assert max_abs_diff(lens, reference(n)) <= 1e-6
    assert_same_halves(lens, reference(n))
    assert proc.stderr.count(f"Wrote {out}") == 1  # rank 0 alone writes
    diag_path, status_path, _ = sidecars(out)
    records = read_jsonl(diag_path)
    assert [(r["prompt_index"], r["layer"]) for r in records] == [(p, la) for p in range(n) for la in SOURCES]
    assert all(set(r) - {"prompt_hash"} == RECORD_KEYS for r in records)
    status = json.loads(status_path.read_text())
    assert (status["state"], status["world_size"], status["n_done"]) == ("done", 2, n)


@pytest.mark.slow
def test_torchrun_killed_and_resumed_with_the_same_k_equals_one_fit(work, tmp_path, reference):
    n = 200
    out, ckpt = tmp_path / "sharded.safetensors", tmp_path / "sharded-run.ckpt"
    diag_path, status_path, _ = sidecars(out)
    args = ["-m", "jlens_core", *fit_args(work, out, "--n-prompts", str(n), "--checkpoint", str(ckpt),
                                          "--checkpoint-every", "2")]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(torchrun_cmd(*args), cwd=REPO, env=sub_env(), stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 240  # a hang guard, not a measurement
            status = {}
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    status = json.loads(status_path.read_text())
                except (OSError, ValueError):
                    status = {}
                if status.get("n_done", 0) >= 8:
                    break
                time.sleep(0.01)
            assert proc.poll() is None, "the fit ended before it could be killed: " + (tmp_path / "stderr.txt").read_text()
            os.kill(status["pid"], signal.SIGKILL)  # rank 0 dies; rank 1 and torchrun follow
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode != 0
    assert not out.exists()
    saved = read_checkpoint(ckpt)
    k = saved["next_idx"]
    assert 4 <= k < n and saved["n_done"] == k  # the status may run one sync ahead of the file

    proc = run_torchrun(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lens = JacobianLens.load(out)
    assert lens.n_prompts == n
    assert max_abs_diff(lens, reference(n)) <= 1e-6
    assert_same_halves(lens, reference(n))  # the checkpoint kept the halves' sums across the kill
    records = read_jsonl(diag_path)
    assert records[: 3 * k] == saved["diagnostics"]  # resumed, not recomputed
    assert [(r["prompt_index"], r["layer"]) for r in records] == [(p, la) for p in range(n) for la in SOURCES]


FAILING_RANK = """
import importlib, os, sys
fit_module = importlib.import_module("jlens_core.fitting.fit")
from jlens_core.cli.main import main
real, calls = fit_module.jacobian_for_prompt, []
def failing(model, prompt, **kwargs):
    calls.append(prompt)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        raise RuntimeError("injected failure: the disk of rank 1 is on fire")
    return real(model, prompt, **kwargs)
fit_module.jacobian_for_prompt = failing
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_failing_rank_stops_the_others_with_its_error(work, tmp_path):
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK)
    out = tmp_path / "failed.safetensors"
    proc = run_torchrun(str(script), *fit_args(work, out, "--n-prompts", "40", "--checkpoint-every", "10"))
    assert proc.returncode != 0
    message = "Rank 1 of 2 failed: RuntimeError: injected failure: the disk of rank 1 is on fire"
    assert f"jlens fit: error: {message}" in proc.stderr  # rank 0 says why it stopped
    # ... and the failing rank shows its own error (with its traceback: it is a bug, not bad input)
    assert proc.stderr.count("RuntimeError: injected failure: the disk of rank 1 is on fire") >= 2
    assert not out.exists()
    status = json.loads(sidecars(out)[1].read_text())
    assert (status["state"], status["error"], status["failed_rank"]) == ("failed", message, 1)



# -- torchrun on two nodes: two launches on this machine, a c10d rendezvous on loopback ---------------

def node_cmd(addr: str, port: int, run_id: str, *args, host: bool) -> list[str]:
    """One node of a two-node job, one process per node. ``c10d`` ranks nodes by address (then pid), not by
    ``--node-rank``: the node at 127.0.0.1 is rank 0, the one at 127.0.0.2 rank 1 (both are loopback). The
    ``host`` node's torchrun holds the rendezvous store (on a cluster: the one at the endpoint's address)."""
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--local-addr", addr,
            "--rdzv-conf", f"is_host={int(host)}", "--max-restarts", "0", *args]


def node_pids(launcher_pid: int) -> list[int]:
    """A node's processes: its torchrun and every descendant (torchrun starts each worker in a session of
    its own, so the launcher's process group does not hold them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, todo = [], [launcher_pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def kill_node(proc: subprocess.Popen) -> None:
    for pid in node_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_nodes(tmp_path: Path, tag: str, nodes: dict[str, list[str]]) -> dict[str, subprocess.Popen]:
    """Start a new two-node job (a free port, a fresh rendezvous id): one torchrun per node, ``{addr: the
    program and its arguments}``; the node at 127.0.0.1 hosts the rendezvous."""
    port, run_id = free_port(), f"jlens-{os.getpid()}-{time.time_ns()}"
    env = dict(sub_env(), GLOO_SOCKET_IFNAME="lo")  # gloo on loopback only
    procs = {}
    for addr, args in nodes.items():
        cmd = node_cmd(addr, port, run_id, *args, host=addr == "127.0.0.1")
        with open(tmp_path / f"{tag}-{addr}.stderr", "w") as err:
            procs[addr] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=err, stderr=err)
    return procs


def wait_nodes(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout  # a hang guard, not a measurement
    try:
        for proc in procs.values():
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill_node(proc)
                proc.wait()
    return {addr: proc.returncode for addr, proc in procs.items()}


def stderr_of(tmp_path: Path, tag: str) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob(f"{tag}-*.stderr")))


def fit_on_two_nodes(tmp_path: Path, tag: str, nodes: dict[str, list[str]], out: Path, n: int, reference) -> None:
    """Run a two-node fit (:func:`start_nodes`) to its end: every node exits 0 and the lens at ``out`` equals the
    one-process fit of ``n`` prompts."""
    t0 = time.monotonic()
    codes = wait_nodes(start_nodes(tmp_path, tag, nodes), timeout=300)
    print(f"two-node fit ({tag}) to {n} prompts: {time.monotonic() - t0:.1f} s")
    assert set(codes.values()) == {0}, stderr_of(tmp_path, tag)
    lens = JacobianLens.load(out)
    assert lens.n_prompts == n
    assert max_abs_diff(lens, reference(n)) <= 1e-6


@pytest.mark.slow
def test_two_nodes_equal_a_one_process_fit(work, tmp_path, reference):
    n = 13  # odd: rank 1 has one prompt less
    out, ckpt = tmp_path / "two-nodes.safetensors", tmp_path / "two-nodes.ckpt"
    args = ["-m", "jlens_core", *fit_args(work, out, "--n-prompts", str(n), "--checkpoint", str(ckpt),
                                          "--checkpoint-every", "2")]
    fit_on_two_nodes(tmp_path, "fit", {"127.0.0.1": args, "127.0.0.2": args}, out, n, reference)
    logs = stderr_of(tmp_path, "fit")
    assert logs.count(f"Wrote {out}") == 1  # global rank 0 alone writes the lens
    status = json.loads(sidecars(out)[1].read_text())
    assert (status["state"], status["world_size"], status["n_done"]) == ("done", 2, n)
    assert read_checkpoint(ckpt)["n_done"] == n


HALTING_RANK = """
import importlib, os, sys, time
fit_module = importlib.import_module("jlens_core.fitting.fit")
from jlens_core.cli.main import main
real, calls = fit_module.jacobian_for_prompt, []
def halting(model, prompt, **kwargs):
    calls.append(prompt)
    if os.environ["RANK"] == "1" and len(calls) == 5:  # prompt 9, after the syncs at next_idx 4 and 8
        open(os.environ["JLENS_TEST_HALTED"], "w").close()
        time.sleep(3600)  # until its node is lost
    return real(model, prompt, **kwargs)
fit_module.jacobian_for_prompt = halting
sys.exit(main(sys.argv[1:]))
"""


def lose_node_when(procs: dict[str, subprocess.Popen], lost: str, marker: Path) -> None:
    """SIGKILL every process of node ``lost`` (its torchrun and its worker) once ``marker`` exists."""
    deadline = time.monotonic() + 240  # a hang guard, not a measurement
    while not marker.exists() and all(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists(), "rank 1 never reached its halting prompt"
    kill_node(procs[lost])


@pytest.mark.slow
def test_two_nodes_resume_after_a_node_is_lost_equals_an_uninterrupted_fit(work, tmp_path, reference, monkeypatch):
    # Each node has its own disk for the checkpoint (--checkpoint differs), the lens goes to a shared
    # folder. Node B (rank 1) is lost mid-fit; the job restarts with B replaced by a fresh machine
    # (no checkpoint) that now comes first in the rendezvous, so global rank 0 has no copy of its own.
    n = 40
    out = tmp_path / "lost.safetensors"
    diag_path, status_path, _ = sidecars(out)
    disk = {"A": tmp_path / "disk-a" / "fit.ckpt", "B": tmp_path / "disk-b" / "fit.ckpt"}
    halting, halted = tmp_path / "halting_rank.py", tmp_path / "halted"  # rank 1 stops at a known prompt
    halting.write_text(HALTING_RANK)
    monkeypatch.setenv("JLENS_TEST_HALTED", str(halted))  # read by rank 1 only

    def args(node: str, program: tuple[str, ...] = ("-m", "jlens_core")) -> list[str]:
        return [*program, *fit_args(work, out, "--n-prompts", str(n), "--checkpoint", str(disk[node]),
                                    "--checkpoint-every", "2")]

    procs = start_nodes(tmp_path, "first", {"127.0.0.1": args("A", (str(halting),)),
                                            "127.0.0.2": args("B", (str(halting),))})
    try:
        lose_node_when(procs, "127.0.0.2", halted)
    finally:
        codes = wait_nodes(procs, timeout=180)
    assert codes["127.0.0.2"] == -signal.SIGKILL
    assert codes["127.0.0.1"] != 0, stderr_of(tmp_path, "first")  # the survivor stops instead of hanging
    assert json.loads(status_path.read_text())["state"] == "failed"
    assert not out.exists()
    saved = read_checkpoint(disk["A"])
    k = saved["next_idx"]
    assert k == saved["n_done"] == 8  # the last sync before rank 1 halted
    assert disk["B"].exists()  # both nodes wrote a copy ...
    shutil.rmtree(disk["B"].parent)  # ... and B's machine is replaced by one with an empty disk

    # the same command, a new job
    fit_on_two_nodes(tmp_path, "again", {"127.0.0.1": args("B"), "127.0.0.2": args("A")}, out, n, reference)
    records = read_jsonl(diag_path)
    assert records[: 3 * k] == saved["diagnostics"]  # resumed from A's copy, not recomputed
    assert [(r["prompt_index"], r["layer"]) for r in records] == [(p, la) for p in range(n) for la in SOURCES]
    finals = [read_checkpoint(disk[node]) for node in "AB"]  # each node's copy, equal
    assert all(c["n_done"] == n for c in finals)
    for layer in SOURCES:
        assert torch.equal(finals[0]["jacobian_sum"][str(layer)], finals[1]["jacobian_sum"][str(layer)])


# -- bad input: one sentence, exit code 2, no traceback -----------------------------------------------

def bad_inputs(work, tmp: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty.txt").write_text("\n\n   \n")
    (tmp / "short.txt").write_text("too short\n\nalso short\n")
    (tmp / "not-a-lens.safetensors").write_text("this is not a lens")
    folder_out = tmp / "outdir"
    folder_out.mkdir(exist_ok=True)
    good = tmp / "good.safetensors"
    return {
        "missing corpus": (fit_args(work, tmp / "x.safetensors", corpus=str(tmp / "nope.txt")),
                           "jlens fit: error: No corpus file at '"),
        "unknown model": (["fit", "--model", "nobody-jlens/no-such-model", "--corpus", work["corpus"], "--out",
                           str(tmp / "x.safetensors"), "--min-chars", "0", "--split", "all"],
                          "jlens fit: error: Could not load the model 'nobody-jlens/no-such-model'"),
        "empty corpus": (fit_args(work, tmp / "x.safetensors", corpus=str(tmp / "empty.txt")),
                         "is empty: it holds no text"),
        "too-short corpus": (fit_args(work, tmp / "x.safetensors", "--skip-first", "16",
                                      corpus=str(tmp / "short.txt")),
                             "jlens fit: error: No prompt counted: all 2 prompts were skipped"),
        "bad layer spec": (fit_args(work, tmp / "x.safetensors", "--layers", "0:x"),
                           "jlens fit: error: Layer spec part '0:x': stop 'x' is not an integer"),
        "layer out of range": (fit_args(work, tmp / "x.safetensors", "--layers", "0,9"),
                               "jlens fit: error: Layer 9 (in layer spec part '9') is out of range"),
        "bad dtype": (fit_args(work, tmp / "x.safetensors", "--dtype", "int7"), "Unknown dtype 'int7'"),
        "out is a folder": (fit_args(work, folder_out), "is a folder; give a file path"),
        "not a lens": (["merge", str(tmp / "not-a-lens.safetensors"), "--out", str(tmp / "m.safetensors")],
                       "jlens merge: error: '" + str(tmp / "not-a-lens.safetensors") + "' is not a readable lens"),
        "missing merge input": (["merge", str(good), str(tmp / "missing.safetensors"), "--out",
                                 str(tmp / "m.safetensors")],
                                "jlens merge: error: No lens file at '" + str(tmp / "missing.safetensors")),
    }


@pytest.fixture(scope="module")
def bad_dir(work, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    assert main(fit_args(work, tmp / "good.safetensors", "--n-prompts", "1")) == 0
    return tmp


BAD = ["missing corpus", "unknown model", "empty corpus", "too-short corpus", "bad layer spec",
       "layer out of range", "bad dtype", "out is a folder", "not a lens", "missing merge input"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_sentence_and_exit_code_2(case, work, bad_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args, expected = bad_inputs(work, bad_dir)[case]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    assert expected in errors[0]


def test_resume_with_other_settings_says_which_and_how_to_start_over(work, tmp_path, capsys):
    out = tmp_path / "lens.safetensors"
    assert main(fit_args(work, out, "--n-prompts", "2")) == 0
    capsys.readouterr()
    assert main(fit_args(work, out, "--n-prompts", "2", "--skip-first", "5")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "was made with skip_first=4, this fit asks for skip_first=5" in err and "--no-resume" in err
    assert main(fit_args(work, out, "--n-prompts", "2", "--skip-first", "5", "--no-resume")) == 0
    assert JacobianLens.load(out).fit_settings.skip_first == 5


@pytest.mark.slow  # a real jlens process each
@pytest.mark.parametrize("case", ["missing corpus", "not a lens"])
def test_bad_input_in_a_real_process_exits_non_zero_without_traceback(case, work, bad_dir):
    args, expected = bad_inputs(work, bad_dir)[case]
    proc = run_jlens(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert expected in proc.stderr
    debug = run_jlens("--debug", *args)  # --debug shows the traceback
    assert debug.returncode != 0 and "Traceback" in debug.stderr


# -- help and entry points -------------------------------------------------------------------------

def _subcommands(parser):
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


FIT_OPTIONS = ["--model", "--corpus", "--out", "--n-prompts", "--max-seq-len", "--skip-first", "--dim-batch",
               "--layers", "--target-layer", "--checkpoint", "--checkpoint-every", "--no-resume",
               "--stop-at-delta", "--device", "--dtype"]


def test_every_subcommand_help_explains_every_option():
    subcommands = _subcommands(build_parser())
    assert {"fit", "merge"} <= set(subcommands)
    for name, sub in subcommands.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if action.dest == "help" or action.help == argparse.SUPPRESS:  # deliberately hidden pass-throughs
                continue
            assert action.help and len(action.help.split()) >= 2, f"{name} {action.option_strings or action.dest}"
            assert " ".join(action.help.split()).split("%")[0] in text
            for option in action.option_strings:
                assert option in text, f"jlens {name} --help lacks {option}"
    parser = build_parser()
    top = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and all(option in top for option in action.option_strings)
    for name in subcommands:
        assert name in top
    fit_help = subcommands["fit"].format_help()
    for option in FIT_OPTIONS:
        assert option in fit_help


def test_every_subcommand_has_a_description_and_docstring_descriptions_are_their_first_paragraph():
    import importlib

    from jlens_core.cli.main import command_description

    subcommands = _subcommands(build_parser())
    for name, sub in subcommands.items():
        assert sub.description and len(sub.description.split()) >= 8, f"jlens {name} has no description"
    for name in ("study", "tune", "inspect"):  # the modules whose docstring opens with the description
        doc = importlib.import_module(f"jlens_core.cli.{name}").__doc__
        first = doc.strip().split("\n\n")[0]
        assert subcommands[name].description == first == command_description(doc)
        assert "``jlens " + name + "``" in doc and "``jlens" not in first  # the description, not the docstring's title
    assert command_description("One.\n\nTwo.") == "One." and command_description(None) == ""


def test_python_m_jlens_core_help_lists_the_subcommands():
    proc = run_jlens("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: jlens")
    for name in ("fit", "merge"):
        assert name in proc.stdout
    fit = run_jlens("fit", "--help")
    assert fit.returncode == 0 and all(option in fit.stdout for option in FIT_OPTIONS)


def test_console_script_entry_is_the_cli_main(capsys):
    pyproject = (REPO / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    target = re.search(r'^jlens\s*=\s*"([^"]+)"', scripts, re.MULTILINE).group(1)
    assert target == "jlens_core.cli.main:main"
    module_name, _, attr = target.partition(":")
    import importlib

    entry = getattr(importlib.import_module(module_name), attr)
    assert entry is main
    with pytest.raises(SystemExit) as exit_info:
        entry(["merge", "--help"])
    assert exit_info.value.code == 0
    assert "usage: jlens merge" in capsys.readouterr().out
    assert entry([]) == 2  # no subcommand: the overview, and a usage exit code
