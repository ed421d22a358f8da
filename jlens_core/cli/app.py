"""``jlens app``: start the Streamlit app (``streamlit run app/main.py``).

The app lives in ``app/`` next to this package in a source checkout (``pip install -e .``). Common
Streamlit options (``--server.port 8502``, ``--server.headless true``, ...) are passed through as
they are; any other Streamlit option goes after ``--``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from .._paths import APP_DIR
from .main import CLIError

APP_ENV = "JLENS_APP_DIR"  # override where app/main.py is looked for
# Streamlit options accepted as they are (others go after `--`).
PASSTHROUGH = ("server.port", "server.address", "server.headless", "server.baseUrlPath", "server.maxUploadSize",
               "server.fileWatcherType", "server.runOnSave", "server.enableCORS", "server.enableXsrfProtection",
               "browser.gatherUsageStats", "browser.serverAddress", "browser.serverPort", "theme.base",
               "logger.level", "client.toolbarMode")


def app_script() -> Path:
    """``app/main.py``: ``$JLENS_APP_DIR/main.py``, else the ``app/`` folder beside the package.

    Raises:
        CLIError: no app found (an installed wheel without the source tree).
    """
    env = os.environ.get(APP_ENV)
    candidates = [Path(env) / "main.py"] if env else []
    candidates.append(APP_DIR / "main.py")
    for path in candidates:
        if path.is_file():
            return path
    raise CLIError(f"The app is not found at {', '.join(str(p) for p in candidates)}: `jlens app` needs the source "
                   f"tree (git clone, then `pip install -e .`), or set {APP_ENV} to the folder holding main.py.")


def streamlit_command(args: argparse.Namespace) -> list[str]:
    """The command line that starts the app for these arguments.

    ``app/serve.py run app/main.py``: ``streamlit run`` with the model and the default prompt's
    readings loading in the server process while the browser connects (plain ``streamlit run``
    where an app folder has no ``serve.py``).
    """
    script = app_script()
    serve = script.parent / "serve.py"
    launcher = [sys.executable, str(serve)] if serve.is_file() else [sys.executable, "-m", "streamlit"]
    cmd = launcher + ["run", str(script)]
    options = dict(args.streamlit_options or [])
    if args.port is not None:
        options.setdefault("server.port", str(args.port))
    if args.address is not None:
        options.setdefault("server.address", args.address)
    if args.headless:
        options.setdefault("server.headless", "true")
    options.setdefault("browser.gatherUsageStats", "false")
    for name, value in options.items():
        cmd += [f"--{name}", value]
    extra = list(args.extra or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return cmd + extra


class _Option(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest) or [])
        items.append((option_string.lstrip("-"), values))
        setattr(namespace, self.dest, items)


def cmd_app(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("streamlit") is None or importlib.util.find_spec("plotly") is None:
        raise CLIError("The app needs Streamlit and Plotly: pip install -e '.[app]'.")
    env = dict(os.environ)
    if args.model:
        env["JLENS_APP_MODEL"] = args.model
    if args.lens:
        env["JLENS_APP_LENS"] = args.lens
    if args.runs_dir:
        env["JLENS_RUNS_DIR"] = str(Path(args.runs_dir).expanduser())
    cmd = streamlit_command(args)
    if args.print_command:
        print(" ".join(cmd))
        return 0
    return run_server(cmd, env)


def run_server(cmd: list[str], env: dict) -> int:
    """Run the Streamlit server as a child and stop it with this process.

    SIGTERM, SIGINT and SIGHUP sent to ``jlens app`` are passed on to the server, which is then
    waited for (and killed if it has not stopped within 15 s), so no server is left serving after
    ``kill`` of the command that started it.
    """
    proc = subprocess.Popen(cmd, env=env)
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if signum is not None:
            previous[signum] = signal.signal(signum, forward)
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 + received[0] if received else code


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "app", help="start the Streamlit app (inspect prompts, fit and watch lenses, study the Jacobians)",
        description="Start the jlens Streamlit app: `streamlit run app/main.py`. Streamlit options such as "
                    "--server.port 8502 or --server.headless true pass through; put any other after `--`.")
    p.add_argument("--port", type=int, default=None, help="port to serve on (Streamlit's default 8501)")
    p.add_argument("--address", default=None, help="address to bind (default: all interfaces)")
    p.add_argument("--headless", action="store_true", help="do not open a browser (servers, CI)")
    p.add_argument("--model", default=None, help="model preselected in the sidebar (default: smollm2-135m)")
    p.add_argument("--lens", default=None, help="lens preselected: a file path, 'shipped' or 'none'")
    p.add_argument("--runs-dir", default=None, help="where the Fit page keeps its runs (default ~/.cache/jlens/runs)")
    p.add_argument("--print-command", action="store_true", help="print the streamlit command instead of running it")
    for name in PASSTHROUGH:
        p.add_argument(f"--{name}", dest="streamlit_options", action=_Option, metavar="VALUE",
                       help=argparse.SUPPRESS)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="further Streamlit options, after `--`")
    p.set_defaults(func=cmd_app, streamlit_options=None)
