"""The app is safe on a shared network (docs/security.md): path confinement, the token gate, `jlens app`'s
defaults, and no server left behind. Server tests start a real `jlens app` and talk to it on loopback only."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import stop

from jlens_core.workspace import OutsideWorkspaceError, Workspace, looks_like_path, sanitise_filename

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "app"))


# -- confinement (library) -----------------------------------------------------------------------------
def test_confine_accepts_paths_inside_and_resolves_relative_ones_against_the_workspace(tmp_path):
    ws = Workspace(root=tmp_path / "ws")
    (tmp_path / "ws" / "sub").mkdir(parents=True)
    assert ws.confine("sub/lens.safetensors") == (tmp_path / "ws" / "sub" / "lens.safetensors").resolve()
    assert ws.confine(str(tmp_path / "ws" / "a" / ".." / "b.txt")) == (tmp_path / "ws" / "b.txt").resolve()
    assert ws.confine(tmp_path / "ws") == (tmp_path / "ws").resolve()


@pytest.mark.parametrize("typed", ["/etc/passwd", "../outside.txt", "sub/../../outside.txt", "~/x.safetensors"])
def test_confine_refuses_paths_outside_with_one_sentence(tmp_path, typed):
    ws = Workspace(root=tmp_path / "ws")
    with pytest.raises(OutsideWorkspaceError, match=r"^The checkpoint .* outside the workspace .*--allow-any-path"):
        ws.confine(typed, "checkpoint")
    assert not (tmp_path / "outside.txt").exists()


def test_confine_follows_symbolic_links_out_of_the_workspace(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "ws" / "door").symlink_to(tmp_path / "secret", target_is_directory=True)
    ws = Workspace(root=tmp_path / "ws")
    with pytest.raises(OutsideWorkspaceError):
        ws.confine("door/key.txt")
    # a prefix is not a parent: /x/ws-evil is not inside /x/ws
    with pytest.raises(OutsideWorkspaceError):
        ws.confine(str(tmp_path / "ws-evil" / "f.txt"))


def test_extra_roots_operator_paths_and_allow_any(tmp_path):
    assets, named = tmp_path / "assets", tmp_path / "elsewhere" / "model.gguf"
    ws = Workspace(root=tmp_path / "ws", extra_roots=(assets,), extra_paths=(named,))
    assert ws.confine(str(assets / "lenses" / "x.safetensors")).parent.name == "lenses"
    assert ws.confine(str(named)) == named.resolve()
    with pytest.raises(OutsideWorkspaceError):
        ws.confine(str(named.parent / "other.gguf"))  # the named file, not its folder
    assert Workspace(root=tmp_path / "ws", allow_any=True).confine("/etc/passwd") == Path("/etc/passwd").resolve()


def test_specs_that_are_not_paths_pass_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ws = Workspace(root=tmp_path / "ws")
    for spec in ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", "hf://owner/repo/lens.safetensors", "wikitext"):
        assert not looks_like_path(spec)
        assert ws.confine_spec(spec, "model folder") == spec
    for spec in ("/abs/model", "~/m", "./m", "../m", "corpus.txt", "model.gguf"):
        assert looks_like_path(spec)
    (tmp_path / "owner" / "repo").mkdir(parents=True)  # exists on disk: the loaders would read it as a path
    assert looks_like_path("owner/repo")
    # ...taken against the workspace: the folder outside it is never the one loaded
    assert ws.confine_spec("owner/repo", "model folder") == str((tmp_path / "ws" / "owner" / "repo").resolve())
    with pytest.raises(OutsideWorkspaceError):
        ws.confine_spec("/etc/passwd", "corpus path")


def test_workspace_from_env(tmp_path):
    env = {"JLENS_APP_WORKSPACE": str(tmp_path), "JLENS_APP_ALLOW_ANY_PATH": "1",
           "JLENS_APP_ALLOWED_PATHS": os.pathsep.join(["/a/b.gguf", "/c"])}
    ws = Workspace.from_env(env)
    assert ws.root == tmp_path.resolve() and ws.allow_any and ws.extra_paths == (Path("/a/b.gguf"), Path("/c"))
    assert not Workspace.from_env({}).allow_any and Workspace.from_env({}).root == (Path.cwd() / "runs").resolve()


@pytest.mark.parametrize(("name", "safe"), [("../../etc/passwd", "passwd"), ("my corpus (1).txt", "my-corpus-1-.txt"),
                                            ("..", "file"), (".bashrc", "bashrc"), ("C:\\x\\y.jsonl", "y.jsonl")])
def test_sanitise_filename(name, safe):
    assert sanitise_filename(name) == safe


# -- the token gate (ASGI, in process) ---------------------------------------------------------------------
def _call(gate, path: str, query: bytes = b"", cookie: str | None = None, kind: str = "http") -> list[dict]:
    sent: list[dict] = []
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        if kind == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"page"})

    async def receive():
        return {"type": "websocket.connect"} if kind == "websocket" else {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    gate.app = app
    headers = [(b"cookie", cookie.encode())] if cookie else []
    asyncio.run(gate({"type": kind, "path": path, "query_string": query, "headers": headers}, receive, send))
    return sent + [{"type": "reached", "paths": reached}]


def test_token_gate_refuses_without_the_token_and_sets_a_cookie_with_it():
    from access import COOKIE_NAME, TokenGate, cookie_value

    gate = TokenGate(None, "s3cret")
    denied = _call(gate, "/")
    assert denied[0]["status"] == 403 and denied[-1]["paths"] == []
    assert _call(gate, "/", b"token=wrong")[0]["status"] == 403
    assert _call(gate, "/_stcore/health", cookie=f"{COOKIE_NAME}=s3cret")[0]["status"] == 403  # the cookie is an HMAC
    ws = _call(gate, "/_stcore/stream", kind="websocket")
    assert ws[0] == {"type": "websocket.close", "code": 1008} and ws[-1]["paths"] == []
    passed = _call(gate, "/", b"token=s3cret&x=1")
    assert passed[0]["status"] == 200 and passed[-1]["paths"] == ["/"]
    set_cookie = dict(passed[0]["headers"])[b"set-cookie"].decode()
    assert set_cookie.startswith(f"{COOKIE_NAME}={cookie_value('s3cret')};") and "s3cret" not in set_cookie
    assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
    with_cookie = _call(gate, "/_stcore/stream", cookie=f"{COOKIE_NAME}={cookie_value('s3cret')}", kind="websocket")
    assert with_cookie[-1]["paths"] == ["/_stcore/stream"]


# -- jlens app's defaults ----------------------------------------------------------------------------------
def test_jlens_app_binds_loopback_and_sets_the_upload_limit_by_default(capsys):
    from jlens_core.cli.main import main

    assert main(["app", "--print-command"]) == 0
    out = capsys.readouterr().out
    assert "--server.address 127.0.0.1" in out and "--server.maxUploadSize 512" in out


@pytest.mark.parametrize("extra", [["--server.address", "0.0.0.0"], ["--server.address=0.0.0.0"],
                                   ["--theme.base", "dark", "--server.port", "80"], ["--server.enableCORS", "false"],
                                   ["--server.enableXsrfProtection=false"], ["--server.maxUploadSize", "99999"],
                                   ["--browser.serverAddress", "example.org"]])
def test_jlens_app_refuses_exposure_options_after_the_double_dash(extra, capsys):
    """Options after ``--`` reach Streamlit last (its value wins): those that expose the server are refused."""
    from jlens_core.cli.main import main

    assert main(["app", "--print-command", "--", *extra]) == 2
    captured = capsys.readouterr()
    name = next(x for x in extra if x.startswith(("--server.", "--browser."))).split("=")[0]
    assert captured.out == "" and f"{name} after `--` would bypass" in captured.err
    assert main(["app", "--print-command", "--", "--theme.base", "dark"]) == 0  # any other option passes
    assert capsys.readouterr().out.rstrip().endswith("--server.address 127.0.0.1 --server.maxUploadSize 512 "
                                                     "--browser.gatherUsageStats false --runner.postScriptGC false "
                                                     "--theme.base dark")
    # Streamlit's full collection after every script run is off by default (docs/app.md); the option turns it on
    assert main(["app", "--print-command", "--runner.postScriptGC", "true"]) == 0
    out = capsys.readouterr().out
    assert "--runner.postScriptGC true" in out and "--runner.postScriptGC false" not in out


def test_server_env_token_rules(tmp_path, monkeypatch):
    import argparse

    from jlens_core.cli.app import is_loopback, server_env

    monkeypatch.delenv("JLENS_APP_TOKEN", raising=False)
    base = {"model": None, "lens": None, "runs_dir": None, "workspace": str(tmp_path), "allow_any_path": False,
            "max_fits": 1, "token": None, "no_token": False}
    env, token = server_env(argparse.Namespace(**base), "127.0.0.1")
    assert token is None and "JLENS_APP_TOKEN" not in env and env["JLENS_APP_WORKSPACE"] == str(tmp_path.resolve())
    env, token = server_env(argparse.Namespace(**base), "0.0.0.0")
    assert token and len(token) >= 24 and env["JLENS_APP_TOKEN"] == token
    env, token = server_env(argparse.Namespace(**{**base, "no_token": True}), "0.0.0.0")
    assert token is None and "JLENS_APP_TOKEN" not in env
    assert server_env(argparse.Namespace(**{**base, "token": "mine"}), "0.0.0.0")[1] == "mine"
    assert [is_loopback(a) for a in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "192.168.1.4", "::")] == \
        [True, True, True, False, False, False]


# -- a real `jlens app` ------------------------------------------------------------------------------------
def _start_app(tmp_path, *args: str) -> tuple[subprocess.Popen, int]:
    from conftest import free_port

    port = free_port()
    env = dict(os.environ, JLENS_APP_WARM="0", HF_HUB_OFFLINE="1")
    env.pop("JLENS_APP_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "jlens_core", "app", "--headless", "--port", str(port),
                             "--workspace", str(tmp_path / "ws"), "--server.fileWatcherType", "none", *args],
                            cwd=str(tmp_path), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, port


def _listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> list[str]:
    """The addresses a TCP socket listens on at ``port`` (from the socket table; no traffic)."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = [c.laddr.ip for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
                 and c.status == psutil.CONN_LISTEN]
        if found:
            return found
        time.sleep(0.3)
    return []


def _status(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow
def test_jlens_app_listens_on_loopback_only_by_default(tmp_path):
    proc, port = _start_app(tmp_path)
    try:
        assert _listening(port, proc) == ["127.0.0.1"]
    finally:
        stop(proc)


@pytest.mark.slow
def test_exposed_app_needs_its_token_for_every_request_local_ones_included(tmp_path):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    proc, port = _start_app(tmp_path, "--address", "0.0.0.0")
    try:
        assert _listening(port, proc)
        base = f"http://127.0.0.1:{port}"
        assert _status(f"{base}/") == 403
        assert _status(f"{base}/_stcore/health") == 403
        assert _status(f"{base}/_stcore/host-config") == 403
        with pytest.raises(InvalidStatus) as refused:
            connect(f"ws://127.0.0.1:{port}/_stcore/stream", open_timeout=10)
        assert refused.value.response.status_code == 403
        # the token, printed once on stderr as a URL
        deadline, line = time.time() + 30, ""
        while "?token=" not in line and time.time() < deadline:
            line = proc.stderr.readline()
        token = line.strip().rsplit("?token=", 1)[1]
        with urllib.request.urlopen(f"{base}/?token={token}", timeout=5) as response:
            assert response.status == 200 and b"<html" in response.read().lower()
            cookie = response.headers["set-cookie"].split(";", 1)[0]
        assert _status(f"{base}/_stcore/health", {"Cookie": cookie}) == 200
        with connect(f"ws://127.0.0.1:{port}/_stcore/stream", open_timeout=10,
                     additional_headers={"Cookie": cookie}) as ws:
            assert ws.protocol.state.name == "OPEN"
    finally:
        stop(proc)


@pytest.mark.slow
def test_sigkill_of_jlens_app_leaves_no_server(tmp_path):
    import psutil

    proc, port = _start_app(tmp_path)
    try:
        assert _listening(port, proc)
        server = psutil.Process(proc.pid).children()
        assert server, "jlens app runs the server as its child"
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        killed_at = time.time()
        _, alive = psutil.wait_procs(server, timeout=2)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], f"server left after {time.time() - killed_at:.1f} s"
        assert not _listening(port, proc, timeout=0.5)
    finally:
        for child in psutil.Process().children(recursive=True):
            try:  # other tests' children may be gone or zombies by now
                if child.pid != proc.pid and "serve.py" in " ".join(child.cmdline()):
                    child.kill()
            except psutil.Error:
                pass


@pytest.mark.slow
def test_fits_started_from_the_app_are_kept_when_the_server_goes(tmp_path):
    """Decided (docs/security.md): a fit runs in its own session, so neither the server's death nor a signal to the
    server's process group reaches it; its status file and checkpoint let the next app list and resume it."""
    import psutil

    from jlens_core.fitting import runs

    folder = tmp_path / "run"
    folder.mkdir()
    pid = runs._launch(folder, ["--model", "no-such-model-anywhere", "--corpus", "x.txt", "--out", "lens.safetensors"])
    try:
        assert os.getsid(pid) == pid != os.getsid(0)  # its own session and process group
        assert os.getpgid(pid) != os.getpgid(0)
    finally:
        psutil.Process(pid).kill()
        runs._PROCESSES.pop(pid).wait(10)
