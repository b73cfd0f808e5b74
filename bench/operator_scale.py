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

Every pod of the benchmark lands on kwok's fake CPU nodes, written for the run with room for
``--count`` pods: the real node is tainted as the e2e session taints it, so no real server
starts on this machine (60 real MiniLM servers starved a 2-core control plane once), and the
figures are the operator's and the control plane's, not the servers'.

Usage: ``python -m bench.operator_scale [--count 100] [--single 5] [--json FILE]``
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import yaml
from embedding_operator.kube import KubeCluster
from kubernetes import config as kube_config

from bench import out_dir
from e2e.harness.binaries import ensure_binaries
from e2e.harness.cluster import REAL_NODE_TAINT, Cluster
from e2e.harness.operator import OperatorProcess, embedding_service, get_json
from e2e.harness.proc import poll_until

MODEL = {"name": "sentence-transformers/all-MiniLM-L6-v2"}
PODS_PER_NODE = 250
PROGRESS_EVERY_S = 5.0


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


def run(cluster: Cluster, workdir: Path, count: int, single: int, resync: float) -> dict[str, Any]:
    operator = OperatorProcess(
        cluster,
        cluster.kubeconfig,
        workdir,
        extra_args=["--resync-seconds", str(resync), "--log-level", "warning"],
    )
    operator.start()
    operator.wait_live()
    assert operator.process is not None
    pid = operator.process.pid
    results: dict[str, Any] = {"rss_idle_mib": round(_rss_mib(pid), 1)}

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
    cpu_before = _cpu_s(pid)
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
    results["batch"] = {
        "count": count,
        "create_s": round(applied, 2),
        "all_deployments_s": round(children, 2),
        "all_ready_s": round(time.monotonic() - started, 2),
        "operator_cpu_s": round(_cpu_s(pid) - cpu_before, 2),
    }
    results["rss_after_batch_mib"] = round(_rss_mib(pid), 1)

    # Idle: after a full resync window, nothing should have been written.
    before = _resource_versions(cluster, batch_ns)
    cpu_before = _cpu_s(pid)
    time.sleep(resync * 1.5 + 1)  # a measurement window, not a wait for a condition
    after = _resource_versions(cluster, batch_ns)
    results["idle_resync"] = {
        "window_s": resync * 1.5 + 1,
        "objects_rewritten": sum(1 for k, v in after.items() if before.get(k) != v),
        "operator_cpu_s": round(_cpu_s(pid) - cpu_before, 2),
    }
    results["operator_alive_at_end"] = operator.alive()
    operator.stop()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--single", type=int, default=5)
    parser.add_argument(
        "--resync", type=float, default=30.0, help="operator --resync-seconds during the run"
    )
    parser.add_argument("--json", type=Path, default=out_dir() / "operator.json")
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
        ) as cluster:
            startup = time.monotonic() - started
            try:
                results = run(cluster, workdir, args.count, args.single, args.resync)
            finally:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                logs = sorted(workdir.glob("embedding-operator-*.log"))
                args.json.with_suffix(".log").write_text(
                    "".join(p.read_text(errors="replace") for p in logs)
                )
    results["cluster_startup_s"] = round(startup, 1)
    results["machine"] = {
        "cpus": psutil.cpu_count(),
        "mem_gib": round(psutil.virtual_memory().total / 2**30, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    single = results["apply_to_ready_s"]
    batch = results["batch"]
    print(f"\napply -> Ready (one):  median {single['median']}s, max {single['max']}s")
    print(
        f"{batch['count']} at once -> all Deployments written: "
        f"{batch['all_deployments_s']}s, all Ready: {batch['all_ready_s']}s "
        f"({batch['count'] / batch['all_ready_s']:.1f}/s), operator CPU "
        f"{batch['operator_cpu_s']}s"
    )
    print(
        f"operator RSS: idle {results['rss_idle_mib']} MiB, after batch "
        f"{results['rss_after_batch_mib']} MiB"
    )
    print(f"idle resync: {results['idle_resync']['objects_rewritten']} objects rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
