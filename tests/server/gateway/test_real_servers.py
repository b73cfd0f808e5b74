"""The gateway process in front of real ``embedding-server serve`` processes (static
discovery from a routes file): the official openai client reaches each model by name
through one base URL, an unknown model is a 404, and a model without a ready endpoint holds
its requests, answers 503 with Retry-After at the deadline, and answers as soon as an
endpoint appears."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.server.gateway.gateway_process import GatewayProcess, gateway_process
from tests.support.api import ServerProcess, server_process, wait_for

pytestmark = pytest.mark.timeout(240)

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
FAKE = "fake-embedder"


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with (
        server_process([]) as minilm,  # the packaged all-MiniLM-L6-v2
        server_process(["--model", "fake?dim=32", "--served-model-name", FAKE]) as fake,
    ):
        yield minilm, fake


class Routes:
    """The gateway's routes file; ``write`` replaces it and waits until the gateway
    routes by it."""

    def __init__(self, path: Path, servers: tuple[ServerProcess, ServerProcess]) -> None:
        self.path = path
        self.minilm, self.fake = servers
        self.gateway: GatewayProcess | None = None
        self.write(fake_endpoint=True, wait=False)

    def write(self, *, fake_endpoint: bool, wait: bool = True) -> None:
        models = [
            {"name": MINILM, "aliases": ["all-MiniLM-L6-v2"], "endpoints": [self.minilm.url]},
            {"name": FAKE, "endpoints": [self.fake.url] if fake_endpoint else []},
        ]
        self.path.write_text(json.dumps({"models": models}))
        if wait:
            assert self.gateway is not None
            gateway = self.gateway
            expected = {MINILM: 1, FAKE: int(fake_endpoint)}
            wait_for(lambda: gateway.ready_endpoints() == expected, what=f"routes {expected}")


@pytest.fixture(scope="module")
def routes(
    servers: tuple[ServerProcess, ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Routes]:
    routes = Routes(tmp_path_factory.mktemp("gateway") / "routes.json", servers)
    args = ["--routes-file", str(routes.path), "--hold-timeout", "4", "--poll-interval", "0.05"]
    with gateway_process(args) as gateway:
        routes.gateway = gateway
        routes.write(fake_endpoint=True)
        yield routes


def test_the_openai_client_reaches_each_model_by_name_through_one_url(routes: Routes) -> None:
    assert routes.gateway is not None
    client = openai.OpenAI(base_url=routes.gateway.url + "/v1", api_key="unused")
    texts = ["The gateway routes by model.", "A second, longer sentence to embed here."]
    through = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    direct = openai.OpenAI(base_url=routes.minilm.url + "/v1", api_key="unused")
    expected = direct.embeddings.create(model=MINILM, input=texts)
    assert through.model == expected.model
    assert np.array_equal(
        np.array([d.embedding for d in through.data]),
        np.array([d.embedding for d in expected.data]),
    )
    fake = client.embeddings.create(model=FAKE, input="x")
    assert fake.model == FAKE and len(fake.data[0].embedding) == 32
    listed = [m.id for m in client.models.list()]
    assert listed == sorted([MINILM, FAKE])
    with pytest.raises(openai.NotFoundError) as raised:
        client.embeddings.create(model="no-such-model", input="x")
    assert "Known models" in str(raised.value) and FAKE in str(raised.value)


def test_a_model_with_no_endpoint_holds_then_503s_and_is_answered_once_one_appears(
    routes: Routes,
) -> None:
    assert routes.gateway is not None
    url = routes.gateway.url
    routes.write(fake_endpoint=False)
    try:
        refused = httpx.post(url + "/v1/embeddings", json={"model": FAKE, "input": "x"}, timeout=30)
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "model_unavailable"

        async def held_then_answered() -> httpx.Response:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                held = asyncio.create_task(
                    client.post("/v1/embeddings", json={"model": FAKE, "input": "x"})
                )
                await asyncio.sleep(0.3)
                assert not held.done()
                routes.write(fake_endpoint=True, wait=False)
                return await held

        # The hold timeout is 4 s and the routes file is checked every second: the request
        # is answered by the endpoint that appeared, not refused.
        answered = asyncio.run(held_then_answered())
        assert answered.status_code == 200 and answered.json()["model"] == FAKE
        metrics = httpx.get(url + "/metrics").text
        assert (
            f'embedding_gateway_held_requests{{embedding_service="file/{FAKE}",model="{FAKE}"}} 0.0'
            in metrics
        )
        assert (
            f'embedding_gateway_routing_decisions_total{{decision="held",model="{FAKE}"}}'
            in metrics
        )
    finally:
        routes.write(fake_endpoint=True)
