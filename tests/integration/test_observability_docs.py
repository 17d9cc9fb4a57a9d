"""The shipped alert rules load in a real Prometheus's promtool, and the rules,
the Grafana dashboard and the metric table of docs/guides/observability.md
name only metrics the package (or dramatiq's middleware) defines, and the
table names them all."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from flask_solidloop.runtime import metrics as runtime_metrics
from flask_solidloop.telemetry import metrics

from ..support.prometheus import promtool

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "prometheus" / "solidloop-rules.yml"
DASHBOARD = ROOT / "docs" / "grafana" / "solidloop.json"
GUIDE = ROOT / "docs" / "guides" / "observability.md"
NAME = re.compile(r"\b((?:solidloop|dramatiq)_[a-z_]+)")
SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def defined() -> set[str]:
    """Every metric name the package exposes: our instruments (from their
    definitions), the fleet collector's gauges, dramatiq's middleware's."""
    instruments = Path(metrics.__file__).read_text()
    ours = {metrics.PREFIX + name for name in re.findall(
        r'(?:counter|histogram)\(\s*"(\w+)"', instruments)}
    fleet = set(re.findall(r'GaugeMetricFamily\(\s*"(\w+)"',
                           Path(runtime_metrics.__file__).read_text()))
    from dramatiq.middleware import prometheus

    theirs = {base(name) for name in re.findall(r'"(dramatiq_\w+)"',
                                                Path(prometheus.__file__).read_text())
              if not name.startswith("dramatiq_prom_")}  # its environment variables
    assert len(ours) >= 15 and len(fleet) >= 4 and len(theirs) >= 5, (ours, fleet, theirs)
    return ours | fleet | theirs


def base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_promtool_checks_the_rules():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 8 rules found" in done.stdout


def test_rules_and_dashboard_name_only_defined_metrics():
    known = defined()
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert 6 <= len(rules) <= 8
    exprs = [rule["expr"] for rule in rules]
    dashboard = json.loads(DASHBOARD.read_text())
    exprs += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    named = {base(name) for expr in exprs for name in NAME.findall(expr)}
    assert named, exprs
    assert named <= known, named - known
    # The dashboard shows the figures an operator asks for first.
    for wanted in ("solidloop_llm_turns", "solidloop_llm_cost_usd",
                   "solidloop_queue_oldest_due_age_seconds", "solidloop_workers"):
        assert wanted in named


def test_the_guide_documents_every_metric():
    known = defined()
    table = [line for line in GUIDE.read_text().splitlines() if line.startswith("| `")]
    documented = {base(name) for line in table for name in NAME.findall(line.split("|")[1])}
    assert documented == known, (known - documented, documented - known)
