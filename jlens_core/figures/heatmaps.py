"""The layer x position heatmap of a reading: one lens, two side by side, their difference, or all stacked.

Heatmaps put one row per layer (layer 0 on top) and the model's output as the last row, one column per
position. ``x`` is the position and ``y`` the row index, so a clicked point maps back to a cell with
:func:`cell_from_point`. The readings are :class:`~jlens_core.reading.prompt_reading.PromptReading`
objects (or anything with the same attributes: a reading reopened from a file).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..reading.stability import top_rule
from .labels import (
    GENERATED_COLOUR,
    HIGHER_IS_BETTER,
    LENS_ABBR,
    LENS_NAMES,
    LENS_SHORT,
    RANK_STATS,
    SELECTED_COLOUR,
    STAT_LABELS,
    UNFITTED_FILL,
    cell_text,
    column_labels,
    esc,
    fmt,
    is_rank,
    row_labels,
    shown,
    token_names,
    unfitted_note,
)
from .plotly_lib import go, make_subplots

MAX_TEXT_CELLS = 3000  # cells above this are drawn without their top-1 token (hover still has it)
PLOT_WIDTH_PX = 1000  # about the width of the heatmap in the wide layout
MAX_HOVER_CELLS = 20000  # above this, hover lists only the top 3
MODES = ("side", "diff", "three")  # besides one lens (a key of the readings)
UNSTABLE_FADE = "rgba(255,255,255,0.55)"  # over an unstable cell: its colour faded (docs/method.md §6.2)
UNSTABLE_HATCH = "rgba(40,40,40,0.8)"  # and a diagonal stroke across it, visible on the faded colour
STRIP_GAP = 2  # the "stable %" strip sits this many columns right of the last position


def stat_values(reading: Any, stat: str, layers: Sequence[int]) -> np.ndarray:
    """``[len(layers), n_positions]`` of ``stat`` (NaN where the reading has no such layer)."""
    return reading.grid(stat, layers=list(layers))


def _colour(stat: str, values: np.ndarray) -> tuple[np.ndarray, dict]:
    """Values as drawn (ranks on a log10 scale) and the colour settings."""
    if is_rank(stat):
        z = np.log10(np.clip(values, 1, None))
        top = max(1.0, float(np.nanmax(z)) if np.isfinite(z).any() else 1.0)
        ticks = list(range(math.ceil(top) + 1))
        return z, {"colorscale": "Viridis_r", "zmin": 0.0, "zmax": top,
                   "colorbar": {"tickvals": ticks, "ticktext": [f"{10 ** t:,}" for t in ticks]}}
    if stat == "top1_prob":
        return values, {"colorscale": "Viridis", "zmin": 0.0, "zmax": 1.0, "colorbar": {"tickformat": ".0%"}}
    top = float(np.nanmax(values)) if np.isfinite(values).any() else 1.0
    return values, {"colorscale": "Viridis_r", "zmin": 0.0, "zmax": max(top, 1e-6), "colorbar": {}}


def marks_of(reading: Any, stability: bool = True) -> Any:
    """The reading's stability marks (docs/method.md §6.2) when they are to be drawn, else None."""
    return getattr(reading, "stability", None) if stability else None


def hover_texts(reading: Any, stat: str, layers: Sequence[int], values: np.ndarray, k: int, *,
                stability: bool = True) -> list[list[str]]:
    """Hover text per cell: the cell, the statistic, the stability marks (``halves: rank a / rank b``, when the
    reading has them and ``stability``), the top-k tokens with probabilities."""
    out = []
    marks = marks_of(reading, stability)
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
                    + f"<br>{STAT_LABELS.get(stat, stat)}: {fmt(stat, values[row, pi])}"
                    + (unfitted if p < reading.skip_first and layer != reading.output_layer else ""))
            if marks is not None:
                stable = bool(marks.stable[li, pi])
                head += (f"<br>halves: rank {int(marks.half_rank_even[li, pi])} / rank "
                         f"{int(marks.half_rank_odd[li, pi])} · "
                         + ("stable" if stable else f"<b>unstable</b> (not {top_rule(marks.stability_k)} in both)"))
            body = "<br>".join(f"{j + 1}. {label(i)}  {pr:.1%}" for j, (i, pr) in enumerate(zip(ids[pi], probs[pi])))
            line.append(head + "<br>" + body)
        out.append(line)
    return out


def shade_unfitted(fig: go.Figure, panels: Sequence[Any], layers: Sequence[int]) -> None:
    """A translucent shade over the columns each panel's lens was never fitted on (positions < ``skip_first``).

    ``panels`` holds one reading per panel, top to bottom; the output row (the model itself) stays unshaded.
    The reason is in the cells' hover (:func:`~jlens_core.figures.labels.unfitted_note`).
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


def mark_unstable(fig: go.Figure, panels: Sequence[Any], layers: Sequence[int], *, stability: bool = True,
                  subplots: bool = False) -> None:
    """Fade and hatch each panel's unstable cells, and draw a "stable %" strip right of its last position
    (docs/method.md §6.2): a panel whose reading has no marks (or ``stability=False``) is left as it is.

    ``panels`` holds one reading per panel, top to bottom; ``subplots``: the figure has one subplot per panel.
    The fade and the stroke are markers on the cell centres (one trace each, in the legend once); the strip is
    a one-column heatmap of :meth:`PromptReading.stability_by_layer`'s stable fraction (fitted positions).
    """
    legend_shown, strip_x = False, 0
    for index, reading in enumerate(panels, start=1):
        marks = marks_of(reading, stability)
        if marks is None:
            continue
        where = {"row": index, "col": 1} if subplots else {}
        rows = [row for row, layer in enumerate(layers) if layer in reading.layers]
        lis = [reading.layers.index(layers[row]) for row in rows]
        positions = reading.positions.tolist()
        unstable = ~marks.stable[lis]  # [rows, n_positions]
        rr, pp = np.nonzero(unstable)
        size = max(6, min(22, int(PLOT_WIDTH_PX / max(1, len(positions) + STRIP_GAP + 1)) - 2))
        xs, ys = [positions[p] for p in pp], [rows[r] for r in rr]
        label = f"unstable: not {top_rule(marks.stability_k)} under both halves"
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", hoverinfo="skip", name=label, legendgroup="unstable",
                                 showlegend=not legend_shown,
                                 marker={"symbol": "square", "size": size, "color": UNSTABLE_FADE, "line": {"width": 0}}),
                      **where)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", hoverinfo="skip", name=label, legendgroup="unstable",
                                 showlegend=False, marker={"symbol": "line-ne", "size": size,
                                                           "line": {"color": UNSTABLE_HATCH, "width": 1.5}}), **where)
        legend_shown = True
        by_layer = reading.stability_by_layer()
        fraction = dict(zip(by_layer["layer"].tolist(), by_layer["stable_fraction"].tolist()))
        counts = dict(zip(by_layer["layer"].tolist(), zip(by_layer["n_stable"].tolist(), by_layer["n_cells"].tolist())))
        z = [[fraction.get(layer, np.nan)] for layer in layers]
        text = [["–" if not np.isfinite(v[0]) else f"{v[0]:.0%}"] for v in z]
        hover = [f"<b>L{layer}</b>: {counts[layer][0]} of {counts[layer][1]} fitted cells stable "
                 f"(the shown token {top_rule(marks.stability_k)} under both halves)" if layer in counts
                 else f"L{layer}: not read" for layer in layers]
        x_strip = positions[-1] + STRIP_GAP if positions else 0
        fig.add_trace(go.Heatmap(z=z, x=[x_strip], y=list(range(len(layers))), text=text, texttemplate="%{text}",
                                 textfont={"size": 9}, colorscale="Greys", reversescale=True, zmin=0.0, zmax=1.0,
                                 showscale=False, xgap=1, ygap=1, name="stable %", hovertext=[[h] for h in hover],
                                 hovertemplate="%{hovertext}<extra></extra>"), **where)
        strip_x = x_strip
    if legend_shown:  # the strip's column gets its label on every panel's axis (shown on the bottom one)
        for index in range(1, (len(panels) if subplots else 1) + 1):
            axis = fig.layout["xaxis" if index == 1 else f"xaxis{index}"]
            if axis.tickvals is not None:
                axis.update(tickvals=[*axis.tickvals, strip_x], ticktext=[*axis.ticktext, "stable %"])
        fig.update_layout(showlegend=True, legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 1.0,
                                                   "xanchor": "right"})


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
           hovertext: list[list[str]] | None = None, stability: bool = True) -> tuple[go.Heatmap, go.Scatter]:
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
    hover = hovertext if hovertext is not None else hover_texts(reading, stat, layers, values, hover_k,
                                                                stability=stability)
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


def panel_names(readings: Mapping[str, Any], mode: str, pair: tuple[str, str]) -> list[str]:
    """The lenses ``mode`` draws, top to bottom (``"diff"``: ``pair``, B drawn over A)."""
    if mode in MODES:
        if mode == "three":
            return [n for n in LENS_NAMES if n in readings] + [n for n in readings if n not in LENS_NAMES]
        return list(pair)
    return [mode]


def heatmap_figure(readings: Mapping[str, Any], mode: str, stat: str, *, layers: Sequence[int] | None = None,
                   max_text_cells: int = MAX_TEXT_CELLS, hover_k: int = 10,
                   pair: tuple[str, str] = ("logit", "jacobian"),
                   selected: tuple[int, int] | None = None, stability: bool = True) -> go.Figure:
    """The layer x position heatmap of the Inspect page (side by side: ``pair[0]`` above, ``pair[1]`` below).

    Args:
        readings: ``{lens name: PromptReading}`` of one prompt (``"logit"``, ``"jacobian"``, ``"relevance"``,
            ``"tuned"``; the modes name the ones they need).
        mode: one lens (a key of ``readings``), ``"side"`` (the two lenses of ``pair``, one above the
            other), ``"diff"`` (``pair[1] − pair[0]``) or ``"three"`` (every lens given, stacked).
        pair: the two lenses of ``"side"`` and ``"diff"``.
        stat: a statistic of :meth:`PromptReading.grid` (``top1_prob``, ``entropy_bits``, ...).
        layers: the rows (default: the logit reading's layers, i.e. every requested layer; without a logit
            reading, the first reading's).
        max_text_cells: above this many cells, the top-1 token is not written in the cells.
        hover_k: tokens listed in a cell's hover (3 above :data:`MAX_HOVER_CELLS` cells).
        selected: the ``(layer, position)`` cell to outline in every panel (the cell detail's cell).
        stability: draw the stability marks of the readings that have them (docs/method.md §6.2): unstable
            cells faded and hatched (a legend entry), ``halves: rank a / rank b`` in the hover, and a
            "stable %" strip right of each panel. The difference mode draws none.

    Raises:
        ValueError: an unknown mode. KeyError: a lens the mode needs is not in ``readings``.
    """
    if mode not in MODES and mode not in readings:
        raise ValueError(f"Unknown mode {mode!r}: one of {list(MODES)} or a lens of the readings {list(readings)}.")
    base = readings.get("logit") or next(iter(readings.values()))
    layers = list(layers) if layers is not None else list(base.layers)
    n_panels = {"side": 2, "three": len(readings)}.get(mode, 1)
    n_cells = len(layers) * base.n_positions * n_panels
    chars = text_chars(base.n_positions, n_cells, max_text_cells)
    hover_k = hover_k if n_cells <= MAX_HOVER_CELLS else min(hover_k, 3)
    height = max(320, n_panels * 24 * len(layers) + 150 + 40 * (n_panels - 1))
    title = f"{STAT_LABELS.get(stat, stat)} — cells show the top-1 token" if chars else \
        f"{STAT_LABELS.get(stat, stat)} — {n_cells:,} cells: hover for tokens, narrow the range to see them"
    if mode in ("side", "three"):
        names = panel_names(readings, mode, pair)
        panels = [readings[n] for n in names]
        values_all = [stat_values(r, stat, layers) for r in panels]
        _, settings = _colour(stat, np.concatenate(values_all, axis=1))
        fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True,
                            vertical_spacing=0.08 if len(layers) < 12 else 0.04,
                            subplot_titles=[LENS_NAMES.get(n, n) for n in names])
        for row, (name, reading) in enumerate(zip(names, panels), start=1):
            for trace in _panel(reading, stat, layers, chars=chars, hover_k=hover_k,
                                name=LENS_NAMES.get(name, name), coloraxis="coloraxis", stability=stability):
                fig.add_trace(trace, row=row, col=1)
        _axes(fig, panels[0], layers, n_panels=len(panels))
        shade_unfitted(fig, panels, layers)
        mark_unstable(fig, panels, layers, stability=stability, subplots=True)
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
        hover_a = hover_texts(a, stat, layers, va, min(hover_k, 5), stability=False)
        hover_b = hover_texts(b, stat, layers, vb, min(hover_k, 5), stability=False)
        hover = [[f"<b>{name_b} − {name_a.lower()}</b>: {dz:+.3g} ({esc(unit)})<br><br><i>{name_b}</i> · {hb}"
                  f"<br><br><i>{name_a.lower()}</i> · {ha.split('<br>', 2)[-1]}"
                  for dz, ha, hb in zip(zrow, ra, rb)] for zrow, ra, rb in zip(z, hover_a, hover_b)]
        bar_title = f"{LENS_ABBR.get(pair[1], name_b)} − {LENS_ABBR.get(pair[0], name_a).lower()}"
        fig = go.Figure(_panel(b, stat, layers, chars=chars, hover_k=min(hover_k, 5), z=z, name="difference",
                               colour={"colorscale": scale, "zmid": 0.0, "zmin": -span, "zmax": span,
                                       "colorbar": {"title": {"text": bar_title}}}, hovertext=hover))
        _axes(fig, b, layers)
        shade_unfitted(fig, [max((a, b), key=lambda r: int(getattr(r, "skip_first", 0) or 0))], layers)
        fig.update_layout(title=f"{name_b} − {name_a.lower()}, {unit} (blue: the {LENS_NAMES.get(pair[1], name_b)} "
                                "is better); "
                                f"cells show the {name_b} top-1")
    else:
        reading = readings[mode]
        name = LENS_NAMES.get(mode, mode)
        fig = go.Figure(_panel(reading, stat, layers, chars=chars, hover_k=hover_k, name=name, stability=stability))
        _axes(fig, reading, layers)
        shade_unfitted(fig, [reading], layers)
        mark_unstable(fig, [reading], layers, stability=stability)
        fig.update_layout(title=f"{name}: {title}")
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


def label_cells(fig: go.Figure, layers: Sequence[int], labels: Mapping[int, Sequence[str]],
                hovers: Mapping[int, Sequence[str]], *, title: str | None = None) -> go.Figure:
    """Write other labels into the cells of a one-lens :func:`heatmap_figure` (the J-space mode's largest atoms,
    docs/method.md §11.2) and add a text to their hovers; rows of ``layers`` without labels keep theirs.

    Args:
        fig: a figure of one lens (its first trace the heatmap, its second the hover markers); changed in place.
        layers: the figure's rows, as given to :func:`heatmap_figure`.
        labels, hovers: ``{layer: one text per column}``; a label is cut to the cells' width as the top-1 tokens
            are (nothing is written where the figure writes no text), a hover text is added below the cell's own.
        title: the figure's new title (default: unchanged).

    Raises:
        ValueError: a figure of several panels, or a row whose texts do not match the figure's columns.
    """
    heat, cells = fig.data[0], fig.data[1]
    if len(fig.data) > 2 and any(isinstance(t, go.Heatmap) and t.name != "stable %" for t in fig.data[2:]):
        raise ValueError("label_cells labels a one-lens heatmap: this figure has several panels; draw one lens.")
    n_pos = len(heat.x)
    for source in (labels, hovers):
        for layer, row in source.items():
            if len(row) != n_pos:
                raise ValueError(f"Layer {layer} has {len(row)} texts for {n_pos} columns: give one per position.")
    chars = text_chars(n_pos, len(layers) * n_pos)
    if heat.text is not None and chars:
        text = [list(row) for row in heat.text]
        for i, layer in enumerate(layers):
            if layer in labels:
                text[i] = [cell_text(t, chars) for t in labels[layer]]
        heat.update(text=text)
    hover = list(cells.hovertext)
    for i, layer in enumerate(layers):
        for j, extra in enumerate(hovers.get(layer, ())):
            hover[i * n_pos + j] = f"{hover[i * n_pos + j]}<br><br>{extra}"
    cells.update(hovertext=hover)
    if title is not None:
        fig.update_layout(title=title)
    return fig


def reading_figure(reading: Any, stat: str = "top1_prob", *, others: Mapping[str, Any] | None = None,
                   mode: str | None = None, **options: Any) -> go.Figure:
    """The heatmap of one reading, or of it with ``others`` (side by side, difference, stacked).

    What :meth:`PromptReading.figure` draws. The reading is keyed by its ``lens_kind``; with one other
    reading, ``mode`` defaults to ``"side"`` (this reading above), with more to ``"three"``.

    Args:
        reading: a :class:`~jlens_core.reading.prompt_reading.PromptReading`.
        stat: the colour (:meth:`PromptReading.grid`'s statistics).
        others: ``{lens name: PromptReading}`` of the same prompt through other lenses.
        mode: as :func:`heatmap_figure` (default: this lens alone, ``"side"`` or ``"three"``).
        options: the rest of :func:`heatmap_figure`'s options (``layers``, ``hover_k``, ``selected``, ...).

    Raises:
        ValueError: two readings under one lens name (name them through ``others``' keys).
    """
    name = str(reading.lens_kind)
    readings = {name: reading}
    for other_name, other in (others or {}).items():
        if other_name in readings:
            raise ValueError(f"Two readings are named {other_name!r}: key the others by another lens name.")
        readings[other_name] = other
    names = list(readings)
    if mode is None:
        mode = name if len(names) == 1 else "side" if len(names) == 2 else "three"
    if mode in ("side", "diff") and "pair" not in options:
        options["pair"] = (names[0], names[1])
    return heatmap_figure(readings, mode, stat, **options)


def cell_from_point(point: Mapping[str, Any], layers: Sequence[int]) -> tuple[int, int] | None:
    """``(layer, position)`` of a clicked cell marker (``x`` = position, ``y`` = row index)."""
    try:
        x, y = point.get("x"), point.get("y")
        row, position = round(float(y)), round(float(x))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if not 0 <= row < len(layers):
        return None
    return int(layers[row]), position


__all__ = ["MAX_HOVER_CELLS", "MAX_TEXT_CELLS", "MODES", "PLOT_WIDTH_PX", "cell_from_point", "heatmap_figure",
           "hover_texts", "mark_unstable", "marks_of", "panel_names", "reading_figure", "shade_unfitted", "stat_values",
           "text_chars"]
