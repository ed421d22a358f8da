"""``jlens app``: start the Streamlit app (``streamlit run app/main.py``).

The app lives in ``app/`` next to this package in a source checkout (``pip install -e .``). Common
Streamlit options (``--server.port 8502``, ``--server.headless true``, ...) are passed through as
they are; any other Streamlit option goes after ``--``, except those that decide who can reach the
server (:data:`EXPOSURE_OPTIONS`, refused there).

Safe by default (``docs/security.md``): the server binds 127.0.0.1; listening beyond loopback
(``--address``) needs a token (generated and printed once, or ``--token`` / ``JLENS_APP_TOKEN``)
unless ``--no-token``; every path a visitor types is confined to ``--workspace`` (default
``./runs``) unless ``--allow-any-path``; at most ``--max-fits`` fits run at once; and the server
stops within 2 s when this command dies, SIGKILL included.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

from .._extras import require_extra
from .._paths import APP_DIR
from ..workspace import DEFAULT_WORKSPACE, ENV_ALLOW_ANY_PATH, ENV_EXTRA_PATHS, ENV_WORKSPACE, looks_like_path
from .main import CLIError

log = logging.getLogger("jlens.cli.app")

APP_ENV = "JLENS_APP_DIR"  # override where app/main.py is looked for
ENV_TOKEN = "JLENS_APP_TOKEN"  # the access token (set: every request needs it)
ENV_MAX_FITS = "JLENS_APP_MAX_FITS"  # fits running at once, at most
ENV_PARENT_PID = "JLENS_APP_PARENT_PID"  # the server stops when this process is gone
DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_PORT = 8501
DEFAULT_MAX_UPLOAD_MB = "512"  # Streamlit's server.maxUploadSize, set explicitly (lens files run to hundreds of MB)
# Streamlit options accepted as they are (others go after `--`).
PASSTHROUGH = ("server.port", "server.address", "server.headless", "server.baseUrlPath", "server.maxUploadSize",
               "server.fileWatcherType", "server.runOnSave", "server.enableCORS", "server.enableXsrfProtection",
               "browser.gatherUsageStats", "browser.serverAddress", "browser.serverPort", "theme.base",
               "logger.level", "client.toolbarMode", "runner.postScriptGC")
# Streamlit options that decide who can reach the server: refused after `--`, where they would bypass the
# loopback bind and the token rule (jlens's own --address, --port and the options above are checked).
EXPOSURE_OPTIONS = ("server.address", "server.port", "server.enableCORS", "server.enableXsrfProtection",
                    "server.maxUploadSize", "browser.serverAddress")


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
    options.setdefault("server.address", args.address or DEFAULT_ADDRESS)
    if args.headless:
        options.setdefault("server.headless", "true")
    options.setdefault("server.maxUploadSize", DEFAULT_MAX_UPLOAD_MB)
    options.setdefault("browser.gatherUsageStats", "false")
    # Streamlit collects every generation of garbage after each script run, a fragment's included: with torch and
    # a model in the heap that is 0.3-0.7 s of the GIL per run, and Inspect polls its extras every 0.5 s (the
    # stability marks took 6.6 s instead of 1.9 s to compute beside it). Python's own collector still runs.
    options.setdefault("runner.postScriptGC", "false")
    for name, value in options.items():
        cmd += [f"--{name}", value]
    extra = list(args.extra or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    refuse_exposure_options(extra)
    return cmd + extra


def refuse_exposure_options(extra: list[str]) -> None:
    """Refuse an :data:`EXPOSURE_OPTIONS` option among the Streamlit options given after ``--``.

    Streamlit takes the last value of a repeated option, so ``-- --server.address 0.0.0.0`` would
    override the address the token rule was decided for.

    Raises:
        CLIError: one of them is there (``--name value`` or ``--name=value``).
    """
    for item in extra:
        name = item[2:].split("=", 1)[0] if item.startswith("--") else ""
        if name in EXPOSURE_OPTIONS:
            raise CLIError(f"--{name} after `--` would bypass jlens's loopback and token checks: use "
                           f"jlens app's own --address, --port or --{name} before `--` (docs/security.md).")


class _Option(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest) or [])
        items.append((option_string.lstrip("-"), values))
        setattr(namespace, self.dest, items)


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP or ``localhost``) reaches only this machine."""
    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to a network interface
        return False


def _operator_path(value: str) -> str:
    """A path given on the command line made absolute (the app takes relative ones against its workspace)."""
    return str(Path(value).expanduser().resolve()) if looks_like_path(value) else value


def server_env(args: argparse.Namespace, address: str) -> tuple[dict, str | None]:
    """The server process's environment for these arguments, and the token (``None``: no token).

    Raises:
        CLIError: ``--max-fits`` below 1, or ``--token`` with ``--no-token``.
    """
    env = dict(os.environ)
    if args.model:
        env["JLENS_APP_MODEL"] = _operator_path(args.model)
    if args.lens:
        env["JLENS_APP_LENS"] = _operator_path(args.lens)
    workspace = Path(args.workspace or env.get(ENV_WORKSPACE) or DEFAULT_WORKSPACE).expanduser().resolve()
    env[ENV_WORKSPACE] = str(workspace)
    if args.runs_dir:
        env["JLENS_RUNS_DIR"] = str(Path(args.runs_dir).expanduser().resolve())
    if args.allow_any_path:
        env[ENV_ALLOW_ANY_PATH] = "1"
    # What the operator named is trusted: the model and lens paths given here stay loadable.
    named = [env[k] for k in ("JLENS_APP_MODEL", "JLENS_APP_LENS") if k in env and Path(env[k]).is_absolute()]
    if named:
        env[ENV_EXTRA_PATHS] = os.pathsep.join(named)
    if args.max_fits < 1:
        raise CLIError(f"--max-fits {args.max_fits} lets no fit run: give 1 or more.")
    env[ENV_MAX_FITS] = str(args.max_fits)
    env[ENV_PARENT_PID] = str(os.getpid())
    if args.no_token and args.token:
        raise CLIError("--token and --no-token contradict each other: give one of them.")
    token = None if args.no_token else (args.token or env.get(ENV_TOKEN) or None)
    if token is None and not args.no_token and not is_loopback(address):
        token = secrets.token_urlsafe(24)
    if token is None:
        env.pop(ENV_TOKEN, None)
    else:
        env[ENV_TOKEN] = token
    return env, token


def _announce(address: str, port: str, token: str | None, no_token: bool, generated: bool) -> None:
    """The warnings and the one printing of a generated token's URL (stderr: for the person who started the app).

    A token the operator chose (``--token``, ``$JLENS_APP_TOKEN``) is not printed: they have it.
    """
    host = "127.0.0.1" if address in ("0.0.0.0", "::", "[::]") else address
    shown = token if generated else "<your token>"
    if not is_loopback(address):
        print(f"jlens app: WARNING: listening on {address}, beyond this machine. Anyone who can reach it "
              "and holds the token can run models, read and write files in the workspace, and start fits.",
              file=sys.stderr)
        if no_token:
            print("jlens app: WARNING: --no-token: anyone who can reach this address can use the app; "
                  "no token is asked for.", file=sys.stderr)
    if token is not None:
        print(f"jlens app: open http://{host}:{port}/?token={shown}", file=sys.stderr)


def cmd_app(args: argparse.Namespace) -> int:
    require_extra("app", "jlens app")
    cmd = streamlit_command(args)
    address = cmd[cmd.index("--server.address") + 1]
    generated = not (args.token or os.environ.get(ENV_TOKEN))
    env, token = server_env(args, address)
    if args.print_command:
        print(" ".join(cmd))
        return 0
    port = cmd[cmd.index("--server.port") + 1] if "--server.port" in cmd else str(DEFAULT_PORT)
    _announce(address, port, token, args.no_token, generated)
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
    p.add_argument("--address", default=None,
                   help="address to bind (default 127.0.0.1: this machine only). Any other address, such as "
                        "0.0.0.0, lets the network reach the app and then requires a token")
    p.add_argument("--token", default=None,
                   help=f"the access token every request must carry (default: ${ENV_TOKEN}, else one generated "
                        "and printed once when listening beyond loopback)")
    p.add_argument("--no-token", action="store_true",
                   help="serve beyond loopback without a token (anyone who reaches it can use the app)")
    p.add_argument("--workspace", default=None,
                   help=f"the folder every path typed in the app must resolve into (default ./{DEFAULT_WORKSPACE})")
    p.add_argument("--allow-any-path", action="store_true",
                   help="let the app read and write any path the server's user can (no workspace confinement)")
    p.add_argument("--max-fits", type=int, default=1, help="fits the Fit page runs at once, at most (default 1)")
    p.add_argument("--headless", action="store_true", help="do not open a browser (servers, CI)")
    p.add_argument("--model", default=None, help="model preselected in the sidebar (default: smollm2-135m)")
    p.add_argument("--lens", default=None, help="lens preselected: a file path, 'shipped' or 'none'")
    p.add_argument("--runs-dir", default=None, help="where the Fit page keeps its runs (default: the workspace)")
    p.add_argument("--print-command", action="store_true", help="print the streamlit command instead of running it")
    for name in PASSTHROUGH:
        p.add_argument(f"--{name}", dest="streamlit_options", action=_Option, metavar="VALUE",
                       help=argparse.SUPPRESS)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="further Streamlit options, after `--`")
    p.set_defaults(func=cmd_app, streamlit_options=None)
