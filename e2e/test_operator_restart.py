"""Crash safety and high availability of the operator process.

* SIGKILL in the middle of reconciling a batch, then a restart: everything converges, because
  every reconcile is level-based and idempotent (no state outside the cluster).
* Two replicas with ``--leader-elect``: one holds the Lease and works, the other stands by
  (answering liveness); when the leader is SIGKILLed the standby takes over within the lease
  duration and converges new work.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import yaml

from e2e.harness.cluster import Cluster
from e2e.harness.operator import (
    OperatorProcess,
    embedding_service,
    get_json,
    install_rbac,
    start_operator,
    wait_condition,
)
from e2e.harness.proc import poll_until

# The server pods here only need to be Running and Ready: kwok's fake nodes make them so.
pytestmark = pytest.mark.kwok

MODEL = {"name": "sentence-transformers/all-MiniLM-L6-v2"}


def test_sigkill_mid_reconcile_then_restart_converges(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    operator = start_operator(cluster, tmp_path)
    try:
        names = [f"crash-{i}" for i in range(8)]
        cluster.apply(
            "\n---\n".join(
                yaml.safe_dump(
                    embedding_service(
                        n, {"model": MODEL, "replicas": 2, "autoscaling": {"enabled": i % 2 == 0}}
                    )
                )
                for i, n in enumerate(names)
            ),
            namespace=namespace,
        )
        # Kill as soon as the operator has started writing children, not after it finished.
        poll_until(
            lambda: (get_json(cluster, "deployments", "-n", namespace) or {}).get("items"),
            timeout=60,
            what="the first Deployment",
            interval=0.05,
        )
        operator.kill()
        converged = [
            n
            for n in names
            if (get_json(cluster, "embsvc", n, "-n", namespace) or {})
            .get("status", {})
            .get("readyReplicas")
            == 2
        ]
        assert len(converged) < len(names), "killed too late to test anything"

        operator.start()
        operator.wait_live()
        for name in names:
            wait_condition(cluster, namespace, name, "Ready", "True", timeout=120)
        assert len((get_json(cluster, "deployments", "-n", namespace) or {})["items"]) == 8
    finally:
        operator.stop()


@pytest.fixture
def system_namespace(cluster: Cluster) -> str:

    return cluster.create_namespace(f"embedding-operator-ha-{secrets.token_hex(3)}")


def _holder(cluster: Cluster, namespace: str) -> str | None:
    lease = get_json(cluster, "lease", "embedding-operator", "-n", namespace)
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or None


def test_leader_election_failover(
    cluster: Cluster, namespace: str, system_namespace: str, tmp_path: Path
) -> None:
    kubeconfig = install_rbac(cluster, system_namespace)
    timing = [
        "--leader-elect",
        "--lease-namespace",
        system_namespace,
        "--lease-duration-seconds",
        "6",
        "--renew-deadline-seconds",
        "4",
        "--retry-period-seconds",
        "1",
    ]
    first, second = (
        OperatorProcess(
            cluster, kubeconfig, tmp_path, name=name, extra_args=[*timing, "--identity", name]
        )
        for name in ("replica-a", "replica-b")
    )
    first.start()
    try:
        poll_until(
            lambda: _holder(cluster, system_namespace) == "replica-a",
            timeout=60,
            what="replica-a to lead",
        )
        second.start()
        second.wait_live()  # the standby answers liveness while it waits
        cluster.apply(embedding_service("svc-under-a", {"model": MODEL}), namespace=namespace)
        wait_condition(cluster, namespace, "svc-under-a", "Ready", "True")
        assert _holder(cluster, system_namespace) == "replica-a"
        # The standby did no work. (The name has letters no hex suffix has: an earlier "ha-1"
        # matched the lease namespace embedding-operator-ha-1da220 in the standby's log.)
        assert "svc-under-a" not in second.log_text()

        first.kill()
        poll_until(
            lambda: _holder(cluster, system_namespace) == "replica-b",
            timeout=30,
            what="replica-b to take over",
        )
        cluster.apply(embedding_service("svc-under-b", {"model": MODEL}), namespace=namespace)
        wait_condition(cluster, namespace, "svc-under-b", "Ready", "True")

        # A clean shutdown releases the lease: the next candidate need not wait it out.
        second.stop()
        lease = get_json(cluster, "lease", "embedding-operator", "-n", system_namespace)
        assert lease is not None and not lease["spec"].get("holderIdentity")
    finally:
        first.stop()
        second.stop()
