"""Start the app's Streamlit server with its caches warming meanwhile (what ``jlens app`` runs).

``python app/serve.py run app/main.py [streamlit options]`` is ``streamlit run`` plus one thread in
the server process that loads what a first visit needs (:func:`common.warm_up`: the model, its
shipped lens, the default prompt's readings) while Streamlit starts and the browser connects, so
the first page is drawn from the cache. ``JLENS_APP_WARM=0`` turns the warm-up off.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent
REPO_DIR = APP_DIR.parent
log = logging.getLogger("jlens.app.serve")


def _warm_up() -> None:
    # Streamlit warns once per cached call made outside a script run; these calls are meant to be.
    quiet = logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import common

        done = common.warm_up()
        log.info("Warmed up: %s.", "; ".join(done))
    except Exception:  # the first visit then loads it, and shows any error in the page
        log.warning("Warm-up failed; the first visit will load the model itself.", exc_info=True)
    finally:
        quiet.setLevel(level)


def main() -> int:
    if str(APP_DIR) not in sys.path:  # the pages import `common` from here, as `streamlit run` arranges
        sys.path.insert(0, str(APP_DIR))
    if (REPO_DIR / "jlens_core").is_dir() and str(REPO_DIR) not in sys.path:  # a checkout not installed
        sys.path.append(str(REPO_DIR))
    if os.environ.get("JLENS_APP_WARM", "1") != "0":
        threading.Thread(target=_warm_up, name="jlens-warm-up", daemon=True).start()
    from streamlit.web import cli

    sys.argv = ["streamlit", *sys.argv[1:]]
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
