"""The admin charts' SVG (admin/charts.py) and the latency buckets
(loops/stats.py), without a database: scales, empty data, one point, huge
values, escaping, and percentiles from bucket counts."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from flask_solidloop.admin import charts
from flask_solidloop.loops import stats

SVG = "{http://www.w3.org/2000/svg}"
START = datetime(2026, 12, 1, tzinfo=UTC)


def hours(n):
    return [START + timedelta(hours=i) for i in range(n)]


def parse(markup):
    return ET.fromstring(str(markup).replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ',
                                             1))


def bars(root):
    return [r for r in root.iter(f"{SVG}rect") if "ch-bar" in r.get("class", "")]


@pytest.mark.parametrize(("value", "ceiling"), [
    (0, 1), (-3, 1), (0.3, 0.5), (1, 1), (7, 10), (11, 20), (21, 25), (26, 50),
    (999, 1000), (1001, 2000), (3.2e12, 5e12), (float("inf"), 1)])
def test_the_scale_rounds_up_to_a_nice_number(value, ceiling):
    assert charts.nice_ceiling(value) == pytest.approx(ceiling)


def test_bar_heights_follow_the_scale():
    root = parse(charts.render("c", "Turns", hours(4), [charts.Line("t", [0, 5, 10, 7])]))
    assert root.get("data-max") == "10"
    heights = [float(b.get("height")) for b in bars(root)]
    assert len(heights) == 3  # no bar for zero
    assert heights[1] == pytest.approx(charts.PLOT_H)  # 10 of 10: the full plot
    assert heights[0] == pytest.approx(charts.PLOT_H / 2)
    assert heights[2] == pytest.approx(charts.PLOT_H * 0.7)
    for bar in bars(root):  # inside the plot
        y, h = float(bar.get("y")), float(bar.get("height"))
        assert y >= charts.TOP - 1e-6 and y + h <= charts.TOP + charts.PLOT_H + 1e-6


def test_stacked_bars_sum_to_the_hours_total():
    root = parse(charts.render("c", "Tokens", hours(2), [charts.Line("in", [30, 0]),
                                                          charts.Line("out", [20, 5])]))
    assert root.get("data-max") == "50"
    first = [b for b in bars(root) if float(b.get("x")) < charts.LEFT + charts.PLOT_W / 2]
    assert sum(float(b.get("height")) for b in first) == pytest.approx(charts.PLOT_H)
    assert {b.get("class") for b in first} == {"ch-bar ch-s0", "ch-bar ch-s1"}


def test_empty_data_says_so_and_draws_no_bar():
    for n in (0, 24):
        root = parse(charts.render("c", "Turns", hours(n), [charts.Line("t", [0] * n)]))
        assert not bars(root)
        assert "no data in this range" in "".join(root.itertext())
    root = parse(charts.render("c", "Latency", hours(3), [charts.Line("p50", [None] * 3)],
                               kind="lines"))
    assert not list(root.iter(f"{SVG}circle"))


def test_a_single_point_is_drawn():
    root = parse(charts.render("c", "Turns", hours(1), [charts.Line("t", [3])]))
    (bar,) = bars(root)
    assert float(bar.get("width")) > charts.PLOT_W / 2
    line = parse(charts.render("c", "Latency", hours(24),
                               [charts.Line("p50", [None] * 23 + [1200.0])], kind="lines",
                               unit="ms"))
    (dot,) = line.iter(f"{SVG}circle")
    assert not list(line.iter(f"{SVG}polyline"))  # one point: no line to draw
    assert "1.2 s" in "".join(dot.itertext())


def test_huge_values_keep_short_labels_and_stay_in_the_plot():
    huge = [1.0, 4.2e12, 9.9e14]
    root = parse(charts.render("c", "Tokens", hours(3), [charts.Line("t", huge)]))
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "ch-axis"]
    assert "1000T" in labels and all(len(label) <= 6 for label in labels)
    for bar in bars(root):
        assert float(bar.get("y")) >= charts.TOP - 1e-6
    assert charts.compact(1234) == "1.2k" and charts.compact(5_600_000) == "5.6M"
    assert charts.compact(0.0042, "$") == "$0.0042" and charts.compact(12.5, "$") == "$12.50"
    assert charts.compact(2500, "ms") == "2.5 s" and charts.compact(None) == "none"


def test_titles_and_names_are_escaped_and_the_svg_is_labelled():
    markup = str(charts.render("c", "<b>x</b>", hours(1), [charts.Line("<i>", [1])],
                               summary="a & b"))
    assert "<b>" not in markup and "<i>" not in markup and "style=" not in markup
    root = parse(markup)
    assert root.get("role") == "img" and root.get("aria-labelledby") == "c-t c-d"
    assert root.find(f"{SVG}title").text == "<b>x</b>"
    assert root.find(f"{SVG}desc").text == "a & b"


def test_the_x_axis_labels_hours_over_a_day_and_days_over_a_week():
    below = re.compile(rf'class="ch-axis" x="[\d.]+" y="{charts.HEIGHT - 6}"')
    day = str(charts.render("c", "t", hours(24), [charts.Line("t", [1] * 24)]))
    assert len(below.findall(day)) == 4  # 00, 06, 12, 18
    week = str(charts.render("c", "t", hours(168), [charts.Line("t", [1] * 168)]))
    assert len(below.findall(week)) == 7


def test_buckets_match_postgresql_width_bucket_and_percentiles_come_from_them():
    bounds = stats.LATENCY_BOUNDS_MS
    assert stats.bucket_of(0) == 0 and stats.bucket_of(bounds[0]) == 1
    assert stats.bucket_of(bounds[-1] * 10) == len(bounds)
    counts = [0] * stats.BUCKETS
    values = [100.0] * 50 + [1000.0] * 45 + [30_000.0] * 5
    for ms in values:
        counts[stats.bucket_of(ms)] += 1
    ratio = 2 ** 0.25
    for q, exact in ((0.5, 100.0), (0.95, 1000.0), (0.99, 30_000.0)):
        found = stats.percentile(counts, q)
        assert exact / ratio <= found <= exact * ratio
    assert stats.percentile([0] * stats.BUCKETS, 0.5) is None
    assert math.isclose(stats.bucket_value(5) ** 2, bounds[4] * bounds[5])


def test_charts_for_a_series_name_every_failure_class():
    points = [stats.Figures() for _ in range(24)]
    points[3] = stats.Figures(llm_turns=2, cost=Decimal("0.5"), failures={"infra:http": 2})
    points[3].latency[stats.bucket_of(800)] = 2
    total = stats.Figures()
    for p in points:
        total.add(p)
    series = stats.Series("24h", None, hours(24), points, total, None, START)
    found = {c.id: c for c in charts.charts_for(series, ["agent", "infra:http"])}
    assert found["chart-failures"].legend == [("ch-s0", "infra:http")]
    assert "2 failed loops in the last 24 hours: infra:http 2" in found["chart-failures"].summary
    assert "$0.50" in found["chart-cost"].summary
    assert "p50 8" in found["chart-latency"].summary
