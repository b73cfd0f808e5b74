"""Fixtures for tier-2 tests against a real local control plane (see e2e/harness/cluster.py).

Every test collected under e2e/ is marked ``e2e``. The binaries are built (or taken from the
cache) when the first test asks for ``cluster``; a build failure or a missing binary is an
error, never a skip: CI must not go green without the cluster tier.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.harness.binaries import Binaries, ensure_binaries
from e2e.harness.cluster import REAL_NODE_TAINT, Cluster
from e2e.harness.images import ImageSet, build_images, load_images
from e2e.harness.node import containerd_store

log = logging.getLogger("e2e.conftest")

E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in item.path.resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def e2e_binaries() -> Binaries:
    """Every control-plane binary, built from e2e/tools on first use (cold: ~20 min on 2 cores)."""
    return ensure_binaries()


@pytest.fixture(scope="session")
def e2e_images() -> ImageSet:
    """The operator, server and pause images, built locally (cold: ~10 min; warm: cached)."""
    return build_images()


@pytest.fixture(scope="session")
def cluster(
    e2e_binaries: Binaries, e2e_images: ImageSet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """The running control plane, shared by the whole session.

    Its real node carries ``REAL_NODE_TAINT``, so only the real-node tests, which tolerate it,
    start real pods there; the other tests' pods land on kwok's fake nodes as before.

    While it runs, ``KUBECONFIG`` points at its admin kubeconfig and our kubectl/helm come
    first on ``PATH`` in ``os.environ``, so plain ``subprocess.run(["kubectl", ...])`` and
    libraries that read KUBECONFIG (kopf, the kubernetes client) talk to it.
    """
    instance = Cluster(
        e2e_binaries,
        tmp_path_factory.mktemp("cluster"),
        node_taints=[REAL_NODE_TAINT],
        image_loader=lambda socket: load_images(socket, e2e_images, store=containerd_store()),
    )
    with pytest.MonkeyPatch.context() as patch:
        instance.start()
        try:
            for key, value in instance.env().items():
                if os.environ.get(key) != value:
                    patch.setenv(key, value)
            yield instance
        finally:
            instance.stop()


def _namespace_name(node_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", node_name.lower()).strip("-")[:40].rstrip("-")
    return f"{base or 'test'}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (named after the test) whose default ServiceAccount exists; deleted
    afterwards without waiting for its finalization (the cluster dies with the session)."""
    name = cluster.create_namespace(_namespace_name(request.node.name))
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
