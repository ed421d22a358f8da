"""App latency in real Chromium: launch -> first heatmap and -> live page (twice: without and with the last launch's
kept first heatmap, ``app/launch_snapshot.py``), a page opened -> its heatmap, a new prompt -> its plain heatmap,
then -> its stability marks and -> its J-space labels (the extras drawn after the first paint), a new ~64-token
prompt side by side -> redrawn and -> its marks, every page's first visit. A script, not a test: it prints a table
(seconds; medians over ``--reps`` repetitions, each with a prompt of its own) with this machine's fp32 matmul peak
and CPU flags. The browser is started before the app, as a user's runs already.

    python bench/app_latency.py [--reps 3] [--json bench/app_latency.json]

Needs Debian's ``chromium`` and Python Playwright (as the browser tests). The model cache must be
warm (run the app once, which also keeps the first heatmap): the launch figures are for a warm cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

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


EXTRA_WORDS = ("scholars", "priests", "printers", "farmers", "sailors", "doctors", "lawyers", "artists")  # a prompt a rep
GOALS = {"launch": 6.0, "open": 6.0, "new": 1.5, "side": 3.0, "visit": 5.0}  # issue 52's app goals, seconds


def _prompt(rep: int) -> str:
    """Rep ``rep``'s prompt: PROMPT_64 and ``rep + 1`` more words (each rep one token longer or more, so a wait on
    the heatmap's column count sees this rep's prompt, and no reading is cached from an earlier rep)."""
    return PROMPT_64 + " " + " ".join(EXTRA_WORDS[:rep + 1])


def _submit(page, text: str) -> float:
    """Type ``text`` in the prompt box and submit it (Ctrl+Enter); returns the submit's time (typing is the user's)."""
    prompt = page.get_by_label("Prompt", exact=True)
    prompt.fill(text)
    t = time.perf_counter()
    prompt.press("Control+Enter")
    return t


def _extras(browser, page, model, url: str, reps: int, band: str = "") -> dict[str, list[float]]:
    """Per rep, on the Jacobian lens with J-space labels on: a new prompt submitted -> its plain heatmap, its
    stability marks, its first layer's and every layer's J-space labels (seconds from the submit); and a page opened
    on it again -> its heatmap. ``band``: ``&band=lo-hi`` (the layers shown), or "" for every layer."""
    times: dict[str, list[float]] = {"new": [], "marks": [], "first_labels": [], "labels": [], "open": []}
    page.goto(url + f"/?mode=jacobian&cells=jspace{band}")
    _wait_heatmap(page, "g.data[0].text")
    _idle(page)
    for rep in range(reps):
        text = _prompt(rep)
        n = int(model.encode(text).shape[1])
        t = _submit(page, text)
        _wait_heatmap(page, f"g.data[0].x.length === {n}")
        times["new"].append(time.perf_counter() - t)
        _wait_heatmap(page, f"g.data[0].x.length === {n} && g.data.some(d => d.name === 'stable %')")
        times["marks"].append(time.perf_counter() - t)
        _wait_heatmap(page, f"g.data[0].x.length === {n} && (g.layout.title.text || '').includes('largest atom')")
        times["first_labels"].append(time.perf_counter() - t)
        _wait_heatmap(page, f"g.data[0].x.length === {n} && (g.layout.title.text || '').includes('largest atom') "
                            "&& !g.layout.title.text.includes('so far')")
        times["labels"].append(time.perf_counter() - t)
        _idle(page)
        other = browser.new_page(viewport={"width": 1400, "height": 1000})  # the same prompt anew: readings cached
        t = time.perf_counter()
        other.goto(url + f"/?mode=jacobian{band}&prompt={quote(text)}")
        _wait_heatmap(other, f"g.data[0].text && g.data[0].x.length === {n}")
        times["open"].append(time.perf_counter() - t)
        other.close()
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    return times


def _launch(browser, work: Path, kept: bool):
    """Start ``jlens app`` and open its page once it answers: (seconds to the first heatmap, to the live page (the
    prompt box usable), the URL, the server process, the page). ``kept``: with the last launch's kept first heatmap
    (``JLENS_APP_SNAPSHOT=1``, off by default), else without (``=0``)."""
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", JLENS_RUNS_DIR=str(work / "runs"), JLENS_APP_SNAPSHOT="1" if kept else "0")
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "jlens_core", "app", "--headless", "--port", str(port),
                               "--address", "127.0.0.1", "--server.fileWatcherType", "none"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    break
        except OSError:
            time.sleep(0.1)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(600_000)
    page.goto(url + "/")
    _wait_heatmap(page, "g.data[0].text")
    first = time.perf_counter() - t0
    page.get_by_label("Prompt", exact=True).wait_for(state="visible")
    page.wait_for_function("() => { const t = document.querySelector('textarea[aria-label=\"Prompt\"]'); "
                           "return !!(t && !t.disabled); }", polling=POLL_MS)
    live = time.perf_counter() - t0
    return first, live, url, server, page


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=str(ROOT / "bench" / "app_latency.json"))
    p.add_argument("--reps", type=int, default=3, help="repetitions (a prompt each) of the new-prompt figures and the "
                   "side-by-side redraw")
    p.add_argument("--launches", type=int, default=3, help="launches of each kind (without and with the kept first "
                   "heatmap, alternating)")
    p.add_argument("--band", default="", help="lo-hi: the layers the new-prompt figures show (default: all); the "
                   "J-space labels' time grows with them")
    p.add_argument("--chromium", default=os.environ.get("JLENS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium")
    args = p.parse_args()
    from bf16_fit import cpu_flags
    from fit_speed import matmul_peak_gflops
    from playwright.sync_api import sync_playwright

    peak = matmul_peak_gflops()
    from jlens_core.models.loading import load_model

    model = load_model()  # for the prompts' token counts (the heatmap's columns once redrawn)
    n_tokens = int(model.encode(PROMPT_64).shape[1])
    work = Path(tempfile.mkdtemp(prefix="jlens-latency-"))
    rows: list[tuple[str, list[float], float | None]] = []  # no goal: None  # (step, seconds of each rep, goal)
    servers: list[subprocess.Popen] = []
    try:
        with sync_playwright() as pw:
            # The browser runs before the app starts, as a user's does: its own start (about 1 s here) is not the
            # app's launch. Two launches: without the last launch's kept first heatmap (a first launch, or
            # the default), then with it (JLENS_APP_SNAPSHOT=1, app/launch_snapshot.py; the launch before kept it).
            browser = pw.chromium.launch(executable_path=args.chromium, args=["--headless", "--no-sandbox",
                                                                            "--disable-gpu"])
            launches: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
            for i in range(args.launches):
                for kept in (False, True):
                    first, live, url, server, page = _launch(browser, work, kept)
                    servers.append(server)
                    launches[kept][0].append(first)
                    launches[kept][1].append(live)
                    print(f"launch {i}, kept reading {kept}: first heatmap {first:.2f} s, live page {live:.2f} s",
                          flush=True)
                    if not (kept and i == args.launches - 1):  # the last server serves the steps below
                        page.close()
                        server.send_signal(signal.SIGTERM)
                        server.wait(30)
            for kept, (firsts, lives) in launches.items():
                what = "the last launch's kept reading" if kept else "no kept reading"
                rows.append((f"launch -> first heatmap ({what})", firsts, GOALS["launch"]))
                rows.append((f"launch -> live page ({what})", lives, None))
            _idle(page)
            extras = _extras(browser, page, model, url, args.reps, f"&band={args.band}" if args.band else "")
            rows += [("page opened -> its heatmap (readings cached)", extras["open"], GOALS["open"]),
                     ("new prompt, Jacobian lens -> plain heatmap", extras["new"], GOALS["new"]),
                     ("new prompt -> stability marks drawn", extras["marks"], None),
                     ("new prompt -> J-space labels, first layer", extras["first_labels"], None),
                     ("new prompt -> J-space labels, every layer", extras["labels"], None)]
            page.goto(url + "/")
            _wait_heatmap(page, "g.data[0].text")
            _idle(page)
            page.locator('[data-testid="stRadio"]').get_by_text("Side by side", exact=True).click()
            _idle(page)
            page.wait_for_timeout(1000)  # the browser finishes drawing the side-by-side view (a user types meanwhile)
            sides: list[float] = []
            side_marks: list[float] = []
            for rep in range(args.reps):
                text = _prompt(rep).replace("printing press", "printing presses")  # not read by the steps above
                n = int(model.encode(text).shape[1])
                t1 = _submit(page, text)
                _wait_heatmap(page, f"g.data.length >= 4 && g.data[0].x.length === {n}")
                sides.append(time.perf_counter() - t1)
                _wait_heatmap(page, f"g.data[0].x.length === {n} && g.data.some(d => d.name === 'stable %')")
                side_marks.append(time.perf_counter() - t1)
                _idle(page)
                page.wait_for_timeout(1000)
            rows.append((f"new ~{n_tokens}-token prompt, side by side -> redrawn", sides, GOALS["side"]))
            rows.append(("new prompt, side by side -> stability marks drawn", side_marks, None))
            for name in PAGES:
                t2 = time.perf_counter()
                page.get_by_test_id("stSidebarNav").get_by_text(name, exact=True).click()
                _idle(page)
                rows.append((f"first visit: {name}", [time.perf_counter() - t2], GOALS["visit"]))
            browser.close()
    finally:
        for server in servers:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                server.wait(30)
    cpu = cpu_flags()
    print(f"fp32 matmul peak {peak:.0f} GFLOP/s; CPU {cpu['model_name']}, flags {' '.join(cpu['flags']) or 'none'}")
    print(f"{'step':48s} {'median s':>8} {'range':>13} {'goal':>6}")
    for name, seconds, goal in rows:
        spread = f"{min(seconds):.2f}-{max(seconds):.2f}" if len(seconds) > 1 else ""
        median = statistics.median(seconds)
        said = "" if goal is None else f"{goal:6.1f}" + ("  over" if median > goal else "")
        print(f"{name:48s} {median:8.2f} {spread:>13} {said}")
    Path(args.json).write_text(json.dumps({"matmul_peak_gflops": peak, "cpu": cpu, "reps": args.reps,
                                           "launches": args.launches,
                                           "band": args.band or "all", "rows": [
        {"step": n, "seconds": statistics.median(s), "each": s, "goal_seconds": g}
        for n, s, g in rows]}, indent=1))


if __name__ == "__main__":
    main()
