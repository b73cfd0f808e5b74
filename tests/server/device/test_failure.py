"""A fatal device error ends the server instead of failing every later batch behind a green
readiness probe.

After a CUDA device-side assert or an illegal memory access the CUDA context is poisoned: every
later forward pass fails too. Kubernetes only restarts a pod whose process exits or whose
liveness probe fails, so such an error must drop readiness and exit non-zero. The GPU cannot
be broken here; the fake model's ``device_error_after`` raises the error torch raises.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import torch
from embedding_server.device.dtypes import fatal_device_error
from embedding_server.engine import Engine
from embedding_server.errors import EngineFailedError

from e2e.harness.proc import free_port
from tests.support.api import wait_for

SCRIPT = os.path.join(os.path.dirname(sys.executable), "embedding-server")


@pytest.mark.parametrize(
    ("error", "fatal"),
    [
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`"), True),
        (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled cuda error"), True),
        # Out of memory is not fatal: the next, smaller batch may fit.
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
        (ValueError("CUDA error: not a device error type"), False),
    ],
)
def test_which_errors_poison_the_device(error: BaseException, fatal: bool) -> None:
    assert fatal_device_error(error) is fatal


def test_torch_accelerator_errors_are_fatal() -> None:
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is None:
        pytest.skip(f"torch {torch.__version__} has no AcceleratorError")
    assert fatal_device_error(accelerator_error("unspecified launch failure"))


def test_after_a_fatal_device_error_the_engine_refuses_work_and_says_so() -> None:
    engine = Engine.from_pretrained("fake?device_error_after=1")
    told: list[str] = []
    engine.on_failure(told.append)
    assert engine.embed(["fine"]).shape[0] == 1
    with pytest.raises(EngineFailedError, match="illegal memory access"):
        engine.embed(["this batch meets a poisoned device"])
    assert len(told) == 1 and "illegal memory access" in told[0]
    model = engine._runner.model
    calls = model.calls  # type: ignore[attr-defined]
    with pytest.raises(EngineFailedError):
        engine.embed(["and so does every later one"])
    assert model.calls == calls  # type: ignore[attr-defined]  # refused without a forward
    assert len(told) == 1  # told once
    assert not engine.ready


def test_the_server_stops_being_ready_and_exits_1() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")}
    # Forward pass 1 is the warm-up, 2 the golden probe set, 3 the first request; 4 and
    # later fail.
    process = subprocess.Popen(
        [SCRIPT, "serve", "--model", "fake?device_error_after=3", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def ready() -> bool:
            assert process.poll() is None
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=60, what="the server to become ready")
        first = httpx.post(url + "/v1/embeddings", json={"input": "fine"}, timeout=30)
        assert first.status_code == 200
        failed = httpx.post(url + "/v1/embeddings", json={"input": "poisoned"}, timeout=30)
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["code"] == "engine_failed"

        def not_ready() -> bool:
            try:
                return httpx.get(url + "/ready", timeout=2).status_code != 200
            except httpx.HTTPError:
                return True  # already gone

        wait_for(not_ready, timeout=10, what="/ready to stop answering 200")
        assert process.wait(timeout=30) == 1
        output = process.stdout.read() if process.stdout else ""
        assert "illegal memory access" in output, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
