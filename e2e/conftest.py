"""Fixtures for tier-2 tests: the harness's local cluster, or an existing one.

Every test collected under e2e/ is marked ``e2e``. By default the tests run on the harness's own
cluster (e2e/harness/cluster/): the binaries are built (or taken from the cache) when the first
test asks for ``cluster``, and a build failure or a missing binary is an error, never a skip:
CI must not go green without the cluster tier. Nothing is skipped in this mode; the ``gpu``
tests (examples served on real GPUs) are deselected, and the report's header says so.

With ``E2E_KUBECONFIG`` set (existing.py, e2e/README.md) the tests run on that cluster instead,
with the images the settings name; nothing is built or loaded. Tests marked ``local_node`` or
``kwok`` are skipped there with the reason, ``metrics_pipeline`` ones where the cluster has
no custom metrics API, and ``keda`` ones where it has no KEDA (or the settings no Prometheus
address for KEDA's triggers).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import subprocess
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.binaries import Binaries, ensure_binaries
from e2e.harness.cluster import REAL_NODE_TAINT, Cluster, KubeClient
from e2e.harness.diagnostics import namespace_report
from e2e.harness.existing import (
    SKIP_REASONS,
    ExistingCluster,
    SettingsError,
    custom_metrics_missing,
    keda_missing,
)
from e2e.harness.images import ImageSet, build_images, load_images
from e2e.harness.node import containerd_store
from e2e.harness.object_store import ObjectStore, start_object_store, stop_object_store
from e2e.harness.operator import OperatorProcess, start_operator

log = logging.getLogger("e2e.conftest")

E2E_DIR = Path(__file__).resolve().parent
EXISTING = pytest.StashKey[ExistingCluster | None]()


def pytest_configure(config: pytest.Config) -> None:
    try:
        config.stash[EXISTING] = ExistingCluster.from_env()
    except SettingsError as exc:
        raise pytest.UsageError(str(exc)) from exc


def pytest_report_header(config: pytest.Config) -> list[str]:
    existing = config.stash.get(EXISTING, None)
    if existing is None:
        return [
            "e2e: the harness's local cluster; `gpu` tests deselected (its GPU nodes are "
            "kwok's; run them with E2E_KUBECONFIG, e2e/README.md)"
        ]
    return [
        f"e2e: {existing.describe()}",
        f"e2e: skipped here: {', '.join(SKIP_REASONS)} tests; metrics_pipeline tests where "
        "the cluster has no custom metrics API",
    ]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test that fails in its own namespace reports what a person would look at there:
    describe output, events and the pods' logs (a section of its failure report)."""
    report = yield
    funcargs = getattr(item, "funcargs", {})
    cluster, namespace = funcargs.get("cluster"), funcargs.get("namespace")
    if report.when == "call" and report.failed and isinstance(namespace, str) and cluster:
        try:
            text = namespace_report(cluster, namespace)
        # The report must never hide the failure it explains (a dead API server, a hung kubectl).
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
            text = f"(could not describe {namespace}: {exc!r})"
        report.sections.append((f"kubectl diagnostics of {namespace}", text))
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    existing = config.stash.get(EXISTING, None)
    deselected = []
    kept = []
    for item in items:
        if E2E_DIR not in item.path.resolve().parents:
            kept.append(item)
            continue
        item.add_marker(pytest.mark.e2e)
        if existing is None and item.get_closest_marker("gpu") is not None:
            deselected.append(item)
            continue
        if existing is not None:
            for marker, reason in SKIP_REASONS.items():
                if item.get_closest_marker(marker) is not None:
                    item.add_marker(pytest.mark.skip(reason=reason))
                    break
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(scope="session")
def e2e_existing(request: pytest.FixtureRequest) -> ExistingCluster | None:
    """The existing cluster's settings (E2E_KUBECONFIG), or None on the local cluster."""
    return request.config.stash[EXISTING]


@pytest.fixture(scope="session")
def e2e_binaries() -> Binaries:
    """Every control-plane binary, built from e2e/tools on first use (cold: ~20 min on 2 cores)."""
    return ensure_binaries()


@pytest.fixture(scope="session")
def e2e_images(e2e_existing: ExistingCluster | None) -> ImageSet:
    """The operator, server, e2e client and pause images: built locally (cold: ~10 min;
    warm: cached), or on an existing cluster the ones its settings name (never built)."""
    if e2e_existing is not None:
        return e2e_existing.images
    return build_images()


@pytest.fixture(scope="session")
def chart_values(e2e_existing: ExistingCluster | None) -> dict[str, Any]:
    """Values every ``helm install`` of the chart takes: none on the local cluster (the
    chart's default images are the ones it built); the images and E2E_HELM_VALUES on an
    existing one."""
    return {} if e2e_existing is None else e2e_existing.chart_values()


@pytest.fixture(scope="session")
def cluster(
    e2e_existing: ExistingCluster | None,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[KubeClient]:
    """The cluster, shared by the whole session: the harness's running local ``Cluster``, or
    a ``KubeClient`` for the existing one.

    The local cluster's real node carries ``REAL_NODE_TAINT``, so only the real-node tests,
    which tolerate it, start real pods there; the other tests' pods land on kwok's fake nodes.

    While it runs, ``KUBECONFIG`` points at its kubeconfig and its kubectl/helm come first on
    ``PATH`` in ``os.environ``, so plain ``subprocess.run(["kubectl", ...])`` and libraries
    that read KUBECONFIG (kopf, the kubernetes client) talk to it.
    """
    with pytest.MonkeyPatch.context() as patch:
        if e2e_existing is not None:
            client = e2e_existing.client(tmp_path_factory.mktemp("existing-cluster"))
            for key, value in client.env().items():
                if os.environ.get(key) != value:
                    patch.setenv(key, value)
            yield client
            return
        binaries: Binaries = request.getfixturevalue("e2e_binaries")
        images: ImageSet = request.getfixturevalue("e2e_images")
        instance = Cluster(
            binaries,
            tmp_path_factory.mktemp("cluster"),
            node_taints=[REAL_NODE_TAINT],
            image_loader=lambda socket: load_images(socket, images, store=containerd_store()),
        )
        instance.start()
        try:
            for key, value in instance.env().items():
                if os.environ.get(key) != value:
                    patch.setenv(key, value)
            yield instance
        finally:
            instance.stop()


@pytest.fixture(scope="session")
def object_store(cluster: KubeClient) -> Iterator[ObjectStore]:
    """The S3-compatible store on the host (object_store.py), started by the first test that
    takes it and stopped at the end of the session: the others never pay for it. Only on the
    local cluster (the tests that take it are ``local_node``)."""
    if not isinstance(cluster, Cluster):
        pytest.skip("the object store runs beside the harness's own cluster only")
    store = start_object_store(cluster)
    log.info(
        "object store at %s (pods: %s), up in %.1fs",
        store.url,
        store.pod_url,
        store.started_seconds,
    )
    yield store
    stop_object_store(cluster, store)


@pytest.fixture(scope="module")
def operator(
    cluster: KubeClient, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """One operator process (:func:`start_operator`) for the tests of a module that take
    ``operator``, its log in a folder named after the module."""
    module = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    process = start_operator(cluster, tmp_path_factory.mktemp(f"{module}-operator"))
    yield process
    process.stop()


@pytest.fixture(autouse=True)
def _metrics_pipeline_present(
    request: pytest.FixtureRequest, e2e_existing: ExistingCluster | None
) -> None:
    """On an existing cluster, a ``metrics_pipeline`` test is skipped when the cluster cannot
    serve the queue gauges to HPAs (the local cluster always runs its own pipeline)."""
    if e2e_existing is None or request.node.get_closest_marker("metrics_pipeline") is None:
        return
    client: KubeClient = request.getfixturevalue("cluster")
    reason = custom_metrics_missing(client)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _keda_present(request: pytest.FixtureRequest, e2e_existing: ExistingCluster | None) -> None:
    """On an existing cluster, a ``keda`` test is skipped when the cluster has no KEDA or the
    settings give its triggers no Prometheus (the local cluster runs both)."""
    if e2e_existing is None or request.node.get_closest_marker("keda") is None:
        return
    client: KubeClient = request.getfixturevalue("cluster")
    reason = keda_missing(client, e2e_existing.chart_values())
    if reason is not None:
        pytest.skip(reason)


def _namespace_name(node_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", node_name.lower()).strip("-")[:40].rstrip("-")
    return f"{base or 'test'}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(cluster: KubeClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (named after the test) whose default ServiceAccount exists; deleted
    afterwards without waiting for its finalization (the cluster dies with the session)."""
    name = cluster.create_namespace(_namespace_name(request.node.name))
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
