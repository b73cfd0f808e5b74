"""Benchmark the operator on the local control plane (not a test; prints figures).

Measures, with the real ``embedding-operator run`` subprocess against the e2e control plane
(etcd + kube-apiserver + controller-manager + scheduler + kwok fake nodes):

1. apply -> Ready: seconds from ``kubectl apply`` of one EmbeddingService to its Ready
   condition for the current generation (median and max over ``--single`` runs). This includes
   the Deployment controller, the scheduler and kwok marking the pod ready, i.e. what a user
   waits for, minus the image pull and model load that a fake node skips.
2. 100 at once: seconds from creating ``--count`` EmbeddingServices (16 client threads) until
   the operator has written every Deployment, and until every one is Ready (the difference is
   the controller-manager, scheduler and kwok working through 100 ReplicaSets and pods).
3. Operator resident memory (psutil RSS) at idle, after converging the batch, and the CPU
   seconds the operator burned for the batch; then writes during an idle resync window
   (should be zero: nothing changed, nothing written).
4. Where the batch's time goes: the Kubernetes API calls per reconcile (reads, writes) and the
   work queue's latency, from the operator's own /metrics; the CPU of the operator, the
   kube-apiserver and etcd; and the API server's request latency by verb
   (``apiserver_request_duration_seconds``, from its /metrics). The operator's calls are
   counted for the reconciles alone: the leader Lease and Events are shown apart.
5. With ``--failover``: a second replica stands by (leader election on both), the leader is
   SIGKILLed once the batch is idle, and the figures are the seconds until the standby holds
   the Lease (against the lease duration), until it has reconciled every EmbeddingService
   (its reconcile count reaches their number with its queue empty), the API calls it made
   for that, and how many objects it rewrote (target: none).

Every pod of the benchmark lands on kwok's fake CPU nodes, written for the run with room for
``--count`` pods: the real node is tainted as the e2e session taints it, so no real server
starts on this machine (60 real MiniLM servers starved a 2-core control plane once), and the
figures are the operator's and the control plane's, not the servers'.

Usage: ``python -m bench.operator_scale [--count 100] [--single 5] [--workers 16] [--failover]
[--json FILE]``
(starts a cluster of its own, real node included, so not beside another cluster of the e2e
harness: ``make cluster-up``'s or a running e2e session's).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import yaml
from embedding_operator.kube import KubeCluster
from kubernetes import config as kube_config
from prometheus_client.parser import text_string_to_metric_families

from bench import out_dir, write_results
from e2e.harness.binaries import ensure_binaries
from e2e.harness.cluster import REAL_NODE_TAINT, Cluster
from e2e.harness.operator import OperatorProcess, embedding_service, get_json
from e2e.harness.proc import poll_until

MODEL = {"name": "sentence-transformers/all-MiniLM-L6-v2"}
PODS_PER_NODE = 250
PROGRESS_EVERY_S = 5.0
LEASE = {"duration": 15.0, "renew": 10.0, "retry": 2.0}  # the operator's defaults
READ_VERBS = ("get", "list")
# Not part of a reconcile: the leader Lease's renewals and the Events posted on transitions.
BESIDE_RECONCILES = ("leases", "events")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# --- metrics ----------------------------------------------------------------------------------


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text page: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def operator_metrics(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse_metrics(response.read().decode())


def apiserver_metrics(cluster: Cluster) -> Samples:
    """The API server's own /metrics, read as the cluster admin; only the families we use
    (the page is tens of megabytes of series at 1,000 services)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    keep = ("apiserver_request_duration_seconds", "apiserver_request_total")
    return parse_metrics("\n".join(line for line in text.splitlines() if line.startswith(keep)))


def delta(after: Samples, before: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(samples: Samples, name: str, **match: str | Iterable[str]) -> float:
    """Sum of ``name``'s samples whose labels match (a string, or any of several)."""

    def ok(labels: dict[str, str]) -> bool:
        for key, want in match.items():
            have = labels.get(key, "")
            if have != want if isinstance(want, str) else have not in want:
                return False
        return True

    return sum(v for (n, labels), v in samples.items() if n == name and ok(dict(labels)))


def histogram(samples: Samples, name: str, **match: str | Iterable[str]) -> dict[str, float]:
    """Count, mean and p50/p99 (the upper bound of the bucket they fall in) of a histogram's
    delta, summed over the series that match."""
    count = total(samples, f"{name}_count", **match)
    if not count:
        return {"count": 0}
    buckets: dict[float, float] = {}
    for (n, labels), value in samples.items():
        le = dict(labels).get("le")
        if n == f"{name}_bucket" and le is not None:
            rest = {k: v for k, v in labels if k != "le"}
            if all(
                (rest.get(k, "") == w if isinstance(w, str) else rest.get(k, "") in w)
                for k, w in match.items()
            ):
                buckets[float(le)] = buckets.get(float(le), 0.0) + value

    def quantile(q: float) -> float:
        for le in sorted(buckets):
            if buckets[le] >= q * count:
                return le
        return float("inf")

    return {
        "count": int(count),
        "mean_s": round(total(samples, f"{name}_sum", **match) / count, 4),
        "p50_le_s": quantile(0.5),
        "p99_le_s": quantile(0.99),
    }


def api_calls(samples: Samples, reconciles: float) -> dict[str, Any]:
    """The operator's API requests in a window: per reconcile, reads and writes; the Lease and
    Events apart; by verb and resource."""
    name = "embedding_operator_api_requests_total"
    by: dict[str, int] = {}
    for (n, labels), value in samples.items():
        if n == name and value:
            lab = dict(labels)
            key = f"{lab['verb']} {lab['resource']}"
            by[key] = by.get(key, 0) + int(value)
    resources = sorted({key.split(" ", 1)[1] for key in by})
    ours = [r for r in resources if r not in BESIDE_RECONCILES]
    writes_verbs = sorted({key.split(" ", 1)[0] for key in by} - set(READ_VERBS))
    reads = total(samples, name, verb=READ_VERBS, resource=ours)
    writes = total(samples, name, verb=writes_verbs, resource=ours)
    errors = total(samples, name, code="<error>") + sum(
        v
        for (n, labels), v in samples.items()
        if n == name and dict(labels).get("code", "").startswith("5")
    )
    return {
        "reconciles": int(reconciles),
        "reads": int(reads),
        "writes": int(writes),
        "reads_per_reconcile": round(reads / reconciles, 2) if reconciles else None,
        "writes_per_reconcile": round(writes / reconciles, 2) if reconciles else None,
        "lease_and_events": int(total(samples, name, resource=BESIDE_RECONCILES)),
        "failed": int(errors),
        "by_verb_resource": dict(sorted(by.items(), key=lambda kv: -kv[1])),
    }


def reconciles_of(samples: Samples) -> float:
    return total(samples, "controller_runtime_reconcile_total")


def apiserver_summary(samples: Samples) -> dict[str, Any]:
    """Requests the API server served in a window, and their latency by verb (WATCH and
    CONNECT excluded: long-running by design)."""
    name = "apiserver_request_duration_seconds"
    verbs = sorted(
        {dict(labels)["verb"] for (n, labels), _ in samples.items() if n == f"{name}_count"}
        - {"WATCH", "CONNECT"}
    )
    return {
        "requests": int(total(samples, "apiserver_request_total", verb=verbs)),
        "latency_by_verb": {
            verb: h for verb in verbs if (h := histogram(samples, name, verb=verb))["count"]
        },
    }


def _component_cpu_s(cluster: Cluster) -> dict[str, float]:
    out = {}
    for process in cluster.processes:
        if process.name in ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler"):
            try:
                out[process.name] = _cpu_s(process.pid)
            except psutil.NoSuchProcess:
                continue
    return out


def _lease_holder(cluster: Cluster) -> str | None:
    lease = get_json(cluster, "lease", "embedding-operator", "-n", "default")
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or None


def fake_cpu_nodes(count: int, path: Path) -> Path:
    """A nodes file of kwok CPU nodes with room for ``count`` server pods (each node takes
    ``PODS_PER_NODE``, with CPU and memory to spare for the default pod's requests)."""
    nodes = []
    for i in range(count // PODS_PER_NODE + 1):
        name = f"bench-cpu-{i}"
        capacity = {
            "cpu": str(PODS_PER_NODE * 8),
            "memory": f"{PODS_PER_NODE * 32}Gi",
            "pods": str(PODS_PER_NODE),
            "ephemeral-storage": "10Ti",
        }
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                    "labels": {
                        "type": "kwok",
                        "kubernetes.io/arch": "amd64",
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/hostname": name,
                    },
                },
                "status": {"capacity": capacity, "allocatable": capacity},
            }
        )
    path.write_text(yaml.safe_dump_all(nodes))
    return path


class Progress:
    """Prints ``what: n/total`` at most every few seconds while a wait runs."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.started, self.last = what, total, time.monotonic(), 0.0

    def __call__(self, done: int) -> bool:
        now = time.monotonic()
        if done == self.total or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            print(f"  {self.what}: {done}/{self.total} at {now - self.started:.1f}s", flush=True)
        return done == self.total


def _ready_names(cluster: Cluster, namespace: str) -> set[str]:
    listing = get_json(cluster, "embsvc", "-n", namespace) or {}
    ready = set()
    for item in listing.get("items") or []:
        for cond in (item.get("status") or {}).get("conditions") or []:
            if (
                cond["type"] == "Ready"
                and cond["status"] == "True"
                and cond.get("observedGeneration") == item["metadata"]["generation"]
            ):
                ready.add(item["metadata"]["name"])
    return ready


def _rss_mib(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _resource_versions(cluster: Cluster, namespace: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind in ("embsvc", "deployments", "services"):
        for item in (get_json(cluster, kind, "-n", namespace) or {}).get("items") or []:
            out[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return out


def _operator(
    cluster: Cluster, workdir: Path, resync: float, workers: int, identity: str | None
) -> OperatorProcess:
    args = ["--resync-seconds", str(resync), "--log-level", "warning", "--workers", str(workers)]
    if identity is not None:
        args += [
            "--leader-elect",
            "--identity",
            identity,
            "--lease-namespace",
            "default",
            "--lease-duration-seconds",
            str(LEASE["duration"]),
            "--renew-deadline-seconds",
            str(LEASE["renew"]),
            "--retry-period-seconds",
            str(LEASE["retry"]),
        ]
    return OperatorProcess(
        cluster, cluster.kubeconfig, workdir, name=identity or "embedding-operator", extra_args=args
    )


def run(
    cluster: Cluster,
    workdir: Path,
    count: int,
    single: int,
    resync: float,
    *,
    workers: int = 16,
    failover: bool = False,
) -> dict[str, Any]:
    operator = _operator(cluster, workdir, resync, workers, "replica-a" if failover else None)
    operator.start()
    operator.wait_live()
    if failover:
        poll_until(lambda: _lease_holder(cluster) == "replica-a", timeout=60, what="a leads")
    assert operator.process is not None
    pid = operator.process.pid
    results: dict[str, Any] = {"rss_idle_mib": round(_rss_mib(pid), 1), "workers": workers}

    ns = cluster.create_namespace(f"bench-single-{int(time.time())}")
    latencies = []
    for i in range(single):
        started = time.monotonic()
        cluster.apply(embedding_service(f"one-{i}", {"model": MODEL}), namespace=ns)
        poll_until(
            lambda n=f"one-{i}": n in _ready_names(cluster, ns),
            timeout=120,
            what=f"one-{i} Ready",
            interval=0.05,
            max_interval=0.1,
        )
        latencies.append(time.monotonic() - started)
    results["apply_to_ready_s"] = {
        "median": round(statistics.median(latencies), 2),
        "max": round(max(latencies), 2),
        "runs": single,
    }

    batch_ns = cluster.create_namespace(f"bench-batch-{int(time.time())}")
    # Created from 16 threads: a sequential `kubectl apply` of 100 documents takes about a
    # minute here by itself and would measure kubectl, not the operator.
    api = KubeCluster(kube_config.new_client_from_config(str(cluster.kubeconfig)))
    manifests = []
    for i in range(count):
        manifest = embedding_service(f"svc-{i:03d}", {"model": MODEL})
        manifest["metadata"]["namespace"] = batch_ns
        manifests.append(manifest)
    ops_before = operator_metrics(operator.metrics_port)
    server_before = apiserver_metrics(cluster)
    components_before = _component_cpu_s(cluster)
    cpu_before = _cpu_s(pid)
    load_before = psutil.getloadavg()[0]
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(api.create, manifests))
    applied = time.monotonic() - started
    print(f"created {count} EmbeddingServices in {applied:.1f}s", flush=True)
    # The operator's share: every Deployment written (the rest is controllers + scheduler).
    written = Progress("Deployments written", count)
    poll_until(
        lambda: written(
            len((get_json(cluster, "deployments", "-n", batch_ns) or {}).get("items") or [])
        ),
        timeout=900,
        what=f"{count} Deployments",
        interval=0.5,
        max_interval=1.0,
    )
    children = time.monotonic() - started
    ready = Progress("EmbeddingServices Ready", count)
    poll_until(
        lambda: ready(len(_ready_names(cluster, batch_ns))),
        timeout=900,
        what=f"{count} EmbeddingServices Ready",
        interval=0.5,
        max_interval=1.0,
    )
    wall = time.monotonic() - started
    load_after = psutil.getloadavg()[0]
    operator_cpu = _cpu_s(pid) - cpu_before
    ops = delta(operator_metrics(operator.metrics_port), ops_before)
    components_after = _component_cpu_s(cluster)
    results["batch"] = {
        "count": count,
        "create_s": round(applied, 2),
        "all_deployments_s": round(children, 2),
        "all_ready_s": round(wall, 2),
        "operator_cpu_s": round(operator_cpu, 2),
        "operator_cores": round(operator_cpu / wall, 2),
        # The machine is shared: what else ran shows here (1-minute load, start and end).
        "load_average": [round(load_before, 1), round(load_after, 1)],
        "component_cores": {
            name: round((cpu - components_before.get(name, 0.0)) / wall, 2)
            for name, cpu in components_after.items()
        },
        "api_calls": api_calls(ops, reconciles_of(ops)),
        "queue_wait": histogram(ops, "workqueue_queue_duration_seconds"),
        "reconcile_time": histogram(ops, "controller_runtime_reconcile_time_seconds"),
        "operator_request_latency": histogram(
            ops, "embedding_operator_api_request_duration_seconds"
        ),
        "apiserver": apiserver_summary(delta(apiserver_metrics(cluster), server_before)),
    }
    results["rss_after_batch_mib"] = round(_rss_mib(pid), 1)

    # Idle: after a full resync window, nothing should have been written.
    before = _resource_versions(cluster, batch_ns)
    ops_before = operator_metrics(operator.metrics_port)
    cpu_before = _cpu_s(pid)
    time.sleep(resync * 1.5 + 1)  # a measurement window, not a wait for a condition
    after = _resource_versions(cluster, batch_ns)
    ops = delta(operator_metrics(operator.metrics_port), ops_before)
    results["idle_resync"] = {
        "window_s": resync * 1.5 + 1,
        "objects_rewritten": sum(1 for k, v in after.items() if before.get(k) != v),
        "operator_cpu_s": round(_cpu_s(pid) - cpu_before, 2),
        "api_calls": api_calls(ops, reconciles_of(ops)),
    }
    results["operator_alive_at_end"] = operator.alive()
    if failover:
        results["failover"] = _failover(cluster, workdir, operator, batch_ns, count + single)
    operator.stop()
    return results


def _failover(
    cluster: Cluster, workdir: Path, leader: OperatorProcess, batch_ns: str, services: int
) -> dict[str, Any]:
    """SIGKILL the converged leader with a standby waiting; how long until the standby leads
    and has reconciled every EmbeddingService, and what it wrote doing so."""
    extra = leader.extra_args
    standby = _operator(
        cluster,
        workdir,
        float(extra[extra.index("--resync-seconds") + 1]),
        int(extra[extra.index("--workers") + 1]),
        "replica-b",
    )
    standby.start()
    standby.wait_live()  # the standby answers liveness while it waits
    before = _resource_versions(cluster, batch_ns)
    print("failover: killing the leader (replica-a)", flush=True)
    leader.kill()
    killed = time.monotonic()
    poll_until(
        lambda: _lease_holder(cluster) == "replica-b",
        timeout=LEASE["duration"] * 4,
        what="replica-b to take over",
        interval=0.2,
    )
    leading = time.monotonic() - killed
    print(f"failover: replica-b holds the Lease after {leading:.1f}s", flush=True)

    def reconciled() -> float:
        try:
            ops = operator_metrics(standby.metrics_port)
        except OSError:
            return 0.0
        depth = total(ops, "workqueue_depth")
        done = total(ops, "controller_runtime_reconcile_total")
        return done if depth == 0 else 0.0

    progress = Progress("reconciled by replica-b", services)
    poll_until(
        lambda: progress(min(services, int(reconciled()))),
        timeout=900,
        what=f"replica-b to reconcile {services} EmbeddingServices",
        interval=0.5,
        max_interval=1.0,
    )
    converged = time.monotonic() - killed
    ops = operator_metrics(standby.metrics_port)
    after = _resource_versions(cluster, batch_ns)
    assert standby.process is not None
    result = {
        "lease_duration_s": LEASE["duration"],
        "retry_period_s": LEASE["retry"],
        "lease_taken_s": round(leading, 2),
        "all_reconciled_s": round(converged, 2),
        "objects_rewritten": sum(1 for k, v in after.items() if before.get(k) != v),
        "objects_checked": len(before),
        "api_calls": api_calls(ops, reconciles_of(ops)),
        "child_writes": int(total(ops, "embedding_operator_child_writes_total")),
        "standby_rss_mib": round(_rss_mib(standby.process.pid), 1),
    }
    standby.stop()
    return result


def report(results: dict[str, Any]) -> None:
    """The figures against their targets."""
    single = results["apply_to_ready_s"]
    batch = results["batch"]
    n = batch["count"]
    scale = n / 1000  # the targets are for 1,000 services
    print(f"\napply -> Ready (one):  median {single['median']}s, max {single['max']}s")
    print(
        f"{n} at once -> all Deployments written: {batch['all_deployments_s']}s "
        f"(target <= {30 * scale:.0f}s), all Ready: {batch['all_ready_s']}s "
        f"(target <= {60 * scale:.0f}s; {n / batch['all_ready_s']:.1f}/s)"
    )
    print(
        f"operator RSS: idle {results['rss_idle_mib']} MiB, after batch "
        f"{results['rss_after_batch_mib']} MiB (target <= 200 MiB)"
    )
    idle = results["idle_resync"]
    print(
        f"idle resync: {idle['objects_rewritten']} objects rewritten, "
        f"{idle['api_calls']['writes']} operator writes (target 0)"
    )
    calls = batch["api_calls"]
    print(
        f"API calls per reconcile (batch, {calls['reconciles']} reconciles, "
        f"{calls['reconciles'] / n:.1f} per service): reads {calls['reads_per_reconcile']}, "
        f"writes {calls['writes_per_reconcile']}; Lease + Events {calls['lease_and_events']}; "
        f"failed {calls['failed']}"
    )
    print(f"  by verb and resource: {calls['by_verb_resource']}")
    cores = ", ".join(f"{k} {v}" for k, v in sorted(batch["component_cores"].items()))
    print(
        f"CPU over the batch (cores of {psutil.cpu_count()}): operator "
        f"{batch['operator_cores']} ({batch['operator_cpu_s']}s), {cores}; "
        f"load average {batch['load_average'][0]} -> {batch['load_average'][1]}"
    )
    wait, rec, lat = batch["queue_wait"], batch["reconcile_time"], batch["operator_request_latency"]
    print(
        f"work queue wait: mean {wait.get('mean_s')}s, p99 <= {wait.get('p99_le_s')}s; "
        f"reconcile: mean {rec.get('mean_s')}s, p99 <= {rec.get('p99_le_s')}s; "
        f"operator's API request: mean {lat.get('mean_s')}s, p99 <= {lat.get('p99_le_s')}s"
    )
    server = batch["apiserver"]
    print(f"kube-apiserver over the batch: {server['requests']} requests (all clients)")
    for verb, h in server["latency_by_verb"].items():
        print(
            f"  {verb}: {h['count']} requests, mean {h['mean_s']}s, "
            f"p50 <= {h['p50_le_s']}s, p99 <= {h['p99_le_s']}s"
        )
    if "failover" in results:
        f = results["failover"]
        print(
            f"failover: standby held the Lease {f['lease_taken_s']}s after the leader's "
            f"SIGKILL (lease duration {f['lease_duration_s']}s, retry {f['retry_period_s']}s); "
            f"all reconciled after {f['all_reconciled_s']}s; objects rewritten "
            f"{f['objects_rewritten']} of {f['objects_checked']} (target 0); "
            f"its API calls: {f['api_calls']['reads']} reads, {f['api_calls']['writes']} "
            f"writes over {f['api_calls']['reconciles']} reconciles"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--single", type=int, default=5)
    parser.add_argument(
        "--resync", type=float, default=30.0, help="operator --resync-seconds during the run"
    )
    parser.add_argument(
        "--workers", type=int, default=16, help="operator --workers (reconcile threads)"
    )
    parser.add_argument(
        "--failover",
        action="store_true",
        help="leader election on; after the batch, SIGKILL the leader and time the standby",
    )
    parser.add_argument("--json", type=Path, default=out_dir() / "operator_scale.json")
    args = parser.parse_args()
    # A stopped run (kill, timeout) tears its cluster down as a finished one does: SystemExit
    # unwinds through the Cluster's context manager, which leaves no process, mount, bridge
    # or chain behind (a SIGTERM would otherwise end Python without running it).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        workdir = Path(tmp)
        started = time.monotonic()
        nodes = fake_cpu_nodes(args.count + args.single, workdir / "nodes.yaml")
        with Cluster(
            ensure_binaries(),
            workdir / "cluster",
            nodes_file=nodes,
            node_taints=[REAL_NODE_TAINT],
            keda=False,
        ) as cluster:
            startup = time.monotonic() - started
            try:
                results = run(
                    cluster,
                    workdir,
                    args.count,
                    args.single,
                    args.resync,
                    workers=args.workers,
                    failover=args.failover,
                )
            finally:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                logs = sorted(
                    [*workdir.glob("embedding-operator-*.log"), *workdir.glob("replica-*.log")]
                )
                args.json.with_suffix(".log").write_text(
                    "".join(p.read_text(errors="replace") for p in logs)
                )
    results["cluster_startup_s"] = round(startup, 1)
    write_results("operator_scale", results, path=args.json)
    print(json.dumps(results, indent=2))
    report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
