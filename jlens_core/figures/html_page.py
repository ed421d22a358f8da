"""A reading as one self-contained HTML file that works offline: the heatmap, its hover, a click's cell detail.

The page holds everything it draws, nothing is fetched:

* Plotly's JavaScript bundle (4.8 MB as written), gzip-compressed and base64-encoded (about 2 MB), unpacked
  by the browser's own ``DecompressionStream`` when the page opens: one bundle for every figure of the page.
  Written raw, the bundle alone would leave almost nothing of a 5 MB budget.
* The heatmap figure, exactly as :func:`~jlens_core.figures.heatmaps.heatmap_figure` draws it for the app
  (hover: the cell, the statistic, the top-k tokens with probabilities).
* The cells' detail, compactly: one table of the token strings the page names, each cell's top-k as
  indices into it (``uint16``/``uint32``) with ``float16`` probabilities, the statistics rounded to 4
  significant digits, and the pinned tokens' ranks. A click on a cell fills the detail panel from it:
  every lens's top-k at that cell, its statistics, and the pinned tokens' rank across layers there.

Figure and detail travel in one gzip+base64 JSON payload. The header names the model, the lenses and the
settings. A browser without ``DecompressionStream`` (before Chrome 80, Firefox 113, Safari 16.4) shows a
sentence saying so.
"""

from __future__ import annotations

import base64
import datetime as _dt
import gzip
import html
import json
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .._atomic import atomic_write_text
from .._version import __version__
from .heatmaps import heatmap_figure
from .labels import LENS_NAMES, STAT_LABELS, row_labels, shown, token_names

DETAIL_STATS = ("entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank")


@lru_cache(maxsize=1)
def packed_plotly_js() -> str:
    """Plotly's JavaScript bundle, gzip-compressed and base64-encoded (computed once per process)."""
    from plotly.offline import get_plotlyjs

    return base64.b64encode(gzip.compress(get_plotlyjs().encode("utf-8"), compresslevel=9, mtime=0)).decode("ascii")


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _rounded(values: np.ndarray) -> list[float | None]:
    """Values to 4 significant digits (None for NaN), as JSON numbers."""
    return [None if not np.isfinite(v) else float(f"{v:.4g}") for v in np.asarray(values, dtype=np.float64).ravel()]


def _halves(reading: Any) -> dict[str, Any] | None:
    """A reading's stability marks for the click detail (docs/method.md §6.2): the shown token's rank under each
    half and the stable flag, ``[layer, position]`` row-major; None without marks."""
    marks = getattr(reading, "stability", None)
    if marks is None:
        return None
    return {"k": int(marks.stability_k), "even": np.asarray(marks.half_rank_even, dtype=np.int64).ravel().tolist(),
            "odd": np.asarray(marks.half_rank_odd, dtype=np.int64).ravel().tolist(),
            "stable": [int(x) for x in np.asarray(marks.stable).ravel()]}


def detail_data(readings: Mapping[str, Any]) -> dict[str, Any]:
    """The compact data the page's click handler reads: a token table, and per lens its cells' top-k
    (indices into the table, little-endian ``uint16``/``uint32``), their ``float16`` probabilities, the
    statistics, the pinned tokens' ranks and the stability marks (``halves``, when the reading has them), all
    ``[layer, position]`` row-major."""
    base = next(iter(readings.values()))
    table: dict[int, int] = {}
    for reading in readings.values():
        for token_id in np.unique(reading.top_ids).tolist():
            table.setdefault(int(token_id), len(table))
    ids = np.fromiter(table, dtype=np.int64, count=len(table))
    strings = [shown(s) for s in token_names(base, ids.tolist())]
    index_type = np.dtype("<u2") if len(table) < 2**16 else np.dtype("<u4")
    lookup = np.zeros(int(ids.max()) + 1 if len(ids) else 1, dtype=np.int64)
    lookup[ids] = np.arange(len(ids))
    lenses = {}
    for name, reading in readings.items():
        k = int(reading.top_ids.shape[-1])
        lenses[name] = {
            "label": LENS_NAMES.get(name, name), "layers": list(map(int, reading.layers)), "k": k,
            "skip_first": int(getattr(reading, "skip_first", 0) or 0),
            "top": _b64(lookup[reading.top_ids].astype(index_type)),
            "probs": _b64(np.asarray(reading.top_probs, dtype=np.float16).astype("<f2")),
            "stats": {stat: _rounded(getattr(reading, stat)) for stat in DETAIL_STATS},
            "pinned": {token: np.asarray(ranks, dtype=np.int64).ravel().tolist()
                       for token, ranks in reading.pinned_ranks.items()},
            "halves": _halves(reading),
        }
    return {"tokens": strings, "index_bytes": index_type.itemsize,
            "positions": base.positions.tolist(), "position_tokens": [shown(t) for t in base.position_tokens],
            "next_tokens": [shown(t) if t else "" for t in base.next_tokens], "output_layer": int(base.output_layer),
            "row_labels": dict(zip(map(str, range(base.output_layer + 1)),
                                   row_labels(range(base.output_layer + 1), base.output_layer))),
            "lenses": lenses}


def page_settings(readings: Mapping[str, Any], mode: str, stat: str, extra: Mapping[str, Any] | None) -> dict[str, str]:
    """The header's ``name: value`` lines: model, lenses, statistic, mode and the reading's settings."""
    base = next(iter(readings.values()))
    out = {"model": str(base.model_name),
           "lenses": ", ".join(f"{LENS_NAMES.get(n, n)} ({r.n_layers} rows, skip_first {int(r.skip_first or 0)})"
                               for n, r in readings.items()),
           "colour": STAT_LABELS.get(stat, stat), "view": {"side": "side by side", "diff": "difference",
                                                           "three": "stacked"}.get(mode, "one lens"),
           "tokens": f"{len(base.input_ids)} ({base.n_prompt} prompt, {base.n_generated} generated); "
                     f"{base.n_positions} read",
           "top-k": str(base.top_k), "readout": str(getattr(base, "vocab", "all")),
           "pinned": ", ".join(repr(t) for t in base.pinned) or "none"}
    if getattr(base, "edits", None):
        out["edits"] = "; ".join(base.edits)
    out.update({str(k): str(v) for k, v in (extra or {}).items()})
    out["written"] = f"jlens {__version__}, {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}"
    return out


def reading_page(readings: Mapping[str, Any], *, mode: str | None = None, stat: str = "top1_prob",
                 pair: tuple[str, str] | None = None, hover_k: int = 10, title: str | None = None,
                 settings: Mapping[str, Any] | None = None) -> str:
    """The page's HTML (see the module docstring).

    Args:
        readings: ``{lens name: PromptReading}`` of one prompt (one or more lenses).
        mode: one lens (a key), ``"side"``, ``"diff"`` or ``"three"`` (default: the one lens, side by side
            for two, stacked for more).
        stat: the heatmap's colour.
        pair: the two lenses of ``"side"`` / ``"diff"`` (default: the first two).
        hover_k: tokens in a cell's hover.
        title: the page title (default: the prompt's start).
        settings: more header lines (``{"lens files": ...}``).

    Raises:
        ValueError: no readings, or readings of different prompts.
    """
    if not readings:
        raise ValueError("No readings to write: give at least one.")
    names = list(readings)
    base = readings[names[0]]
    for name, reading in readings.items():
        if not np.array_equal(reading.input_ids, base.input_ids) or not np.array_equal(reading.positions,
                                                                                       base.positions):
            raise ValueError(f"The readings are of different prompts or positions ({names[0]!r} and {name!r}): "
                             "one page shows one prompt.")
    if mode is None:
        mode = names[0] if len(names) == 1 else "side" if len(names) == 2 else "three"
    pair = pair or ((names[0], names[1]) if len(names) > 1 else (names[0], names[0]))
    layers = list(readings.get("logit", base).layers)
    fig = heatmap_figure(readings, mode, stat, layers=layers, pair=pair, hover_k=hover_k)
    fig.update_layout(title=None, margin={"l": 10, "r": 10, "t": 30, "b": 10})
    payload = ('{"figure":' + fig.to_json() + ',"detail":' + json.dumps(detail_data(readings), separators=(",", ":"))
               + ',"layers":' + json.dumps(layers) + "}")
    packed = base64.b64encode(gzip.compress(payload.encode("utf-8"), compresslevel=9, mtime=0)).decode("ascii")
    header = page_settings(readings, mode, stat, settings)
    title = title or f"jlens · {base.text[:60]}"
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in header.items())
    return PAGE.format(title=html.escape(title), header=rows, prompt=html.escape(base.text),
                       plotly=packed_plotly_js(), payload=packed, script=SCRIPT)


def write_reading_page(readings: Mapping[str, Any], path: str | os.PathLike, **options: Any) -> Path:
    """Write :func:`reading_page` to ``path`` (UTF-8, atomically: a reader never sees half a page).

    Returns:
        The path written.
    """
    path = Path(path)
    atomic_write_text(path, reading_page(readings, **options), shared=True)
    return path


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; margin: 1em 2em; color: #222; }}
table.settings th {{ text-align: left; padding-right: 1em; font-weight: 600; color: #555; }}
table.settings td, table.settings th {{ font-size: 13px; padding: 1px 0; }}
#prompt {{ white-space: pre-wrap; background: #f6f6f6; padding: .5em; border-radius: 4px; font-size: 14px; }}
#detail {{ border-top: 1px solid #ddd; margin-top: .5em; padding-top: .5em; font-size: 14px; }}
#detail .lenses {{ display: flex; gap: 2em; flex-wrap: wrap; }}
#detail table {{ border-collapse: collapse; font-family: monospace; }}
#detail td {{ padding: 0 .6em 0 0; }}
#status {{ color: #a33; }}
</style></head><body>
<h2>jlens reading</h2>
<table class="settings">{header}</table>
<p id="prompt">{prompt}</p>
<p id="status">Unpacking the page…</p>
<div id="heatmap"></div>
<div id="detail"><i>Click a cell for its detail: every lens's top-k there and the pinned tokens' ranks.</i></div>
<div id="ranks"></div>
<script id="plotly-packed" type="application/octet-stream">{plotly}</script>
<script id="reading-packed" type="application/octet-stream">{payload}</script>
<script>{script}</script>
</body></html>
"""

SCRIPT = r"""
"use strict";
async function unpack(id) {
  const text = document.getElementById(id).textContent.trim();
  const bytes = Uint8Array.from(atob(text), c => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return await new Response(stream).text();
}
function bytesOf(b64) { return Uint8Array.from(atob(b64), c => c.charCodeAt(0)).buffer; }
function half(bits) {  // IEEE 754 half precision to a number
  const s = bits & 0x8000 ? -1 : 1, e = (bits >> 10) & 0x1f, f = bits & 0x3ff;
  if (e === 0) return s * Math.pow(2, -14) * (f / 1024);
  if (e === 31) return f ? NaN : s * Infinity;
  return s * Math.pow(2, e - 15) * (1 + f / 1024);
}
function esc(s) {
  return String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
}
function fmt(stat, v) {
  if (v === null || v === undefined) return "–";
  return stat.endsWith("rank") ? Math.round(v).toLocaleString("en") : v.toFixed(2);
}
let D = null;
function lensArrays(lens) {
  if (!lens._top) {
    const raw = bytesOf(lens.top);
    lens._top = D.index_bytes === 2 ? new Uint16Array(raw) : new Uint32Array(raw);
    lens._probs = new Uint16Array(bytesOf(lens.probs));
  }
  return lens;
}
function showCell(layer, position) {
  const col = D.positions.indexOf(position);
  if (col < 0) return;
  const n = D.positions.length;
  let html = `<b>${esc(D.row_labels[layer] || ("L" + layer))}</b> · position ${position} ` +
    `<b>${esc(D.position_tokens[col])}</b>` + (D.next_tokens[col] ? ` → next <b>${esc(D.next_tokens[col])}</b>` : "") +
    `<div class="lenses">`;
  for (const name of Object.keys(D.lenses)) {
    const lens = lensArrays(D.lenses[name]);
    const row = lens.layers.indexOf(layer);
    html += `<div><b>${esc(lens.label)}</b>`;
    if (row < 0) { html += `<br><i>layer ${layer} not fitted in this lens</i></div>`; continue; }
    const cell = row * n + col;
    if (position < lens.skip_first && layer !== D.output_layer)
      html += `<br><i>not fitted: position &lt; skip_first=${lens.skip_first}</i>`;
    html += "<table>";
    for (let j = 0; j < lens.k; j++) {
      const i = cell * lens.k + j;
      html += `<tr><td>${j + 1}.</td><td>${esc(D.tokens[lens._top[i]])}</td>` +
              `<td>${(100 * half(lens._probs[i])).toFixed(1)}%</td></tr>`;
    }
    html += "</table>";
    for (const [stat, values] of Object.entries(lens.stats)) html += `${stat}: ${fmt(stat, values[cell])}<br>`;
    for (const [token, ranks] of Object.entries(lens.pinned)) html += `rank of ${esc(JSON.stringify(token))}: ${ranks[cell]}<br>`;
    if (lens.halves) html += `halves: rank ${lens.halves.even[cell]} / rank ${lens.halves.odd[cell]} · ` +
      (lens.halves.stable[cell] ? "stable" : `<b>unstable</b> (not ${lens.halves.k === 1 ? "top-1" : "top " + lens.halves.k} in both)`) + "<br>";
    html += "</div>";
  }
  document.getElementById("detail").innerHTML = html + "</div>";
  const traces = [];
  for (const name of Object.keys(D.lenses)) {
    const lens = D.lenses[name];
    for (const [token, ranks] of Object.entries(lens.pinned))
      traces.push({x: lens.layers, y: lens.layers.map((_, r) => ranks[r * n + col]), mode: "lines+markers",
                   name: `${JSON.stringify(token)} · ${lens.label}`});
  }
  const div = document.getElementById("ranks");
  if (traces.length) {
    Plotly.react(div, traces, {height: 300, margin: {l: 50, r: 10, t: 40, b: 40},
      title: {text: `Pinned tokens' rank at position ${position}`},
      xaxis: {title: {text: "layer"}}, yaxis: {type: "log", autorange: "reversed", title: {text: "rank (1 = top)"}}},
      {displaylogo: false});
  } else { Plotly.purge(div); div.innerHTML = ""; }
}
async function main() {
  const status = document.getElementById("status");
  if (typeof DecompressionStream === "undefined") {
    status.textContent = "This browser cannot unpack the page: it needs DecompressionStream " +
                         "(Chrome 80, Firefox 113, Safari 16.4 or later).";
    return;
  }
  const code = document.createElement("script");
  code.text = await unpack("plotly-packed");
  document.head.appendChild(code);
  const payload = JSON.parse(await unpack("reading-packed"));
  D = payload.detail;
  const fig = payload.figure;
  const div = document.getElementById("heatmap");
  await Plotly.newPlot(div, fig.data, fig.layout, {displaylogo: false, responsive: true});
  div.on("plotly_click", ev => {  // a cell marker: x = position, y = row of payload.layers
    const p = ev.points && ev.points[0];
    if (p) showCell(payload.layers[Math.round(p.y)], Math.round(p.x));
  });
  status.textContent = "";
}
main().catch(err => { document.getElementById("status").textContent = "The page could not be drawn: " + err; });
"""

__all__ = ["DETAIL_STATS", "detail_data", "packed_plotly_js", "page_settings", "reading_page", "write_reading_page"]
