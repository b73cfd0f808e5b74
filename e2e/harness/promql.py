"""The chart's dashboard panels and alert rules as PromQL queries against a real Prometheus.

Grafana cannot run here (AGPL), so the e2e tier checks what Grafana would show by running each
panel's queries, with the dashboard's variables filled in for one service, and each recording
rule and alert signal, against the e2e cluster's Prometheus (which scrapes the server and
operator pods and evaluates the chart's rules). ``render_dashboard`` draws the same panels'
series with matplotlib: the picture in docs/monitoring.md comes from it.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.images.refs import CHART_DIR

DASHBOARD_FILE = CHART_DIR / "files" / "dashboards" / "embedding-operator.json"
RULES_FILE = CHART_DIR / "files" / "rules.yaml"
RATE_INTERVAL = "1m"
"""What ``$__rate_interval`` stands for: several scrapes at the e2e Prometheus's 2 s interval."""
QUERY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Query:
    """One PromQL expression the chart ships, and where it comes from."""

    source: str
    """``panel <title>``, ``record <name>`` or ``alert <name>``."""
    expr: str
    legend: str = ""
    per_service: bool = True
    """Whether its series carry ``namespace`` and ``service`` (operator-wide ones do not)."""


def dashboard_queries(namespace: str, service: str) -> list[tuple[str, list[Query]]]:
    """Each panel's title and its queries, with the dashboard's variables set to one service."""
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    values = {
        "$__rate_interval": RATE_INTERVAL,
        "$namespace": namespace,
        "$service": service,
    }
    panels = []
    for panel in dashboard["panels"]:
        queries = []
        for target in panel.get("targets") or []:
            expr = str(target["expr"])
            per_service = "$service" in expr
            for variable, value in values.items():
                expr = expr.replace(variable, value)
            queries.append(
                Query(
                    f"panel {panel['title']!r}",
                    expr,
                    str(target.get("legendFormat", "")),
                    per_service=per_service,
                )
            )
        if queries:
            panels.append((str(panel["title"]), queries))
    return panels


def rule_queries() -> list[Query]:
    """Every recording rule (by its name) and every alert's signal (its expression without the
    threshold: it returns a series for every loaded service whether or not the alert fires)."""
    rules = yaml.safe_load(RULES_FILE.read_text())
    queries = [
        Query(
            f"record {r['record']}",
            r["record"],
            per_service=not r["record"].startswith("controller:"),
        )
        for r in rules["records"]
    ]
    queries += [
        Query(f"alert {a['alert']}", a["signal"], per_service="controller:" not in a["signal"])
        for a in rules["alerts"]
    ]
    return queries


def query(prometheus_url: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector (raises on a PromQL error)."""
    return _get(prometheus_url, "/api/v1/query", {"query": expr})


def query_range(
    prometheus_url: str, expr: str, start: float, end: float, step: float
) -> list[dict[str, Any]]:
    return _get(
        prometheus_url,
        "/api/v1/query_range",
        {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
    )


def _get(prometheus_url: str, path: str, params: Mapping[str, str]) -> list[dict[str, Any]]:
    url = f"{prometheus_url}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{params.get('query')}: {body.get('error')}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def missing_series(
    prometheus_url: str, queries: list[Query], namespace: str, service: str
) -> list[str]:
    """The queries that return no series for the service (or, operator-wide ones, none at
    all), each with its source."""
    missing = []
    for q in queries:
        series = query(prometheus_url, q.expr)
        if q.per_service:
            series = [
                s
                for s in series
                if s["metric"].get("namespace", namespace) == namespace
                and s["metric"].get("service", service) == service
            ]
        if not series:
            missing.append(f"{q.source}: {q.expr}")
    return missing


def render_dashboard(
    prometheus_url: str, namespace: str, service: str, start: float, end: float, path: Path
) -> Path:
    """Draw every panel's series over ``[start, end]`` into one PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard_queries(namespace, service)
    columns = 3
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(15, 3.2 * rows), squeeze=False)
    step = max(2.0, (end - start) / 200)
    for ax, (title, queries) in zip(axes.flat, panels, strict=False):
        for q in queries:
            for series in query_range(prometheus_url, q.expr, start, end, step):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                finite = [(t, v) for t, v in points if math.isfinite(v)]
                if not finite:
                    continue
                label = _legend(q.legend, series["metric"]) or q.expr[:40]
                ax.plot([t for t, _ in finite], [v for _, v in finite], label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds", fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    figure.suptitle(f"embedding-operator dashboard: {namespace}/{service} (e2e Prometheus)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return path


def _legend(template: str, labels: Mapping[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value).replace("{{ " + key + " }}", value)
    return out
