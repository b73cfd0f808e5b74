"""A real ``embedding-server gateway`` process on a free loopback port, for the tests that
put it in front of real ``embedding-server serve`` processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import httpx

from e2e.harness.proc import free_port
from tests.support.api import SCRIPT, wait_for


class GatewayProcess:
    """The gateway lists its models with their ready endpoints (``--models-listing full``)
    unless ``args`` say otherwise: the tests wait on those counts."""

    def __init__(self, args: list[str]) -> None:
        if not any(a.startswith("--models-listing") for a in args):
            args = [*args, "--models-listing", "full"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_GATEWAY_")}
        self.process = subprocess.Popen(
            [SCRIPT, "gateway", "--port", str(self.port), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def output(self) -> str:
        return self.process.stdout.read() if self.process.stdout else ""

    def start(self) -> GatewayProcess:
        def ready() -> bool:
            assert self.process.poll() is None, self.output()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(self.url + "/ready", timeout=2).status_code == 200
            return False

        wait_for(ready, timeout=30, interval=0.05, what=f"{self.url}/ready")
        return self

    def ready_endpoints(self) -> dict[str, int]:
        models = httpx.get(self.url + "/v1/models", timeout=5).json()["data"]
        return {m["id"]: m["ready_endpoints"] for m in models}

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()


@contextlib.contextmanager
def gateway_process(args: list[str]) -> Iterator[GatewayProcess]:
    gateway = GatewayProcess(args)
    try:
        yield gateway.start()
    finally:
        gateway.stop()
