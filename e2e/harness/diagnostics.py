"""What a person would look at when an e2e test fails: describe output, events and logs.

`namespace_report` is what the conftest attaches to every failed test that ran in a test
namespace, and what the real-node tests print for the namespaces they spread over."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from e2e.harness.cluster import KubeClient
from e2e.harness.operator import get_json

LOG_TAIL_LINES = 60
NODE_DESCRIBE_CHARS = 4000
# KEDA's processes on the local cluster (components.KedaOperator, KedaMetricsServer).
KEDA_PROCESSES = ("keda-operator", "keda-metrics-apiserver")
KEDA_LOG_LINES = 12


def namespace_report(cluster: KubeClient, *namespaces: str) -> str:
    """Describe, events and logs of every pod in ``namespaces``, and the nodes they run on
    (every node when none is scheduled: why does none take them?)."""
    parts: list[str] = []
    nodes: set[str] = set()
    for ns in namespaces:
        for args in (
            ("get", "embeddingservices,deploy,rs,pods,svc,endpointslices,hpa", "-o", "wide"),
            ("describe", "embeddingservices,deploy,pods,hpa"),
            # Apart: a cluster without the EmbeddingJob CRD fails only these two.
            ("get", "embeddingjobs,jobs", "-o", "wide"),
            ("describe", "embeddingjobs,jobs"),
            ("get", "events", "--sort-by=.lastTimestamp"),
        ):
            out = cluster.kubectl(*args, "-n", ns, check=False)
            parts.append(f"$ kubectl {' '.join(args)} -n {ns}\n{out.stdout}{out.stderr}")
        listing = get_json(cluster, "pods", "-n", ns) or {}
        for pod in listing.get("items", []):
            name = pod["metadata"]["name"]
            nodes.add(pod["spec"].get("nodeName") or "")
            out = cluster.kubectl(
                "logs", "-n", ns, name, "--all-containers", f"--tail={LOG_TAIL_LINES}", check=False
            )
            parts.append(f"$ kubectl logs -n {ns} {name}\n{out.stdout}{out.stderr}")
    names = sorted(nodes - {""}) or [
        n["metadata"]["name"] for n in (get_json(cluster, "nodes") or {}).get("items", [])
    ]
    for node_name in names:
        out = cluster.kubectl("describe", "node", node_name, check=False)
        parts.append(f"$ kubectl describe node {node_name}\n{out.stdout[-NODE_DESCRIBE_CHARS:]}")
    return "\n\n".join(parts)


def keda_report(cluster: KubeClient, namespace: str) -> str:
    """Why KEDA may not have acted on ``namespace``'s ScaledObjects, short enough to travel in
    an exception's message: each ScaledObject's conditions (with KEDA's reason and message),
    and, on the local cluster, whether KEDA's two processes still run and the last warning and
    error lines of their logs."""
    lines: list[str] = []
    listing = get_json(cluster, "scaledobjects", "-n", namespace) or {}
    for item in listing.get("items", []):
        conditions = (item.get("status") or {}).get("conditions") or []
        shown = "; ".join(
            f"{c.get('type')}={c.get('status')} ({c.get('reason')}: {c.get('message')})"
            for c in conditions
        )
        lines.append(f"scaledobject {item['metadata']['name']}: {shown or 'no conditions yet'}")
    if not listing.get("items"):
        lines.append(f"no ScaledObject in {namespace}")
    for component in getattr(cluster, "components", ()):
        process = getattr(component, "process", None)
        if getattr(component, "name", None) not in KEDA_PROCESSES or process is None:
            continue
        if process.alive():
            state = "running"
        else:
            state = f"exited (code {process.popen.returncode if process.popen else '?'})"
        tail = process.log_tail(400).splitlines()
        flagged = [line for line in tail if _is_warning(line)][-KEDA_LOG_LINES:]
        lines.append(f"{component.name}: {state}; log {process.log_path}")
        lines.extend(f"  {line[:400]}" for line in (flagged or tail[-KEDA_LOG_LINES:]))
    return "\n".join(lines)


def _is_warning(line: str) -> bool:
    """A KEDA log line at warning level or above: the operator's zap lines (JSON, or console
    with ``--zap-encoder=console``) name the level early; klog's (the metrics server's) start
    with W, E or F and the date."""
    head = line[:160].lower()
    marks = ('"level":"error"', '"level":"warn"', "\terror\t", "\twarn\t", "panic", "fatal")
    return any(mark in head for mark in marks) or (line[:1] in "WEF" and line[1:5].isdigit())


@contextmanager
def explained(report: Callable[[], str]) -> Iterator[None]:
    """A deadline or assertion that fails inside carries ``report()`` in its message, where CI
    shows it beside the traceback rather than in the long captured output."""
    try:
        yield
    except (TimeoutError, AssertionError) as exc:
        raise type(exc)(f"{exc}\n{report()}") from exc
