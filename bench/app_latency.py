"""App latency in real Chromium: launch -> first heatmap, a new 64-token prompt side by side, every page's
first visit. A script, not a test: it prints a table (seconds) with this machine's fp32 matmul peak.

    python bench/app_latency.py [--json bench/app_latency.json]

Needs Debian's ``chromium`` and Python Playwright (as the browser tests). The model cache must be
warm (run the app once): the launch figure is for a warm cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
HEATMAP = '.st-key-heatmap [data-testid="stPlotlyChart"] .js-plotly-plot'  # the Inspect heatmap (its key)
PROMPT_64 = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years, "
             "presses in more than two hundred European cities had printed millions of books, and the price of a "
             "book had fallen so far that students, merchants and")
POLL_MS = 50  # how often a wait looks at the page
PAGES = ("Fit", "Tune", "Jacobians", "Evaluate", "Compare runs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_heatmap(page, condition: str) -> None:
    # Polled every POLL_MS, not on every animation frame (Playwright's default), which keeps Chromium
    # drawing 60 frames a second while it waits, on the cores the server needs.
    page.wait_for_function(f"() => {{ const g = document.querySelector('{HEATMAP}'); "
                           f"return !!(g && g.data && ({condition})); }}", polling=POLL_MS)


def _idle(page, timeout: float = 300_000) -> None:
    """Wait until Streamlit's script run has finished (its status widget gone)."""
    page.wait_for_timeout(300)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout,
                           polling=POLL_MS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=str(ROOT / "bench" / "app_latency.json"))
    p.add_argument("--chromium", default=os.environ.get("JLENS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium")
    args = p.parse_args()
    from fit_speed import matmul_peak_gflops
    from playwright.sync_api import sync_playwright

    peak = matmul_peak_gflops()
    from jlens_core.models.loading import load_model

    n_tokens = int(load_model().encode(PROMPT_64).shape[1])  # the heatmap's columns once redrawn
    port = _free_port()
    work = Path(tempfile.mkdtemp(prefix="jlens-latency-"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", JLENS_RUNS_DIR=str(work / "runs"))
    rows = []
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "jlens_core", "app", "--headless", "--port", str(port),
                               "--address", "127.0.0.1", "--server.fileWatcherType", "none"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                time.sleep(0.2)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=["--headless", "--no-sandbox",
                                                                            "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(600_000)
            page.goto(url + "/")
            _wait_heatmap(page, "g.data[0].text")
            rows.append(("launch -> first heatmap (warm cache)", time.perf_counter() - t0, 10.0))
            _idle(page)
            page.locator('[data-testid="stRadio"]').get_by_text("Side by side", exact=True).click()
            _idle(page)
            page.wait_for_timeout(1000)  # the browser finishes drawing the side-by-side view (a user types meanwhile)
            prompt = page.get_by_label("Prompt", exact=True)
            t_fill = time.perf_counter()
            prompt.fill(PROMPT_64)
            fill_seconds = time.perf_counter() - t_fill
            t1 = time.perf_counter()  # from the submit (Ctrl+Enter): typing is the user's time, not the app's
            prompt.press("Control+Enter")
            _wait_heatmap(page, f"g.data.length === 4 && g.data[0].x.length === {n_tokens}")
            rows.append(("new 64-token prompt, side by side -> redrawn", time.perf_counter() - t1, 3.0))
            print(f"(filling the prompt box took {fill_seconds:.2f} s before the submit)")
            _idle(page)
            for name in PAGES:
                t2 = time.perf_counter()
                page.get_by_test_id("stSidebarNav").get_by_text(name, exact=True).click()
                _idle(page)
                rows.append((f"first visit: {name}", time.perf_counter() - t2, 5.0))
            browser.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    print(f"fp32 matmul peak {peak:.0f} GFLOP/s")
    print(f"{'step':48s} {'seconds':>8} {'goal':>6}")
    for name, seconds, goal in rows:
        print(f"{name:48s} {seconds:8.2f} {goal:6.1f}{'  over' if seconds > goal else ''}")
    Path(args.json).write_text(json.dumps({"matmul_peak_gflops": peak, "rows": [
        {"step": n, "seconds": s, "goal_seconds": g} for n, s, g in rows]}, indent=1))


if __name__ == "__main__":
    main()
