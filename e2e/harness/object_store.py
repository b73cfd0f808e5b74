"""A real S3-compatible object store on the host, for the tests that read and write corpora.

versitygw (github.com/versity/versitygw, Apache-2.0; built from the Go module pinned in
e2e/versions.env like the other cluster components) serves the S3 API over a directory:
each top-level folder is a bucket, each file below it an object. It listens on 127.0.0.1,
where the tests reach it, and on the node IP, where the real node's pods reach it through
their default route, as they reach the apiserver and CoreDNS (node.py).

It is started lazily, by the first test that takes the ``object_store`` fixture (conftest.py),
as a component of the session's cluster: its log is ``versitygw.log`` in the cluster's log
directory (every request, one line each), a start that fails or passes its deadline fails with
that log's tail, and it is stopped, and its directory removed, at the end of the session, or
with the cluster. A test that does not take the fixture pays nothing.

Clients use pyarrow.fs (the library the worker uses): ``filesystem()`` on the host, and the
standard AWS variables (``pod_env``, or a Secret of them, ``credentials_secret``) in pods.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e2e.harness import node
from e2e.harness.components import Component
from e2e.harness.probes import http_get
from e2e.harness.proc import free_port

if TYPE_CHECKING:
    import pyarrow.fs

    from e2e.harness.cluster.context import ClusterContext

REGION = "us-east-1"
HEALTH_PATH = "/health"
START_TIMEOUT_S = 60.0


@dataclass(eq=False)
class VersityGateway(Component):
    """``versitygw posix DIR`` with one root user. Ready: ``GET /health`` answers 200."""

    name = "versitygw"

    binary: Path
    _: KW_ONLY
    data_dir: Path
    port: int
    access_key: str
    secret_key: str

    @property
    def url(self) -> str:
        """Where the host reaches it."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pod_url(self) -> str:
        """Where the real node's pods reach it."""
        return f"http://{node.NODE_IP}:{self.port}"

    def prepare(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        # The credentials by environment, so they are in no process listing.
        return {
            **os.environ,
            "ROOT_ACCESS_KEY_ID": self.access_key,
            "ROOT_SECRET_ACCESS_KEY": self.secret_key,
        }

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            "--port",
            f"127.0.0.1:{self.port}",
            "--port",
            f"{node.NODE_IP}:{self.port}",
            "--region",
            REGION,
            "--health",
            HEALTH_PATH,
            "posix",
            str(self.data_dir),
        ]

    def healthy(self) -> bool:
        return http_get(self.url + HEALTH_PATH, None) is not None


@dataclass(frozen=True)
class ObjectStore:
    """A running store: its addresses, credentials and log, and clients for it."""

    gateway: VersityGateway
    started_seconds: float

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def pod_url(self) -> str:
        return self.gateway.pod_url

    @property
    def access_key(self) -> str:
        return self.gateway.access_key

    @property
    def secret_key(self) -> str:
        return self.gateway.secret_key

    def filesystem(self) -> pyarrow.fs.S3FileSystem:
        """pyarrow's S3 filesystem on the store, from the host; paths are ``bucket/key``."""
        import pyarrow.fs

        return pyarrow.fs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            endpoint_override=self.url,
            region=REGION,
            scheme="http",
            allow_bucket_creation=True,
            allow_bucket_deletion=True,
        )

    def create_bucket(self, prefix: str = "e2e") -> str:
        """A new, empty bucket named ``<prefix>-<random>``; its name."""
        name = f"{prefix}-{secrets.token_hex(4)}"
        self.filesystem().create_dir(name)
        return name

    def pod_env(self) -> dict[str, str]:
        """The standard AWS variables that point a pod's S3 client at the store."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.pod_url,
        }

    def credentials_secret(self, name: str, namespace: str) -> dict[str, Any]:
        """A Secret with the keys an EmbeddingJob's ``credentialsSecret`` names."""
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "type": "Opaque",
            "stringData": {
                "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key,
            },
        }

    def log_tail(self, lines: int = 40) -> str:
        """The last requests and messages of the store, for a failure report."""
        return self.gateway.running().log_tail(lines)


def start_object_store(cluster: ClusterContext) -> ObjectStore:
    """Start the store as the cluster's next component (bounded wait for its health path)."""
    started = time.monotonic()
    gateway = VersityGateway(
        cluster.launcher,
        cluster.binaries.versitygw,
        data_dir=cluster.workdir / "object-store",
        port=free_port(),
        access_key=f"e2e{secrets.token_hex(8)}",
        secret_key=secrets.token_urlsafe(30),
        timeout=START_TIMEOUT_S,
    )
    cluster.start_component(gateway)
    return ObjectStore(gateway, time.monotonic() - started)


def stop_object_store(cluster: ClusterContext, store: ObjectStore) -> None:
    """Stop the store before the rest of the cluster, and remove its objects (its log stays)."""
    try:
        cluster.stop_component(store.gateway)
    finally:
        shutil.rmtree(store.gateway.data_dir, ignore_errors=True)
