"""Server-rendered SVG charts for the dashboard and the agent pages: hourly
bars (stacked when a chart has several series) and lines, drawn in Python as
markup the page embeds; no script, no build, nothing the strict CSP refuses
(colours are classes in admin.css, shapes are presentation attributes).

Each chart carries a ``<title>`` and a ``<desc>`` summing it up in words, and
each bar or point a ``<title>`` with its hour and value (a tooltip, and what a
screen reader reads); the page shows the totals as text beside it.
:func:`charts_for` turns a :class:`loops.stats.Series` into the page's charts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from markupsafe import Markup, escape

from ..loops import stats

# About the size a card draws it at (so 11 px text stays about 11 px).
WIDTH = 340
HEIGHT = 150
LEFT = 50
RIGHT = 6
TOP = 8
BOTTOM = 20
PLOT_W = WIDTH - LEFT - RIGHT
PLOT_H = HEIGHT - TOP - BOTTOM


@dataclass(frozen=True)
class Line:
    """One series: its name (the legend) and a value per point (None: no value)."""

    name: str
    values: Sequence[float | None]


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    svg: Markup
    #: What the chart shows, in words (also the SVG's ``<desc>``).
    summary: str
    legend: list[tuple[str, str]]


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= value (1 for <= 0)."""
    if not value or value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * power >= value * (1 - 1e-12):
            return float(step * power)
    return float(10 * power)  # not reached


def compact(value: float | None, unit: str = "") -> str:
    """A short label: 950, 1.2k, 3.4M, 5.6G, 7.8T; money with ``unit='$'``."""
    if value is None:
        return "none"
    if unit == "$":
        if abs(value) >= 1000:
            return "$" + compact(value)
        return f"${value:,.2f}" if abs(value) >= 0.1 or value == 0 else f"${value:.4f}"
    if unit == "ms":
        return f"{value / 1000:.1f} s" if value >= 1000 else f"{value:.0f} ms"
    sign = "-" if value < 0 else ""
    value = abs(value)
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            scaled = value / limit
            text = f"{scaled:.1f}".rstrip("0").rstrip(".") if scaled < 100 else f"{scaled:.0f}"
            return f"{sign}{text}{suffix}"
    if value == int(value):
        return f"{sign}{int(value)}"
    return f"{sign}{value:.2f}".rstrip("0").rstrip(".")


def _hour_label(at: datetime, many: bool) -> str:
    return at.strftime("%a %d" if many else "%H:%M")


def _x_ticks(hours: Sequence[datetime]) -> list[int]:
    """Which points get a label: every 6 hours over a day, midnight over a week."""
    many = len(hours) > 48
    if many:
        return [i for i, h in enumerate(hours) if h.hour == 0]
    return [i for i, h in enumerate(hours) if h.hour % 6 == 0]


def render(chart_id: str, title: str, hours: Sequence[datetime], lines: Sequence[Line], *,
           kind: str = "bars", unit: str = "", summary: str = "") -> Markup:
    """The SVG of one chart: stacked bars (``kind="bars"``) or lines over
    ``hours`` (one value per hour in each line)."""
    n = len(hours)
    many = n > 48
    if kind == "bars":
        tops = [sum(v or 0 for v in (line.values[i] for line in lines)) for i in range(n)]
    else:
        tops = [max((line.values[i] or 0 for line in lines), default=0) for i in range(n)]
    peak = max((t for t in tops if math.isfinite(t)), default=0.0)
    top = nice_ceiling(peak)
    scale = PLOT_H / top
    slot = PLOT_W / n if n else PLOT_W
    parts = [f'<svg class="ch" id="{escape(chart_id)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'role="img" aria-labelledby="{escape(chart_id)}-t {escape(chart_id)}-d" '
             f'data-max="{top:g}" data-points="{n}">',
             f'<title id="{escape(chart_id)}-t">{escape(title)}</title>',
             f'<desc id="{escape(chart_id)}-d">{escape(summary)}</desc>']
    for fraction in (0.0, 0.5, 1.0):
        y = TOP + PLOT_H - fraction * PLOT_H
        parts.append(f'<line class="ch-grid" x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" '
                     f'y2="{y:.1f}"/>')
        parts.append(f'<text class="ch-axis" x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{escape(compact(top * fraction, unit))}</text>')
    for i in _x_ticks(hours):
        x = LEFT + (i + 0.5) * slot
        parts.append(f'<text class="ch-axis" x="{x:.1f}" y="{HEIGHT - 6}" text-anchor="middle">'
                     f'{escape(_hour_label(hours[i], many))}</text>')
    if peak <= 0:
        parts.append(f'<text class="ch-empty" x="{LEFT + PLOT_W / 2:.1f}" '
                     f'y="{TOP + PLOT_H / 2:.1f}" text-anchor="middle">'
                     'no data in this range</text>')
    elif kind == "bars":
        gap = min(1.0, slot * 0.15)
        for i in range(n):
            base = 0.0
            for s, line in enumerate(lines):
                value = line.values[i] or 0
                if value <= 0:
                    continue
                height = value * scale
                y = TOP + PLOT_H - (base + value) * scale
                base += value
                parts.append(
                    f'<rect class="ch-bar ch-s{s % 8}" x="{LEFT + i * slot + gap / 2:.2f}" '
                    f'y="{y:.2f}" '
                    f'width="{max(slot - gap, 0.5):.2f}" height="{max(height, 0.5):.2f}">'
                    f'<title>{escape(_hour_label(hours[i], True))} '
                    f'{escape(hours[i].strftime("%H:%M"))}: {escape(line.name)} '
                    f'{escape(compact(value, unit))}</title></rect>')
    else:
        for s, line in enumerate(lines):
            points = [(LEFT + (i + 0.5) * slot, TOP + PLOT_H - (v * scale), i, v)
                      for i, v in enumerate(line.values) if v is not None]
            if len(points) > 1:
                path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in points)
                parts.append(f'<polyline class="ch-line ch-s{s % 8}" points="{path}"/>')
            for x, y, i, v in points:
                parts.append(f'<circle class="ch-dot ch-s{s % 8}" cx="{x:.1f}" cy="{y:.1f}" '
                             'r="2.5">'
                             f'<title>{escape(_hour_label(hours[i], True))} '
                             f'{escape(hours[i].strftime("%H:%M"))}: {escape(line.name)} '
                             f'{escape(compact(v, unit))}</title></circle>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _chart(chart_id: str, title: str, hours: Sequence[datetime], lines: list[Line],
           summary: str, **kwargs: Any) -> Chart:
    return Chart(chart_id, title, render(chart_id, title, hours, lines, summary=summary,
                                         **kwargs),
                 summary, [(f"ch-s{i % 8}", line.name) for i, line in enumerate(lines)])


def _peak(hours: Sequence[datetime], values: Sequence[float | None],
          fmt: Callable[[float | None], str]) -> str:
    known = [(v, h) for v, h in zip(values, hours, strict=True) if v]
    if not known:
        return ""
    value, hour = max(known, key=lambda pair: pair[0])
    return f"; peak {fmt(value)} in the hour from {hour:%a %H:%M}"


def charts_for(series: stats.Series, classes: Sequence[str]) -> list[Chart]:
    """The page's charts for one range: turns, failures by class, tokens,
    cost, and the p50/p95 turn latency, one point per hour."""
    hours, points, total = series.hours, series.points, series.total
    span = "the last 24 hours" if series.range == "24h" else "the last 7 days"
    llm = [float(p.llm_turns) for p in points]
    tools = [float(p.tool_turns) for p in points]
    found = [c for c in classes if total.failures.get(c)] + sorted(
        c for c in total.failures if c not in classes and total.failures[c])
    failed = [Line(c, [float(p.failures.get(c, 0)) for p in points]) for c in found]
    cost = [float(p.cost) for p in points]
    p50 = [p.percentile(0.5) for p in points]
    p95 = [p.percentile(0.95) for p in points]
    by_class = ", ".join(f"{c} {total.failures[c]}" for c in found) or "none"
    return [
        _chart("chart-turns", "Turns per hour", hours,
               [Line("LLM turns", llm), Line("tool turns", tools)],
               f"{total.llm_turns} LLM turns and {total.tool_turns} tool turns in {span}"
               + _peak(hours, llm, compact)),
        _chart("chart-failures", "Failed loops per hour, by class", hours,
               failed or [Line("failed", [0.0] * len(hours))],
               f"{total.failed} failed loop{'' if total.failed == 1 else 's'} in {span}: "
               f"{by_class}"),
        _chart("chart-tokens", "Tokens per hour", hours,
               [Line("input", [float(p.input_tokens) for p in points]),
                Line("output", [float(p.output_tokens) for p in points])],
               f"{compact(total.input_tokens)} input and {compact(total.output_tokens)} "
               f"output tokens in {span}"),
        _chart("chart-cost", "Cost per hour", hours, [Line("cost", cost)],
               f"{compact(float(total.cost), '$')} in {span}"
               + _peak(hours, cost, lambda v: compact(v, "$")), unit="$"),
        _chart("chart-latency", "LLM turn latency per hour (p50, p95)", hours,
               [Line("p50", p50), Line("p95", p95)],
               f"p50 {compact(total.percentile(0.5), 'ms')}, p95 "
               f"{compact(total.percentile(0.95), 'ms')} over {span}", kind="lines", unit="ms"),
    ]

