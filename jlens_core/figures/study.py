"""A study's figures (docs/method.md §8.1): the by-layer top-k fraction per lens with its interval, the
first-appearance histogram with its cumulative share, the band shaded on both; and the study's HTML page.

The functions take a :class:`~jlens_core.evaluation.study.Study` (its ``by_layer`` / ``summary`` tables and
``kind(lens)``); each lens is drawn in its kind's colour.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
from typing import Any

import pandas as pd

from .html_page import packed_plotly_js
from .labels import LENS_COLORS, LENS_NAMES
from .plotly_lib import go, make_subplots

FALLBACK_COLORS = ("#7f7f7f", "#17becf", "#bcbd22", "#e377c2", "#8c564b")


def _colour(study: Any, lens: str, index: int) -> str:
    return LENS_COLORS.get(study.kind(lens)) or FALLBACK_COLORS[index % len(FALLBACK_COLORS)]


def _rgba(hex_colour: str, alpha: float) -> str:
    h = hex_colour.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r}, {g}, {b}, {alpha})"


def _label(study: Any, lens: str) -> str:
    kind_name = LENS_NAMES.get(study.kind(lens))
    return kind_name if kind_name and lens == study.kind(lens) else lens


def study_figure(study: Any, set_name: str) -> go.Figure:
    """One set's study: left, the fraction of units in the top k by layer per lens (line) with its 95 % Wilson
    interval (shaded); right, the share of units whose first layer in the top k is each layer (bars) and the
    cumulative share (line). Each lens's band (onset to end) is shaded on both panels in its colour.

    Args:
        study: a :class:`~jlens_core.evaluation.study.Study`.
        set_name: one of ``study.sets``.

    Raises:
        ValueError: a set the study does not hold.
    """
    if set_name not in study.sets:
        raise ValueError(f"The study has no set {set_name!r}; it holds {study.sets}.")
    k = study.k
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08,
                        subplot_titles=(f"in the top {k}, by layer (95 % interval)",
                                        f"first layer in the top {k} (bars) and cumulative (line)"))
    for i, lens in enumerate(study.lenses):
        colour, label = _colour(study, lens, i), _label(study, lens)
        rows = study.curve(set_name, lens)
        if rows.empty or not rows["units"].iloc[0]:
            continue
        x = rows["layer"].tolist()
        fig.add_trace(go.Scatter(x=x + x[::-1], y=rows["ci_high"].tolist() + rows["ci_low"].tolist()[::-1],
                                 fill="toself", fillcolor=_rgba(colour, 0.15), line={"width": 0}, hoverinfo="skip",
                                 legendgroup=lens, showlegend=False, name=f"{label} interval"), row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=rows["fraction"], mode="lines+markers", name=label, legendgroup=lens,
                                 line={"color": colour}, marker={"size": 5},
                                 customdata=rows[["hits", "units", "ci_low", "ci_high"]].to_numpy(),
                                 hovertemplate="layer %{x}: %{y:.0%} (%{customdata[0]}/%{customdata[1]}, "
                                               "%{customdata[2]:.0%}–%{customdata[3]:.0%})<extra>" + label
                                               + "</extra>"), row=1, col=1)
        units = rows["units"].iloc[0]
        fig.add_trace(go.Bar(x=x, y=rows["first_here"] / units, name=f"{label} first", legendgroup=lens,
                             marker_color=colour, opacity=0.75, showlegend=False,
                             customdata=rows["first_here"],
                             hovertemplate="first at layer %{x}: %{customdata} (%{y:.0%})<extra>" + label
                                           + "</extra>"), row=1, col=2)
        fig.add_trace(go.Scatter(x=x, y=rows["cumulative"], mode="lines", name=f"{label} cumulative",
                                 legendgroup=lens, showlegend=False, line={"color": colour, "dash": "dot"},
                                 hovertemplate="in by layer %{x}: %{y:.0%}<extra>" + label + "</extra>"),
                      row=1, col=2)
        band = study.band(set_name, lens)
        if band is not None:
            for col in (1, 2):
                fig.add_vrect(x0=band[0] - 0.5, x1=band[1] + 0.5, fillcolor=colour, opacity=0.10, line_width=0,
                              row=1, col=col)
                fig.add_vline(x=band[0], line={"color": colour, "dash": "dash", "width": 1}, row=1, col=col)
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(tickformat=".0%", range=[0, 1.02])
    fig.update_layout(barmode="group", height=400, margin={"l": 10, "r": 10, "t": 60, "b": 10},
                      title={"text": f"{set_name}: bands (shaded) start at the dashed line", "font": {"size": 14}},
                      legend={"orientation": "h", "y": -0.18})
    return fig


def _table(frame: pd.DataFrame, floats: str = "{:.3g}") -> str:
    return frame.to_html(index=False, escape=True, na_rep="–", float_format=floats.format, border=0,
                         classes="tab")


def study_page(study: Any) -> str:
    """The study as one self-contained HTML page: per set its figure, then the summary, the lens comparisons
    (paired over items), the unscored concepts and the item table. Plotly's bundle travels inside the page
    (gzip + base64, as in :mod:`~jlens_core.figures.html_page`); nothing is fetched."""
    figures = {name: json.loads(study_figure(study, name).to_json()) for name in study.sets}
    packed = base64.b64encode(gzip.compress(json.dumps(figures).encode("utf-8"), compresslevel=9, mtime=0)).decode()
    info = study.info
    header = {"model": info.get("model", "?"), "lenses": ", ".join(study.lenses), "k": str(study.k),
              "capability filter": "; ".join(f"{n}: {c['kept']} kept, {c['dropped']} dropped" +
                                             ("" if c.get("filter") else " (off)") for n, c in info["sets"].items()),
              "time": f"{info.get('seconds')} s for {info.get('forwards')} items (one forward each)",
              "jlens": str(info.get("jlens", ""))}
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in header.items())
    divs = "".join(f'<h3>{html.escape(name)}</h3><div class="fig" id="fig-{i}"></div>'
                   for i, name in enumerate(study.sets))
    summary = study.summary.drop(columns=["kind"])
    notes = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in study.notes)
    unscored = study.unscored()
    parts = [f"<h3>Summary</h3>{_table(summary)}",
             f"<h3>Lenses compared (paired over items)</h3>{_table(study.comparisons())}",
             "<h3>Unscored concepts (no single-token spelling)</h3>"
             + (_table(unscored) if not unscored.empty else "<p>none</p>"),
             f"<h3>Items</h3>{_table(study.item_table())}"]
    return PAGE.format(title=html.escape(f"jlens study · {', '.join(study.sets)}"), header=rows, notes=notes,
                       figures=divs, tables="".join(parts), plotly=packed_plotly_js(), payload=packed,
                       names=json.dumps(study.sets).replace("</", "<\\/"))  # script text is not HTML-decoded


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; margin: 1em 2em; color: #222; }}
table.settings th {{ text-align: left; padding-right: 1em; color: #555; }}
table.tab {{ border-collapse: collapse; font-size: 12px; }}
table.tab td, table.tab th {{ padding: 2px 8px; border-bottom: 1px solid #eee; text-align: right; }}
.note {{ color: #a33; }} #status {{ color: #a33; }}
</style></head><body>
<h2>jlens study</h2>
<table class="settings">{header}</table>
{notes}
<p id="status">Unpacking the page…</p>
{figures}
{tables}
<script id="plotly-packed" type="application/octet-stream">{plotly}</script>
<script id="study-packed" type="application/octet-stream">{payload}</script>
<script id="study-names" type="application/json">{names}</script>
<script>
"use strict";
async function unpack(id) {{
  const text = document.getElementById(id).textContent.trim();
  const bytes = Uint8Array.from(atob(text), c => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return await new Response(stream).text();
}}
async function main() {{
  const status = document.getElementById("status");
  if (typeof DecompressionStream === "undefined") {{
    status.textContent = "This browser cannot unpack the page: it needs DecompressionStream.";
    return;
  }}
  const code = document.createElement("script");
  code.text = await unpack("plotly-packed");
  document.head.appendChild(code);
  const figures = JSON.parse(await unpack("study-packed"));
  const names = JSON.parse(document.getElementById("study-names").textContent);
  for (let i = 0; i < names.length; i++) {{
    const fig = figures[names[i]];
    await Plotly.newPlot(document.getElementById("fig-" + i), fig.data, fig.layout, {{displaylogo: false, responsive: true}});
  }}
  status.textContent = "";
}}
main().catch(err => {{ document.getElementById("status").textContent = "The page could not be drawn: " + err; }});
</script>
</body></html>
"""

__all__ = ["study_figure", "study_page"]
