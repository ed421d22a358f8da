"""Start the app's Streamlit server with its caches warming meanwhile (what ``jlens app`` runs).

``python app/serve.py run app/main.py [streamlit options]`` is ``streamlit run`` plus one thread in
the server process that loads what a first visit needs (:func:`warm_up.warm_up`: the model, its
shipped lens, the default prompt's readings) while Streamlit starts and the browser connects, so
the first page is drawn from the cache. ``JLENS_APP_WARM=0`` turns the warm-up off.

It also holds the server's two safety nets (``docs/security.md``):

- ``JLENS_APP_TOKEN`` set: every request must carry the token (:class:`access.TokenGate`, wrapped
  around Streamlit's ASGI app in this process, so nothing reaches Streamlit without it);
- ``JLENS_APP_PARENT_PID`` set: the server stops within 2 s once that process (``jlens app``) is
  gone, SIGKILL included: the parent-death signal on Linux, and a thread that watches the parent
  everywhere (a backstop that also covers a parent that died before the signal was armed).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent
REPO_DIR = APP_DIR.parent
log = logging.getLogger("jlens.app.serve")
ENV_TOKEN = "JLENS_APP_TOKEN"
ENV_PARENT_PID = "JLENS_APP_PARENT_PID"
PARENT_POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 1.0  # after SIGTERM, a clean Streamlit shutdown gets this long before the process exits


def install_token_gate(token: str) -> None:
    """Wrap every Starlette app Streamlit builds in :class:`access.TokenGate` (before the server starts)."""
    from streamlit.web.server.starlette import starlette_server

    import access

    build = starlette_server.create_starlette_app

    def gated(runtime):
        return access.TokenGate(build(runtime), token)

    starlette_server.create_starlette_app = gated


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # Streamlit's own handler: a clean stop
    time.sleep(STOP_GRACE_SECONDS)
    os._exit(0)  # still here: stop regardless (the parent is gone, nobody waits for a status)


def stop_with_parent(parent_pid: int) -> None:
    """Stop this process within ~1.2 s of ``parent_pid`` going away (its death reparents this process)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watcher below does it
            log.debug("prctl(PR_SET_PDEATHSIG) unavailable; watching the parent instead")

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        _stop_self()

    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        _stop_self()
    threading.Thread(target=watch, name="jlens-parent-watch", daemon=True).start()


def _warm_up() -> None:
    # Streamlit warns once per cached call made outside a script run; these calls are meant to be.
    quiet = logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from warm_up import warm_up

        done = warm_up()
        # the model, torch and transformers stay for the server's life: out of the collector's full passes
        # (each walked millions of their objects, holding the GIL the readings' threads need)
        gc.freeze()
        log.info("Warmed up: %s.", "; ".join(done))
    except Exception:  # the first visit then loads it, and shows any error in the page
        log.warning("Warm-up failed; the first visit will load the model itself.", exc_info=True)
    finally:
        quiet.setLevel(level)


def main() -> int:
    if str(APP_DIR) not in sys.path:  # the pages import `common` and its siblings from here, as `streamlit run` arranges
        sys.path.insert(0, str(APP_DIR))
    if (REPO_DIR / "jlens_core").is_dir() and str(REPO_DIR) not in sys.path:  # a checkout not installed
        sys.path.append(str(REPO_DIR))
    parent = os.environ.get(ENV_PARENT_PID)
    if parent and parent.isdigit():
        stop_with_parent(int(parent))
    token = os.environ.pop(ENV_TOKEN, "")  # out of the environment: fits and other children do not inherit it
    if token:
        install_token_gate(token)
    if os.environ.get("JLENS_APP_WARM", "1") != "0":
        from first_paint import FIRST_READINGS, MODEL_READY

        MODEL_READY.clear()  # set by the warm-up once the model is loaded
        FIRST_READINGS.clear()  # and once the first page's readings are stored
        threading.Thread(target=_warm_up, name="jlens-warm-up", daemon=True).start()
    from streamlit.web import cli

    sys.argv = ["streamlit", *sys.argv[1:]]
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
