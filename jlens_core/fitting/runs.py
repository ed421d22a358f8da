"""Fits run in the background (the app's Fit page draws them): ``jlens fit`` and ``jlens weigh`` subprocesses,
a registry of them found again from their files, and their process management (pids, ``/proc``, signals).

Each run lives in its own folder under the runs folder (``$JLENS_RUNS_DIR`` or
``~/.cache/jlens/runs``)::

    <runs>/<name>/run.json                    what the app launched (CLI arguments, pid, time)
    <runs>/<name>/lens.safetensors            the lens, written when the fit ends
    <runs>/<name>/lens.status.json            the fit's own state (``jlens fit`` rewrites it)
    <runs>/<name>/lens.diagnostics.jsonl      one record per prompt x layer, streamed
    <runs>/<name>/lens.ckpt                   the checkpoint (Resume continues from it)
    <runs>/<name>/fit.log                     the fit's stdout and stderr
    <runs>/<name>/weigh.json                  a "Learn weights" run of a finished expert fit (``jlens weigh``)
    <runs>/<name>/weighted.safetensors        its weighted expert lens (and ``weighted.weigh.json``, its scores)
    <runs>/<name>/weigh.log                   its stdout and stderr (progress bars included)

The fit runs in its own process and session (``start_new_session``): it keeps going when the
browser closes or reloads, and a crash of the fit cannot take the server down. A page finds a run
again from these files alone.

Fits are kept, on purpose, when the app stops or dies (``docs/security.md``): a fit is an hour's
work that writes its own status file and checkpoint, and the next ``jlens app`` on the same
workspace lists it (running, or ``lost`` and resumable). Stop it from the Fit page, or with SIGINT.
At most ``max_active`` fits and weight runs run at once (:func:`start`, :func:`resume`, :func:`start_weigh`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from .._keywords import checked_options
from ..lenses.fit_settings import FitPlan, FitSettings

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11
from .runfiles import diagnostics_path, status_path

RUN_FILE = "run.json"
LENS_FILE = "lens.safetensors"
LOG_FILE = "fit.log"
WEIGH_FILE = "weigh.json"
WEIGHED_FILE = "weighted.safetensors"
WEIGH_LOG = "weigh.log"
_PROGRESS = re.compile(r"(read items|learn weights):\s*(\d+)%")
ACTIVE = ("starting", "running")
FINAL = ("done", "failed", "stopped", "lost")
_PROCESSES: dict[int, subprocess.Popen] = {}  # children of this server, polled so they never linger as zombies
_NAME_OK = re.compile(r"[^A-Za-z0-9._-]+")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def pid_alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists and is not a zombie (children of this server are reaped)."""
    if not pid:
        return False
    proc = _PROCESSES.get(int(pid))
    if proc is not None and proc.poll() is not None:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def _is_fit_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True  # no /proc (macOS): trust the status file
    return "jlens" in cmdline and ("fit" in cmdline or "weigh" in cmdline)


@dataclass
class Run:
    """A fit, as its files describe it."""

    folder: Path
    info: dict = field(default_factory=dict)
    status: dict = field(default_factory=dict)
    lens_path: Path = Path()

    @property
    def name(self) -> str:
        return self.info.get("name") or self.folder.name

    @property
    def status_path(self) -> Path:
        return status_path(self.lens_path)

    @property
    def diagnostics_path(self) -> Path:
        return diagnostics_path(self.lens_path)

    @property
    def log_path(self) -> Path:
        return self.folder / LOG_FILE

    @property
    def model_spec(self) -> str:
        return str(self.info.get("model") or self.status.get("model") or "")

    @property
    def rules(self) -> str:
        """The fit's backward rules: ``"jacobian"`` (a J lens) or ``"relevance"`` (an R-lens), as the Fit page set them.

        A fit followed from elsewhere has no settings here; its lens file's header says (the Fit page reads it).
        """
        return str(self.info.get("settings", {}).get("rules") or "jacobian")

    @property
    def followed(self) -> bool:
        """A fit started elsewhere (by the CLI) that the app only watches."""
        return not self.info.get("args")

    @property
    def pid(self) -> int | None:
        pid = self.info.get("pid") or self.status.get("pid")
        return int(pid) if pid else None

    @property
    def state(self) -> str:
        """``starting``, ``running``, ``done``, ``failed``, ``stopped`` or ``lost`` (the process is gone).

        A relaunched fit (Resume) reads ``starting`` until its process rewrites the status file.
        """
        launched_pid = self.info.get("pid")
        status_pid = self.status.get("pid")
        alive = pid_alive(launched_pid or status_pid)
        if launched_pid and status_pid != launched_pid:  # this launch has not written its status yet
            if alive:
                return "starting"
            if self.status.get("state") == "done" and not self.info.get("resumed"):
                return "done"
            return "failed"
        state = self.status.get("state") or ("starting" if alive else "failed")
        if state in ACTIVE and not alive:
            return "lost"
        return state

    def log_tail(self, n_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n_lines:])

    def error_sentence(self) -> str | None:
        """The fit's error: from its status file, else the ``jlens fit: error:`` line of its log."""
        launched = self.info.get("pid")
        if self.status.get("error") and (not launched or self.status.get("pid") == launched):
            return str(self.status["error"])
        for line in reversed(self.log_tail(60).splitlines()):
            if "error:" in line:
                return line.split("error:", 1)[1].strip()
        return None


def load_run(folder: str | os.PathLike) -> Run:
    """The :class:`Run` in ``folder`` (its ``run.json`` and status file)."""
    folder = Path(folder)
    info = _read_json(folder / RUN_FILE)
    lens_path = Path(info.get("out") or folder / LENS_FILE)
    return Run(folder=folder, info=info, status=_read_json(status_path(lens_path)), lens_path=lens_path)


def follow(lens_path: str | os.PathLike) -> Run:
    """A :class:`Run` that watches a fit started elsewhere, from its ``--out`` lens path.

    Raises:
        FileNotFoundError: there is no status file next to that path.
    """
    lens_path = Path(lens_path).expanduser()
    status_file = status_path(lens_path)
    if not status_file.is_file():
        raise FileNotFoundError(f"No fit status at {str(status_file)!r}: give the --out path of a `jlens fit`.")
    return Run(folder=lens_path.parent, info={"name": lens_path.stem, "out": str(lens_path)},
               status=_read_json(status_file), lens_path=lens_path)


def list_runs(root: str | os.PathLike) -> list[Run]:
    """Every run under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [load_run(p) for p in root.iterdir() if (p / RUN_FILE).is_file()]
    return sorted(found, key=lambda r: r.info.get("created", 0), reverse=True)


def new_name(model_spec: str) -> str:
    """A fresh run name: the model's short name and the time."""
    short = _NAME_OK.sub("-", Path(model_spec.rstrip("/")).name or "model").strip("-")[:40] or "model"
    return f"{short}-{time.strftime('%Y%m%d-%H%M%S')}"


class FitRunKeywords(TypedDict, total=False):
    """:func:`fit_arguments`'s further keywords, each a ``jlens fit`` flag: ``min_chars`` (400) and ``split``
    (``"fit"``) of the corpus, the ``checkpoint`` path, ``stop_at_delta``, and the model's ``device`` and ``dtype``
    (``None`` or ``"auto"``: not given)."""

    min_chars: int
    split: str
    checkpoint: str | None
    stop_at_delta: float | None
    device: str | None
    dtype: str | None


def fit_arguments(*, model: str, corpus: str, out: Path, settings: FitSettings | None = None,
                  plan: FitPlan | None = None, n_prompts: int | None = None,
                  **options: Unpack[FitRunKeywords]) -> list[str]:
    """The ``jlens fit`` command-line arguments for these settings (see ``jlens fit --help``).

    ``settings`` / ``plan`` (defaults when ``None``) give their own flags (:meth:`FitSettings.cli_arguments`: those
    that differ from the flag's default); the rest are the run's: corpus, prompts, checkpoint, stop, model loading
    (:class:`FitRunKeywords`). Raises ``TypeError`` for a keyword that is none of these.
    """
    given = checked_options("fit_arguments", options, FitRunKeywords)
    min_chars: int = given.get("min_chars", 400)
    split: str = given.get("split", "fit")
    checkpoint, stop_at_delta = given.get("checkpoint"), given.get("stop_at_delta")
    device, dtype = given.get("device"), given.get("dtype")
    settings = settings if settings is not None else FitSettings()
    plan = plan if plan is not None else FitPlan()
    args = ["--model", model, "--corpus", corpus, "--out", str(out), "--min-chars", str(int(min_chars)),
            "--split", split, "--no-progress", *settings.cli_arguments(), *plan.cli_arguments()]
    if n_prompts:
        args += ["--n-prompts", str(int(n_prompts))]
    if checkpoint:
        args += ["--checkpoint", str(checkpoint)]
    if stop_at_delta:
        args += ["--stop-at-delta", repr(float(stop_at_delta))]
    if device and device != "auto":
        args += ["--device", device]
    if dtype and dtype != "auto":
        args += ["--dtype", dtype]
    return args


def weigh_arguments(*, lens: Path, model: str, out: Path, sets: list[str] | None = None, device: str | None = None,
                    dtype: str | None = None) -> list[str]:
    """The ``jlens weigh`` command-line arguments: learn the expert weights of ``lens`` on ``sets`` (default: every
    shipped set) and write the weighted lens to ``out`` (see ``jlens weigh --help``)."""
    args = [str(lens), "--model", model, "--out", str(out)]
    if sets:
        args += ["--sets", ",".join(sets)]
    if device and device != "auto":
        args += ["--device", device]
    if dtype and dtype != "auto":
        args += ["--dtype", dtype]
    return args


def _launch(run_folder: Path, args: list[str], command: str = "fit", log: str = LOG_FILE) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    repo = Path(__file__).resolve().parents[2]
    if (repo / "jlens_core").is_dir():  # a source checkout: the fit runs this jlens_core, installed or not
        env["PYTHONPATH"] = str(repo) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(run_folder / log, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "jlens_core", command, *args], cwd=str(run_folder), env=env,
                                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _PROCESSES[proc.pid] = proc
    return proc.pid


def clean_name(name: str) -> str:
    """A run name safe as a folder name: letters, digits, ``._-`` (no ``..``, no separators).

    Raises:
        ValueError: nothing usable is left.
    """
    name = _NAME_OK.sub("-", name.strip()).strip("-.")
    if not name:
        raise ValueError("Give the run a name (letters, digits, '.', '_' or '-').")
    return name


def check_capacity(root: str | os.PathLike, max_active: int | None) -> None:
    """Refuse a launch when ``max_active`` fits under ``root`` are starting or running already.

    Raises:
        ValueError: the limit is reached (a sentence naming the running fits).
    """
    if max_active is None:
        return
    active = active_names(root)
    if len(active) >= max_active:
        raise ValueError(f"{len(active)} fit(s) are running ({', '.join(active)}) and this app runs at most "
                         f"{max_active} at once: wait for one to end or stop it.")


def active_names(root: str | os.PathLike) -> list[str]:
    """The fits and weight runs under ``root`` that are starting or running (a weight run as ``<run> (weights)``)."""
    found = []
    for run in list_runs(root):
        if run.state in ACTIVE:
            found.append(run.name)
        weigh = load_weigh(run)
        if weigh is not None and weigh.state in ACTIVE:
            found.append(f"{run.name} (weights)")
    return found


def start(root: str | os.PathLike, name: str, *, model: str, max_active: int | None = None, **settings: Any) -> Run:
    """Launch ``jlens fit`` for a new run ``name`` under ``root`` (settings: :func:`fit_arguments`'s keywords,
    ``settings=`` a :class:`FitSettings` and ``plan=`` a :class:`FitPlan` among them).

    ``max_active``: refuse when that many fits under ``root`` are active already (``None``: no limit).

    Raises:
        ValueError: a run of that name exists already, an empty name, or ``max_active`` fits are running.
    """
    name = clean_name(name)
    check_capacity(root, max_active)
    folder = Path(root) / name
    if (folder / RUN_FILE).exists():
        raise ValueError(f"A run named {name!r} exists already: pick another name, or Resume it.")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / LENS_FILE
    args = fit_arguments(model=model, out=out, **settings)
    # run.json keeps the settings flat, as JSON: the fit's and the plan's fields, then the run's own
    fit_settings, plan = settings.pop("settings", None) or FitSettings(), settings.pop("plan", None) or FitPlan()
    recorded = {**fit_settings.to_dict(), **plan.to_dict(), **settings}
    info = {"name": name, "model": model, "out": str(out), "args": args, "settings": recorded,
            "created": time.time()}
    (folder / RUN_FILE).write_text(json.dumps(info, indent=1))
    info["pid"] = _launch(folder, args)
    info["launched"] = time.time()
    (folder / RUN_FILE).write_text(json.dumps(info, indent=1))
    return load_run(folder)


def resume(run: Run, max_active: int | None = None) -> Run:
    """Launch the run's fit again with its arguments: it continues from its checkpoint.

    Raises:
        ValueError: the run is still active, was not started by the app, or ``max_active`` fits are running.
    """
    if run.followed:
        raise ValueError("This fit was started outside the app; resume it with the same `jlens fit` command.")
    if run.state in ACTIVE:
        raise ValueError(f"The run {run.name!r} is still {run.state}.")
    check_capacity(run.folder.parent, max_active)
    info = dict(run.info)
    args = [a for a in info["args"] if a != "--no-resume"]
    info.update(pid=_launch(run.folder, args), launched=time.time(), resumed=True)
    (run.folder / RUN_FILE).write_text(json.dumps(info, indent=1))
    return load_run(run.folder)


@dataclass
class Weigh:
    """A "Learn weights" run (``jlens weigh``) of a finished expert fit, as its files describe it."""

    folder: Path
    info: dict = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return Path(self.info.get("out") or self.folder / WEIGHED_FILE)

    @property
    def record_path(self) -> Path:
        """The scores ``jlens weigh`` writes beside the lens (``OUT.weigh.json``), last."""
        return self.out.with_suffix(".weigh.json")

    @property
    def log_path(self) -> Path:
        return self.folder / WEIGH_LOG

    @property
    def state(self) -> str:
        """``running`` (its process is alive), ``done`` (the weighted lens and its record are written) or ``failed``."""
        if pid_alive(self.info.get("pid")):
            return "running"
        if self.out.is_file() and self.record_path.is_file() and \
                self.record_path.stat().st_mtime >= float(self.info.get("launched") or 0) - 1:
            return "done"
        return "failed"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def progress(self) -> tuple[str, float] | None:
        """The last progress bar's ``(stage, fraction)`` in the log (``read items``, ``learn weights``), if any."""
        found = _PROGRESS.findall(self.log_text())
        return (found[-1][0], int(found[-1][1]) / 100) if found else None

    def error_sentence(self) -> str | None:
        for line in reversed(self.log_text().replace("\r", "\n").splitlines()):
            if "error:" in line:
                return line.split("error:", 1)[1].strip()
        return None

    def record(self) -> dict:
        return _read_json(self.record_path)


def load_weigh(run: Run) -> Weigh | None:
    """The run's "Learn weights" run, or ``None`` when none was started."""
    path = run.folder / WEIGH_FILE
    return Weigh(run.folder, _read_json(path)) if path.is_file() else None


def start_weigh(run: Run, *, sets: list[str] | None = None, max_active: int | None = None) -> Weigh:
    """Launch ``jlens weigh`` on a finished expert fit: the weighted lens is written to ``<run>/weighted.safetensors``.

    Raises:
        ValueError: the fit is not a finished expert fit of the app, its weights are being learned already, or
            ``max_active`` fits and weight runs are running.
    """
    from ..lenses.experts import is_expert_lens_file

    if run.followed or run.state != "done" or not run.lens_path.is_file():
        raise ValueError(f"The run {run.name!r} is not a finished fit of this app: learn weights once it is done.")
    if not is_expert_lens_file(run.lens_path):
        raise ValueError(f"The run {run.name!r} fitted no experts (Experts = 0), so it has no weights to learn: "
                         "fit with Experts = 8.")
    current = load_weigh(run)
    if current is not None and current.state in ACTIVE:
        raise ValueError(f"The weights of {run.name!r} are being learned already.")
    check_capacity(run.folder.parent, max_active)
    settings = run.info.get("settings", {})
    out = run.folder / WEIGHED_FILE
    args = weigh_arguments(lens=run.lens_path, model=run.model_spec, out=out, sets=sets,
                           device=settings.get("device"), dtype=settings.get("dtype"))
    info = {"args": args, "out": str(out), "sets": sets or [], "launched": time.time()}
    info["pid"] = _launch(run.folder, args, command="weigh", log=WEIGH_LOG)
    (run.folder / WEIGH_FILE).write_text(json.dumps(info, indent=1))
    return Weigh(run.folder, info)


def stop(run: Run, *, force: bool = False) -> bool:
    """Interrupt the run's process (SIGINT: the fit records ``stopped`` and keeps its checkpoint).

    ``force`` sends SIGKILL (the status then reads ``lost``; Resume still works from the checkpoint).

    Returns:
        Whether a signal was sent.
    """
    pid = run.pid
    if not pid or not pid_alive(pid) or not _is_fit_process(pid):
        return False
    try:
        os.kill(pid, signal.SIGKILL if force else signal.SIGINT)
    except OSError:
        return False
    return True


__all__ = ["ACTIVE", "FINAL", "FitRunKeywords", "Run", "Weigh", "active_names", "check_capacity", "clean_name", "fit_arguments", "follow",
           "list_runs", "load_run", "load_weigh", "new_name", "pid_alive", "resume", "start", "start_weigh", "stop",
           "weigh_arguments"]
