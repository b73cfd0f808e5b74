"""An S3 store for unit tests: moto's server in a thread on 127.0.0.1 (a free port).

The e2e tier uses a real S3-compatible server instead; moto is for the fast tier only.
``environment`` is what a client (pyarrow.fs, a subprocess) needs: the standard AWS
variables with dummy credentials and the endpoint.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.fs as pafs
from moto.server import ThreadedMotoServer


@dataclass(frozen=True)
class S3Store:
    endpoint: str

    @property
    def environment(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            # No instance-metadata lookups: the credentials are the variables above.
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def filesystem(self) -> pafs.S3FileSystem:
        host = self.endpoint.removeprefix("http://")
        return pafs.S3FileSystem(
            access_key="testing",
            secret_key="testing",
            region="us-east-1",
            endpoint_override=host,
            scheme="http",
            allow_bucket_creation=True,
        )

    def new_bucket(self) -> str:
        """A new empty bucket's name (moto's state is per process: each test takes its own)."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.filesystem().create_dir(name)
        return name

    def keys(self, bucket: str) -> list[str]:
        """Every object key in ``bucket`` (folder markers left out)."""
        selector = pafs.FileSelector(bucket, recursive=True)
        return sorted(
            info.path.removeprefix(f"{bucket}/")
            for info in self.filesystem().get_file_info(selector)
            if info.type == pafs.FileType.File
        )


@contextlib.contextmanager
def moto_s3() -> Iterator[S3Store]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Store(f"http://{host}:{port}")
    finally:
        server.stop()
