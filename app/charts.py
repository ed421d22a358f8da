"""Plotly figures of the jlens app. Presentation only: every number comes from ``jlens_core``.

Heatmaps put one row per layer (layer 0 on top) and the model's output as the last row, one
column per position. ``x`` is the position and ``y`` the row index, so a clicked point maps back
to a cell with :func:`cell_from_point`.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from jlens_core.reading.tokens import display_ids, visible

MAX_TEXT_CELLS = 3000  # cells above this are drawn without their top-1 token (hover still has it)
PLOT_WIDTH_PX = 1000  # about the width of the heatmap in the wide layout
MAX_HOVER_CELLS = 20000  # above this, hover lists only the top 3
# by lens kind, in the order panels and legends list them ("relevance": a Jacobian lens fitted with relevance rules)
LENS_NAMES = {"logit": "Logit lens", "jacobian": "Jacobian lens", "relevance": "R-lens", "tuned": "Tuned lens"}
LENS_SHORT = {"logit": "Logit", "jacobian": "Jacobian", "relevance": "R-lens", "tuned": "Tuned"}  # in "B − A"
LENS_ABBR = {"logit": "logit", "jacobian": "Jac", "relevance": "R", "tuned": "Tuned"}  # the difference's colour bar
LENS_DASHES = {"logit": "dot", "jacobian": "solid", "relevance": "dash", "tuned": "dashdot"}  # pinned-rank lines
LENS_COLORS = {"logit": "#6c8ebf", "jacobian": "#d6762b", "relevance": "#8e5bb5", "tuned": "#4c9a5a"}
STAT_LABELS = {"top1_prob": "top-1 probability", "entropy_bits": "entropy (bits)", "kl_bits": "KL to final (bits)",
               "ce_bits": "next-token CE (bits)", "next_token_rank": "rank of next token",
               "final_top1_rank": "rank of final top-1"}
RANK_STATS = ("next_token_rank", "final_top1_rank")
SELECTED_COLOUR = "#ff2b2b"  # the outline of the cell the detail panel shows
HIGHER_IS_BETTER = ("top1_prob",)


def esc(text: str) -> str:
    """Escape a token for Plotly text (which reads a little HTML)."""
    return html.escape(str(text), quote=False)


def token_names(reading: Any, ids: Sequence[int]) -> list[str]:
    """Display strings of token ids, from the reading's vocabulary strings."""
    return display_ids(reading.vocab_strings, ids)


def _short(text: str, n: int = 10) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _fmt(stat: str, value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if stat in RANK_STATS or stat.startswith("rank_"):
        return f"{int(value):,}"
    if stat == "top1_prob":
        return f"{value:.1%}"
    return f"{value:.2f}"


def row_labels(layers: Sequence[int], output_layer: int) -> list[str]:
    """``L0, L1, ...`` with the model's output row named as such."""
    return [f"output (L{layer})" if layer == output_layer else f"L{layer}" for layer in layers]


GENERATED_COLOUR = "#c2410c"  # tick labels of generated tokens


def column_labels(reading: Any) -> list[str]:
    """``"<position>: <token>"`` per read position; generated tokens end in ``" ✎"``."""
    n_prompt = int(getattr(reading, "n_prompt", None) or len(reading.input_ids))
    return [f"{p}: {_short(t)}" + (" ✎" if p >= n_prompt else "")
            for p, t in zip(reading.positions.tolist(), reading.position_tokens)]


def stat_values(reading: Any, stat: str, layers: Sequence[int]) -> np.ndarray:
    """``[len(layers), n_positions]`` of ``stat`` (NaN where the reading has no such layer)."""
    return reading.grid(stat, layers=list(layers))


def _colour(stat: str, values: np.ndarray) -> tuple[np.ndarray, dict]:
    """Values as drawn (ranks on a log10 scale) and the colour settings."""
    if stat in RANK_STATS or stat.startswith("rank_"):
        z = np.log10(np.clip(values, 1, None))
        top = max(1.0, float(np.nanmax(z)) if np.isfinite(z).any() else 1.0)
        ticks = list(range(math.ceil(top) + 1))
        return z, {"colorscale": "Viridis_r", "zmin": 0.0, "zmax": top,
                   "colorbar": {"tickvals": ticks, "ticktext": [f"{10 ** t:,}" for t in ticks]}}
    if stat == "top1_prob":
        return values, {"colorscale": "Viridis", "zmin": 0.0, "zmax": 1.0, "colorbar": {"tickformat": ".0%"}}
    top = float(np.nanmax(values)) if np.isfinite(values).any() else 1.0
    return values, {"colorscale": "Viridis_r", "zmin": 0.0, "zmax": max(top, 1e-6), "colorbar": {}}


def _hover(reading: Any, stat: str, layers: Sequence[int], values: np.ndarray, k: int) -> list[list[str]]:
    """Hover text per cell: the cell, the statistic, the top-k tokens with probabilities."""
    out = []
    tokens, nexts = reading.position_tokens, reading.next_tokens
    positions = reading.positions.tolist()
    labels: dict[int, str] = {}  # a few thousand distinct tokens among 10 per cell: escaped once each

    def label(token_id: int) -> str:
        if token_id not in labels:
            labels[token_id] = esc(shown(token_names(reading, [token_id])[0]))
        return labels[token_id]

    unfitted = unfitted_note(reading)
    for row, layer in enumerate(layers):
        if layer not in reading.layers:
            out.append([f"L{layer}: not fitted in this lens"] * len(positions))
            continue
        li = reading.layers.index(layer)
        ids = reading.top_ids[li, :, :k].tolist()
        probs = reading.top_probs[li, :, :k].tolist()
        line = []
        for pi, p in enumerate(positions):
            head = (f"<b>L{layer}</b> · pos {p} <b>{esc(shown(tokens[pi]))}</b>"
                    + (f" → next <b>{esc(shown(nexts[pi]))}</b>" if nexts[pi] else "")
                    + f"<br>{STAT_LABELS.get(stat, stat)}: {_fmt(stat, values[row, pi])}"
                    + (unfitted if p < reading.skip_first and layer != reading.output_layer else ""))
            body = "<br>".join(f"{j + 1}. {label(i)}  {pr:.1%}" for j, (i, pr) in enumerate(zip(ids[pi], probs[pi])))
            line.append(head + "<br>" + body)
        out.append(line)
    return out


def unfitted_note(reading: Any) -> str:
    """The hover line of a cell at a position the reading's lens was never fitted on (before its ``skip_first``)."""
    return (f"<br><i>not fitted: position &lt; skip_first={int(reading.skip_first)} of this lens "
            "(its fit averaged later positions only)</i>")


UNFITTED_FILL = "rgba(120, 120, 120, 0.45)"  # the shade over positions before a lens's skip_first


def shade_unfitted(fig: go.Figure, panels: Sequence[Any], layers: Sequence[int]) -> None:
    """A translucent shade over the columns each panel's lens was never fitted on (positions < ``skip_first``).

    ``panels`` holds one reading per panel, top to bottom; the output row (the model itself) stays unshaded.
    The reason is in the cells' hover (:func:`unfitted_note`).
    """
    for index, reading in enumerate(panels, start=1):
        skip = int(getattr(reading, "skip_first", 0) or 0)
        shown_positions = reading.positions.tolist()
        if not shown_positions or shown_positions[0] >= skip:
            continue
        suffix = "" if index == 1 else str(index)
        rows = [row for row, layer in enumerate(layers) if layer != reading.output_layer]
        if not rows:
            continue
        fig.add_shape(type="rect", xref=f"x{suffix}", yref=f"y{suffix}", x0=shown_positions[0] - 0.5,
                      x1=min(skip, shown_positions[-1] + 1) - 0.5, y0=rows[0] - 0.5, y1=rows[-1] + 0.5,
                      fillcolor=UNFITTED_FILL, line={"width": 0}, layer="above", name="not fitted")


def shown(token: str) -> str:
    """A whitespace-only token is shown with glyphs (``·`` for a space, ``∅`` if empty), so it can be seen."""
    return token if token.strip() else (visible(token, show_whitespace=True) or "∅")


def cell_text(token: str, max_chars: int) -> str:
    """A token as written in a cell (escaped, shortened to ``max_chars``)."""
    return esc(_short(shown(token), max_chars))


def _texts(reading: Any, layers: Sequence[int], max_chars: int) -> list[list[str]]:
    grid = reading.top1_grid()
    return [[cell_text(t, max_chars) for t in grid[reading.layers.index(layer)]] if layer in reading.layers
            else [""] * reading.n_positions for layer in layers]


def text_chars(n_positions: int, n_cells: int, max_text_cells: int = MAX_TEXT_CELLS) -> int:
    """Characters of the top-1 token written per cell (0: none), from the cell's width on screen."""
    if n_cells > max_text_cells or n_positions < 1:
        return 0
    chars = int(PLOT_WIDTH_PX / n_positions / 6.5)
    return min(8, chars) if chars >= 1 else 0


def _panel(reading: Any, stat: str, layers: Sequence[int], *, chars: int, hover_k: int, z=None,
           colour: dict | None = None, name: str = "", coloraxis: str | None = None,
           hovertext: list[list[str]] | None = None) -> tuple[go.Heatmap, go.Scatter]:
    """One heatmap panel: the coloured cells with their top-1 text, and a layer of invisible markers
    on the cell centres that carries the hover text and makes a cell clickable (Plotly heatmaps
    cannot be selected; markers can). Plotly finds the marker under the cursor from its data, so one
    marker is drawn (``maxdisplayed``), not one per cell: thousands of invisible SVG markers took the
    browser 0.15-0.25 s per redraw. The selected cell is outlined by :func:`heatmap_figure`."""
    values = stat_values(reading, stat, layers)
    zz, settings = _colour(stat, values) if z is None else (z, colour or {})
    positions = reading.positions.tolist()
    trace = {"z": zz, "x": positions, "y": list(range(len(layers))), "name": name, "hoverinfo": "skip",
             "xgap": 1, "ygap": 1}
    if chars:
        trace.update(text=_texts(reading, layers, chars), texttemplate="%{text}", textfont={"size": 10})
    if coloraxis:
        trace["coloraxis"] = coloraxis
    else:
        trace.update(settings)
    hover = hovertext if hovertext is not None else _hover(reading, stat, layers, values, hover_k)
    n_rows, n_pos = len(layers), len(positions)
    size = max(6, min(22, int(PLOT_WIDTH_PX / max(1, n_pos)) - 2))
    scatter = go.Scattergl if n_rows * n_pos > 5000 else go.Scatter
    cells = scatter(x=np.tile(positions, n_rows), y=np.repeat(np.arange(n_rows), n_pos), mode="markers",
                    name=f"{name} cells", showlegend=False, hovertext=[h for row in hover for h in row],
                    hovertemplate="%{hovertext}<extra></extra>",
                    marker={"size": size, "symbol": "square-open", "color": SELECTED_COLOUR, "opacity": 0,
                            "line": {"width": 2}, "maxdisplayed": 1})
    return go.Heatmap(**trace), cells


def _axes(fig: go.Figure, reading: Any, layers: Sequence[int], n_panels: int = 1) -> None:
    labels = row_labels(layers, reading.output_layer)
    xlabels = column_labels(reading)
    n_pos = reading.n_positions
    step = max(1, math.ceil(n_pos / 60))
    for row in range(1, n_panels + 1):
        where = {"row": row, "col": 1} if n_panels > 1 else {}
        fig.update_yaxes(tickvals=list(range(len(layers))), ticktext=labels, autorange="reversed", showgrid=False,
                         **where)
        ticks = [f'<span style="color:{GENERATED_COLOUR}">{esc(t)}</span>' if t.endswith(" ✎") else esc(t)
                 for t in xlabels[::step]]
        fig.update_xaxes(tickvals=reading.positions.tolist()[::step], ticktext=ticks,
                         tickangle=-60, showgrid=False, showticklabels=row == n_panels, **where)
    n_prompt = int(getattr(reading, "n_prompt", None) or len(reading.input_ids))
    shown_positions = reading.positions.tolist()
    if shown_positions and shown_positions[0] < n_prompt <= shown_positions[-1]:
        # where the model's own continuation starts
        for row in range(1, n_panels + 1):
            where = {"row": row, "col": 1} if n_panels > 1 else {}
            fig.add_vline(x=n_prompt - 0.5, line={"color": GENERATED_COLOUR, "width": 2, "dash": "dot"}, **where)
        fig.add_annotation(x=n_prompt - 0.5, y=1.0, yref="paper", xanchor="left", yanchor="bottom",
                           text="generated →", showarrow=False, font={"color": GENERATED_COLOUR, "size": 11})


def heatmap_figure(readings: Mapping[str, Any], mode: str, stat: str, *, layers: Sequence[int] | None = None,
                   max_text_cells: int = MAX_TEXT_CELLS, hover_k: int = 10,
                   pair: tuple[str, str] = ("logit", "jacobian"),
                   selected: tuple[int, int] | None = None) -> go.Figure:
    """The layer x position heatmap of the Inspect page (side by side: logit above, Jacobian below).

    Args:
        readings: ``{"logit": PromptReading, "jacobian": PromptReading}`` (``jacobian`` optional
            except for the modes that need it).
        mode: one lens (a key of :data:`LENS_NAMES`), ``"side"`` (the two lenses of ``pair``,
            one above the other), ``"diff"`` (``pair[1] − pair[0]``) or ``"three"`` (every lens given).
        pair: the two lenses of ``"side"`` and ``"diff"``.
        stat: a statistic of :meth:`PromptReading.grid` (``top1_prob``, ``entropy_bits``, ...).
        layers: the rows (default: the logit reading's layers, i.e. every requested layer).
        max_text_cells: above this many cells, the top-1 token is not written in the cells.
        selected: the ``(layer, position)`` cell to outline in every panel (the cell detail's cell).
    """
    base = readings["logit"]
    layers = list(layers) if layers is not None else list(base.layers)
    n_panels = {"side": 2, "three": len(readings)}.get(mode, 1)
    n_cells = len(layers) * base.n_positions * n_panels
    chars = text_chars(base.n_positions, n_cells, max_text_cells)
    hover_k = hover_k if n_cells <= MAX_HOVER_CELLS else min(hover_k, 3)
    height = max(320, n_panels * 24 * len(layers) + 150 + 40 * (n_panels - 1))
    title = f"{STAT_LABELS.get(stat, stat)} — cells show the top-1 token" if chars else \
        f"{STAT_LABELS.get(stat, stat)} — {n_cells:,} cells: hover for tokens, narrow the range to see them"
    if mode in LENS_NAMES:
        reading = readings[mode]
        fig = go.Figure(_panel(reading, stat, layers, chars=chars, hover_k=hover_k, name=LENS_NAMES[mode]))
        _axes(fig, reading, layers)
        shade_unfitted(fig, [reading], layers)
        fig.update_layout(title=f"{LENS_NAMES[mode]}: {title}")
    elif mode in ("side", "three"):
        names = list(pair) if mode == "side" else [n for n in LENS_NAMES if n in readings]
        panels = [readings[n] for n in names]
        values_all = [stat_values(r, stat, layers) for r in panels]
        _, settings = _colour(stat, np.concatenate(values_all, axis=1))
        fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True,
                            vertical_spacing=0.08 if len(layers) < 12 else 0.04,
                            subplot_titles=[LENS_NAMES.get(n, n) for n in names])
        for row, (name, reading) in enumerate(zip(names, panels), start=1):
            for trace in _panel(reading, stat, layers, chars=chars, hover_k=hover_k,
                                name=LENS_NAMES.get(name, name), coloraxis="coloraxis"):
                fig.add_trace(trace, row=row, col=1)
        _axes(fig, panels[0], layers, n_panels=len(panels))
        shade_unfitted(fig, panels, layers)
        fig.update_layout(coloraxis={k: v for k, v in settings.items() if k != "zmin" and k != "zmax"}
                          | {"cmin": settings["zmin"], "cmax": settings["zmax"]}, title=title)
    elif mode == "diff":
        a, b = readings[pair[0]], readings[pair[1]]
        name_a, name_b = (LENS_SHORT.get(n, n) for n in pair)
        va, vb = stat_values(a, stat, layers), stat_values(b, stat, layers)
        if stat in RANK_STATS:
            z = np.log10(np.clip(vb, 1, None)) - np.log10(np.clip(va, 1, None))
            unit = "log10 rank ratio"
        else:
            z = vb - va
            unit = STAT_LABELS.get(stat, stat)
        span = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
        span = span or 1.0
        # blue = lens B is better (more probable top-1, lower entropy/KL/CE/rank)
        scale = "RdBu" if stat in HIGHER_IS_BETTER else "RdBu_r"
        hover_a = _hover(a, stat, layers, va, min(hover_k, 5))
        hover_b = _hover(b, stat, layers, vb, min(hover_k, 5))
        hover = [[f"<b>{name_b} − {name_a.lower()}</b>: {dz:+.3g} ({esc(unit)})<br><br><i>{name_b}</i> · {hb}"
                  f"<br><br><i>{name_a.lower()}</i> · {ha.split('<br>', 2)[-1]}"
                  for dz, ha, hb in zip(zrow, ra, rb)] for zrow, ra, rb in zip(z, hover_a, hover_b)]
        fig = go.Figure(_panel(b, stat, layers, chars=chars, hover_k=min(hover_k, 5), z=z, name="difference",
                               colour={"colorscale": scale, "zmid": 0.0, "zmin": -span, "zmax": span,
                                       "colorbar": {"title": {"text": f"{LENS_ABBR.get(pair[1], name_b)} − {LENS_ABBR.get(pair[0], name_a).lower()}"}}}, hovertext=hover))
        _axes(fig, b, layers)
        shade_unfitted(fig, [max((a, b), key=lambda r: int(getattr(r, "skip_first", 0) or 0))], layers)
        fig.update_layout(title=f"{name_b} − {name_a.lower()}, {unit} (blue: the {LENS_NAMES.get(pair[1], name_b)} "
                                "is better); "
                                f"cells show the {name_b} top-1")
    else:
        raise ValueError(f"Unknown mode {mode!r}.")
    fig.update_layout(height=height, margin={"l": 10, "r": 10, "t": 60, "b": 10}, hovermode="closest",
                      hoverdistance=-1,
                      hoverlabel={"align": "left", "font": {"family": "monospace"}})
    if selected is not None and selected[0] in layers:
        row, position = layers.index(selected[0]), selected[1]
        for panel in range(1, n_panels + 1):
            suffix = "" if panel == 1 else str(panel)
            fig.add_shape(type="rect", xref=f"x{suffix}", yref=f"y{suffix}", x0=position - 0.5, x1=position + 0.5,
                          y0=row - 0.5, y1=row + 0.5, line={"color": SELECTED_COLOUR, "width": 2})
    return fig


def cell_from_point(point: Mapping[str, Any], layers: Sequence[int]) -> tuple[int, int] | None:
    """``(layer, position)`` of a clicked cell marker (``x`` = position, ``y`` = row index)."""
    try:
        x, y = point.get("x"), point.get("y")
        row, position = round(float(y)), round(float(x))
    except (TypeError, ValueError):
        return None
    if not 0 <= row < len(layers):
        return None
    return int(layers[row]), position


def topk_bars(cells: Mapping[str, dict], *, k: int = 10) -> go.Figure:
    """Horizontal bars of the top-k tokens at one cell, one panel per lens."""
    names = list(cells)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=[LENS_NAMES.get(n, n) for n in names],
                        horizontal_spacing=0.18)
    for col, name in enumerate(names, start=1):
        cell = cells[name]
        if cell is None:
            continue
        tokens = [esc(shown(t)) for t in cell["top_tokens"][:k]][::-1]
        probs = cell["top_probs"][:k][::-1]
        fig.add_trace(go.Bar(x=probs, y=[f"{len(tokens) - i}. {t}" for i, t in enumerate(tokens)], orientation="h",
                             marker_color=LENS_COLORS.get(name), name=LENS_NAMES.get(name, name),
                             text=[f"{p:.1%}" for p in probs], textposition="auto",
                             hovertemplate="%{y}: %{x:.2%}<extra></extra>"), row=1, col=col)
        fig.update_xaxes(tickformat=".0%", row=1, col=col)
    fig.update_layout(height=max(260, 26 * k + 80), showlegend=False, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig


def pinned_ranks_figure(readings: Mapping[str, Any], position: int) -> go.Figure | None:
    """Rank across layers of each pinned token at ``position``, per lens (log scale)."""
    fig = go.Figure()
    for name, reading in readings.items():
        if reading is None or not reading.pinned:
            continue
        try:
            pi = reading.position_index(position)
        except KeyError:
            continue
        for token, ranks in reading.pinned_ranks.items():
            fig.add_trace(go.Scatter(x=reading.layers, y=ranks[:, pi], mode="lines+markers",
                                     name=f"{esc(repr(token))} · {LENS_NAMES.get(name, name)}",
                                     line={"dash": LENS_DASHES.get(name, "dot")},
                                     hovertemplate="layer %{x}: rank %{y}<extra>%{fullData.name}</extra>"))
    if not fig.data:
        return None
    fig.update_yaxes(type="log", autorange="reversed", title="rank (1 = top)")
    fig.update_xaxes(title="layer")
    fig.update_layout(height=320, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      title=f"Pinned tokens' rank at position {position}")
    return fig


# -- fit diagnostics ---------------------------------------------------------------------------------
def convergence_figure(conv: pd.DataFrame, guide: pd.DataFrame | None = None) -> go.Figure:
    """Relative change of the running mean vs prompts averaged, per layer, log-log, with a 1/n guide."""
    fig = go.Figure()
    layers = sorted(conv["layer"].unique()) if not conv.empty else []
    n_layers = max(1, len(layers))
    for i, layer in enumerate(layers):
        sub = conv[conv["layer"] == layer]
        colour = f"hsl({int(260 * i / n_layers)}, 65%, 45%)"
        fig.add_trace(go.Scatter(x=sub["n_prompts"], y=sub["rel_change"], mode="lines", name=f"L{layer}",
                                 line={"width": 1.4, "color": colour},
                                 hovertemplate=f"L{layer}" + ": n=%{x}, Δ=%{y:.3g}<extra></extra>"))
    if guide is not None and not guide.empty:
        fig.add_trace(go.Scatter(x=guide["n_prompts"], y=guide["rel_change"], mode="lines", name="1/n guide",
                                 line={"dash": "dash", "color": "black", "width": 2}))
    fig.update_xaxes(type="log", title="prompts averaged")
    fig.update_yaxes(type="log", title="relative change of the running mean")
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title="Convergence",
                      legend={"font": {"size": 9}})
    return fig


def norm_heatmap(norms: pd.DataFrame) -> go.Figure:
    """Per-prompt ``||J_l||_F / sqrt(d)`` as a prompt x layer heatmap."""
    fig = go.Figure(go.Heatmap(z=norms.to_numpy().T, x=norms.index.tolist(), y=[f"L{c}" for c in norms.columns],
                               colorscale="Magma", colorbar={"title": {"text": "‖J‖F/√d"}},
                               hovertemplate="prompt %{x}, %{y}: %{z:.3g}<extra></extra>"))
    fig.update_xaxes(title="prompt index")
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title="Per-prompt Jacobian norm")
    return fig


# -- Jacobians page ---------------------------------------------------------------------------------
def layer_stats_figure(stats: pd.DataFrame) -> go.Figure:
    """Four panels over layers: Frobenius norm / sqrt(d), spectral norm, distance from I, effective rank."""
    panels = (("fro_norm", "‖J‖F / √d"), ("spectral_norm", "spectral norm"),
              ("dist_identity", "‖J − I‖F / √d"), ("effective_rank", "effective rank"))
    fig = make_subplots(rows=1, cols=4, subplot_titles=[t for _, t in panels], horizontal_spacing=0.06)
    for col, (key, label) in enumerate(panels, start=1):
        fig.add_trace(go.Scatter(x=stats["layer"], y=stats[key], mode="lines+markers", name=label,
                                 line={"color": LENS_COLORS["jacobian"]},
                                 hovertemplate="layer %{x}: %{y:.4g}<extra>" + label + "</extra>"), row=1, col=col)
        fig.update_xaxes(title="layer", row=1, col=col)
    fig.update_layout(height=300, showlegend=False, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig


def spectrum_figure(spectra: Mapping[int, np.ndarray]) -> go.Figure:
    """Singular values (descending, log scale) of one or more layers."""
    fig = go.Figure()
    for layer, s in spectra.items():
        fig.add_trace(go.Scatter(x=np.arange(1, len(s) + 1), y=s, mode="lines", name=f"L{layer}",
                                 hovertemplate="σ%{x}: %{y:.4g}<extra>" + f"L{layer}" + "</extra>"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey", annotation_text="identity")
    fig.update_yaxes(type="log", title="singular value")
    fig.update_xaxes(title="index")
    fig.update_layout(height=340, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title="Singular-value spectrum")
    return fig


# -- Evaluate page -------------------------------------------------------------------------------------
def eval_curves_figure(frame: pd.DataFrame) -> go.Figure:
    """Per-layer mean KL to final and next-token CE, per lens, with ±1 standard-error bands."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KL(final ‖ lens), bits", "next-token cross-entropy, bits"))
    for name in dict.fromkeys(frame["lens"]):
        sub = frame[frame["lens"] == name].sort_values("layer")
        for col, (key, se) in enumerate((("kl_bits", "kl_se"), ("ce_bits", "ce_se")), start=1):
            fig.add_trace(go.Scatter(x=sub["layer"], y=sub[key], mode="lines+markers", name=LENS_NAMES.get(name, name),
                                     legendgroup=name, showlegend=col == 1,
                                     line={"color": LENS_COLORS.get(name)},
                                     error_y={"type": "data", "array": sub[se].fillna(0), "visible": True,
                                              "thickness": 1},
                                     hovertemplate="layer %{x}: %{y:.3f} bits<extra>" + name + "</extra>"),
                          row=1, col=col)
            fig.update_xaxes(title="layer", row=1, col=col)
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig


def pass_at_k_figure(frame: pd.DataFrame) -> go.Figure:
    """pass@k per evaluation set and lens (grouped bars, one panel per k)."""
    ks = sorted(frame["k"].unique())
    fig = make_subplots(rows=1, cols=len(ks), subplot_titles=[f"pass@{k}" for k in ks], shared_yaxes=True)
    for col, k in enumerate(ks, start=1):
        sub = frame[frame["k"] == k]
        for name in dict.fromkeys(sub["lens"]):
            rows = sub[sub["lens"] == name]
            fig.add_trace(go.Bar(x=rows["set"], y=rows["pass_rate"], name=LENS_NAMES.get(name, name), legendgroup=name,
                                 showlegend=col == 1, marker_color=LENS_COLORS.get(name),
                                 hovertemplate="%{x}: %{y:.0%}<extra>" + name + "</extra>"), row=1, col=col)
    fig.update_yaxes(tickformat=".0%", range=[0, 1])
    fig.update_layout(barmode="group", height=360, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig


def tune_figure(history: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Tuned-lens training: KL(final || lens) per step (train batch) and on held-out texts (bits)."""
    frame = pd.DataFrame(list(history))
    fig = go.Figure()
    if not frame.empty:
        fig.add_trace(go.Scatter(x=frame["step"], y=frame["train_kl_bits"], mode="lines", name="train batch",
                                 line={"color": LENS_COLORS["tuned"]}))
        if "heldout_kl_bits" in frame:
            held = frame.dropna(subset=["heldout_kl_bits"])
            fig.add_trace(go.Scatter(x=held["step"], y=held["heldout_kl_bits"], mode="lines+markers", name="held-out",
                                     line={"color": "#222", "dash": "dot"}))
    fig.update_layout(title="Tuned-lens training: KL(final ‖ lens), mean over layers", height=340,
                      xaxis_title="step", yaxis_title="KL (bits)", margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig


# -- Compare runs page -------------------------------------------------------------------------------
def divergence_figure(curve: pd.DataFrame, *, op: str, atol: float, first_layer: int | None) -> go.Figure:
    """Per-layer max abs / relative error between two dumps, first divergence marked."""
    fig = go.Figure()
    floor = 1e-12
    fig.add_trace(go.Scatter(x=curve["layer"], y=np.maximum(curve["max_abs_err"], floor), mode="lines+markers",
                             name="max abs error", hovertemplate="layer %{x}: %{y:.3g}<extra>max abs</extra>"))
    fig.add_trace(go.Scatter(x=curve["layer"], y=np.maximum(curve["max_rel_err"], floor), mode="lines+markers",
                             name="max rel error", line={"dash": "dot"},
                             hovertemplate="layer %{x}: %{y:.3g}<extra>max rel</extra>"))
    fig.add_hline(y=max(atol, floor), line_dash="dash", line_color="grey", annotation_text=f"atol {atol:g}")
    if first_layer is not None:
        fig.add_vline(x=first_layer, line_color="crimson", annotation_text=f"first divergence: layer {first_layer}")
    fig.update_yaxes(type="log", title="error")
    fig.update_xaxes(title="layer (-1 = embedding)")
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title=f"Divergence of {op}")
    return fig
