"""The gateway against stub endpoints: least-backlog picking, forwarding, retries, holding
and priority, each as a client would see it (answers, statuses, which pod served)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from embedding_server.gateway.discovery import Service
from embedding_server.gateway.holding import HoldFullError, Holding
from embedding_server.gateway.proxy import FORWARDED_ROUTES, Gateway

from tests.server.gateway.stubs import ListDiscovery, Stub, running_gateway, wait_until

pytestmark = pytest.mark.timeout(60)

BUSY = {"ready": True, "queued_tokens": 60000, "running_tokens": 4000, "backlog_seconds": 5.0}


@pytest.fixture
async def stubs() -> AsyncIterator[tuple[Stub, Stub]]:
    a, b = await Stub("m").start(), await Stub("m").start()
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


def _ready(gateway: Gateway, name: str, count: int) -> bool:
    service = gateway.catalog.by_name.get(name)
    return service is not None and len(gateway.ready_endpoints(service)) == count


def _sample(gateway: Gateway, name: str, labels: dict[str, str]) -> float:
    """One sample of the gateway's metrics (``name`` without its prefix)."""
    full = "embedding_gateway_" + name
    return gateway.metrics.registry.get_sample_value(full, labels) or 0.0


def _both(stubs: tuple[Stub, Stub]) -> ListDiscovery:
    """One service, "s", serving model "m" on both stubs."""
    return ListDiscovery([Service("s", ("m",), frozenset(s.url for s in stubs))])


async def _load_polled(gateway: Gateway, stub: Stub, what: str = "the load polled") -> None:
    """Wait until the gateway has polled ``stub``'s queued tokens (a busy stub's load)."""
    await wait_until(
        lambda: (
            gateway._poller is not None and gateway._poller.endpoints[stub.url].queued_tokens > 0
        ),
        what=what,
    )


async def _embed(url: str) -> httpx.Response:
    """One small embeddings request for model "m" through the gateway at ``url``."""
    async with httpx.AsyncClient(base_url=url) as client:
        return await client.post("/v1/embeddings", json={"model": "m", "input": "x"})


async def test_every_request_goes_to_the_idle_pod_not_the_busy_one(
    stubs: tuple[Stub, Stub],
) -> None:
    busy, idle = stubs
    busy.load = BUSY
    discovery = ListDiscovery([Service("s", ("m",), frozenset({busy.url, idle.url}))])
    async with running_gateway(discovery) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 2), what="both endpoints ready")
        await _load_polled(gateway, busy, "the busy pod's load polled")
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(20):
                answer = await client.post("/v1/embeddings", json={"model": "m", "input": "x"})
                assert answer.status_code == 200
                assert answer.json()["served_by"] == idle.url
    assert len(idle.received) == 20 and busy.received == []


async def test_a_burst_spreads_over_idle_pods_by_in_flight_work(
    stubs: tuple[Stub, Stub],
) -> None:
    # Between two polls both pods look idle; the gateway's own in-flight count spreads the
    # burst instead of sending all of it to whichever pod won the first pick.
    for stub in stubs:
        stub.delay = 0.5
    discovery = _both(stubs)
    async with running_gateway(discovery, poll_interval=5.0) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 2), what="both endpoints ready")
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": "m", "input": "x"}
            answers = await asyncio.gather(
                *(client.post("/v1/embeddings", json=body) for _ in range(20))
            )
    assert all(a.status_code == 200 for a in answers)
    # Polled load alone would send all 20 to one pod; the in-flight count alternates them
    # (exactly 10 each when all 20 arrive within the pods' 0.5 s; a slow machine may let a
    # pod answer one early and take one more).
    assert abs(len(stubs[0].received) - len(stubs[1].received)) <= 2


async def test_the_body_and_path_reach_the_server_untouched(stubs: tuple[Stub, Stub]) -> None:
    stub = stubs[0]
    discovery = ListDiscovery([Service("s", ("m", "m-alias"), frozenset({stub.url}))])
    raw = '{"input": ["é ☃", "b"], "model": "m-alias", "extra": {"nested": [1, 2.50]}}'
    async with running_gateway(discovery) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 1), what="the endpoint ready")
        async with httpx.AsyncClient(base_url=url) as client:
            for path in FORWARDED_ROUTES:
                answer = await client.post(
                    path + "?x=1",
                    content=raw.encode(),
                    headers={"Content-Type": "application/json", "Authorization": "Bearer k"},
                )
                assert answer.status_code == 200, path
                assert answer.json() == {"served_by": stub.url, "path": path, "echo": raw}
                assert answer.headers["X-Stub"] == stub.url


async def test_an_unknown_model_is_a_404_naming_the_known_ones(stubs: tuple[Stub, Stub]) -> None:
    discovery = ListDiscovery(
        [
            Service("s", ("m",), frozenset({stubs[0].url})),
            Service("t", ("other", "o"), frozenset({stubs[1].url})),
        ]
    )
    async with (
        running_gateway(discovery) as (_gateway, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        answer = await client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        missing = await client.post("/v1/embeddings", json={"input": "x"})
        wrong = await client.post("/v1/embeddings", json={"model": 3, "input": "x"})
        huge = await client.post("/v1/embeddings", json={"model": "n" * 1_000_000, "input": "x"})
        models = (await client.get("/v1/models")).json()
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert all(f"'{name}'" in error["message"] for name in ("m", "other", "o"))
    # A name is echoed cut short, not whole (issue 48, L4: a 1 MiB name came back whole).
    assert huge.status_code == 404
    assert len(huge.content) < 2_000, len(huge.content)
    assert "(1,000,000 characters)" in huge.json()["error"]["message"]
    # With several models, 'model' is needed to choose one.
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"
    assert [(m["id"], m["aliases"]) for m in models["data"]] == [("m", []), ("other", ["o"])]
    assert stubs[0].received == stubs[1].received == []


async def test_the_listing_and_the_errors_name_only_what_every_caller_may_see(
    stubs: tuple[Stub, Stub],
) -> None:
    """Issue 48, L4: the gateway authenticates nobody, so by default /v1/models and its errors
    show each caller the models' names only: no ready-pod counts, and nothing of a service
    whose pods need an API key (which routes all the same). ``--models-listing full`` shows
    everything with the counts, ``none`` names no model at all."""
    discovery = ListDiscovery(
        [
            Service("team-a/m", ("m",), frozenset({stubs[0].url})),
            Service("team-b/k", ("keyed", "keyed-alias"), frozenset({stubs[1].url}), listed=False),
        ]
    )
    async with (
        running_gateway(discovery) as (gateway, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        await wait_until(lambda: _ready(gateway, "keyed", 1), what="the keyed endpoint ready")
        models = (await client.get("/v1/models")).json()["data"]
        unknown = (await client.post("/v1/embeddings", json={"model": "x", "input": "y"})).json()
        missing = (await client.post("/v1/embeddings", json={"input": "y"})).json()
        routed = await client.post("/v1/embeddings", json={"model": "keyed", "input": "y"})
    assert models == [
        {"id": "m", "object": "model", "created": 0, "owned_by": "embedding-server", "aliases": []}
    ]
    for error in (unknown["error"], missing["error"]):
        assert "'m'" in error["message"], error
        assert "keyed" not in error["message"] and " 2 models" not in error["message"], error
    assert routed.status_code == 200 and routed.json()["served_by"] == stubs[1].url

    async with (
        running_gateway(discovery, models_listing="full") as (gateway, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        await wait_until(lambda: _ready(gateway, "keyed", 1), what="the keyed endpoint ready")
        full = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["aliases"], m["ready_endpoints"]) for m in full] == [
        ("keyed", ["keyed-alias"], 1),
        ("m", [], 1),
    ]

    async with (
        running_gateway(discovery, models_listing="none") as (gateway, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        await wait_until(lambda: gateway.catalog.loaded, what="the catalog")
        none = (await client.get("/v1/models")).json()["data"]
        unknown = (await client.post("/v1/embeddings", json={"model": "x", "input": "y"})).json()
    assert none == []
    assert unknown["error"]["message"] == "The model 'x' does not exist here."


OLD, NEW = "0123456789abcdef", "fedcba9876543210"


def _versions(stubs: tuple[Stub, Stub], thief: Stub | None = None) -> list[Service]:
    """Service "team/m" during a model change, as Kubernetes discovery publishes it: its own
    names and the active version on the first stub, the pending version on the second; and
    (``thief``) an older service that wrote the active version's name as an alias."""
    old, new = stubs
    services = [
        Service("team/m", ("m", "m-alias"), frozenset({old.url}), fingerprint=OLD),
        Service(
            f"team/m@{OLD}",
            (f"m@{OLD}", f"m-alias@{OLD}"),
            frozenset({old.url}),
            version="active",
            fingerprint=OLD,
            parent="m",
        ),
        Service(
            f"team/m@{NEW}",
            (f"m@{NEW}", f"m-alias@{NEW}"),
            frozenset({new.url}),
            version="pending",
            fingerprint=NEW,
            parent="m",
        ),
    ]
    if thief is not None:
        services.append(Service("a-thief/x", ("x", f"m@{NEW}"), frozenset({thief.url})))
    return services


async def test_a_versioned_name_reaches_that_version_only_and_the_listing_shows_both(
    stubs: tuple[Stub, Stub],
) -> None:
    """Issue 47, item 4: during a model change ``m@<fingerprint>`` (or a prefix of 8 or more
    of its digits) routes to that version's pods only, ``m`` to the active one's, and
    /v1/models lists each version with its fingerprint and the name it is a version of. A
    pinned name with a fingerprint no version has goes to the service's own pods, which answer
    409 unless it is theirs."""
    old, new = stubs
    thief = await Stub("x").start()
    try:
        discovery = ListDiscovery(_versions(stubs, thief))
        async with (
            running_gateway(discovery) as (gateway, url),
            httpx.AsyncClient(base_url=url) as client,
        ):
            await wait_until(lambda: _ready(gateway, f"m@{NEW}", 1), what="the pending version")
            await wait_until(lambda: _ready(gateway, "x", 1), what="the thief's pod")
            served = {}
            for model in (
                "m",
                "m-alias",
                f"m@{OLD}",
                f"m-alias@{OLD[:8]}",
                f"m@{NEW}",
                f"m@{NEW[:8].upper()}",
                "m@00000000",
                "x",
            ):
                answer = await client.post("/v1/embeddings", json={"model": model, "input": "y"})
                assert answer.status_code == 200, (model, answer.text)
                served[model] = answer.json()["served_by"]
            models = (await client.get("/v1/models")).json()["data"]
            # With one service, its versions are no reason to ask for a name.
            async with running_gateway(ListDiscovery(_versions(stubs))) as (one, one_url):
                await wait_until(lambda: _ready(one, "m", 1), what="the active version")
                async with httpx.AsyncClient(base_url=one_url) as only:
                    unnamed = await only.post("/v1/embeddings", json={"input": "y"})
    finally:
        await thief.stop()
    assert (
        served
        == {
            "m": old.url,
            "m-alias": old.url,
            f"m@{OLD}": old.url,
            f"m-alias@{OLD[:8]}": old.url,
            f"m@{NEW}": new.url,  # the version's own name, not the thief's older alias
            f"m@{NEW[:8].upper()}": new.url,
            "m@00000000": old.url,  # no such version: the service's pods answer 409 themselves
            "x": thief.url,
        }
    )
    assert [
        (m["id"], m["aliases"], m.get("fingerprint"), m.get("parent"), m.get("version"))
        for m in models
    ] == [
        ("m", ["m-alias"], OLD, None, None),
        (f"m@{OLD}", [f"m-alias@{OLD}"], OLD, "m", "active"),
        (f"m@{NEW}", [f"m-alias@{NEW}"], NEW, "m", "pending"),
        ("x", [], None, None, None),
    ]
    assert unnamed.status_code == 200 and unnamed.json()["served_by"] == old.url


async def test_a_503_is_retried_once_on_another_pod(stubs: tuple[Stub, Stub]) -> None:
    draining, healthy = stubs
    draining.status = 503
    healthy.load = BUSY  # so the first pick is the draining pod
    discovery = _both(stubs)
    async with running_gateway(discovery) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 2), what="both endpoints ready")
        await _load_polled(gateway, healthy)
        answer = await _embed(url)
    assert answer.status_code == 200 and answer.json()["served_by"] == healthy.url
    assert len(draining.received) == 1 and len(healthy.received) == 1
    assert _sample(gateway, "retries_total", {"model": "m", "reason": "unavailable"}) == 1


async def test_a_4xx_is_never_retried(stubs: tuple[Stub, Stub]) -> None:
    for stub in stubs:
        stub.status = 400
    discovery = _both(stubs)
    async with running_gateway(discovery) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 2), what="both endpoints ready")
        answer = await _embed(url)
    assert answer.status_code == 400
    assert len(stubs[0].received) + len(stubs[1].received) == 1


async def test_a_pod_gone_without_answering_is_retried_on_another(
    stubs: tuple[Stub, Stub],
) -> None:
    gone, alive = stubs
    alive.load = BUSY  # the gone pod looks idler, so it is picked first
    discovery = _both(stubs)
    async with running_gateway(discovery, poll_interval=5.0) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 2), what="both endpoints ready")
        await gone.stop()  # connections refused from now on; the gateway has not polled
        answer = await _embed(url)
    assert answer.status_code == 200 and answer.json()["served_by"] == alive.url
    assert _sample(gateway, "retries_total", {"model": "m", "reason": "connection"}) == 1


async def test_a_pod_that_dies_mid_answer_is_retried_and_the_client_sees_one_whole_answer(
    stubs: tuple[Stub, Stub],
) -> None:
    dying, alive = stubs
    dying.die_mid_answer = True
    alive.load = BUSY  # the dying pod looks idler, so it is picked first
    discovery = _both(stubs)
    async with running_gateway(discovery) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 2), what="both endpoints ready")
        await _load_polled(gateway, alive)
        answer = await _embed(url)
    assert answer.status_code == 200 and answer.json()["served_by"] == alive.url
    assert len(dying.received) == 1
    assert _sample(gateway, "retries_total", {"model": "m", "reason": "connection"}) == 1


async def test_a_body_that_would_not_fit_is_refused_before_100_continue(
    stubs: tuple[Stub, Stub],
) -> None:
    """A client that asks before sending its body (``Expect: 100-continue``, as curl does for
    bodies over 1 MiB) is refused by the byte budget at once, not invited to send it."""
    a, _ = stubs
    discovery = ListDiscovery([Service("s", ("m",), frozenset({a.url}))])
    limits = {"max_request_bytes": 200_000, "max_buffered_bytes": 200_000}
    async with running_gateway(discovery, **limits) as (gateway, url):
        port = int(url.rsplit(":", 1)[1])
        head = (
            b"POST /v1/embeddings HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200000\r\n"
        )
        _, stalled = await asyncio.open_connection("127.0.0.1", port)
        stalled.write(head + b"\r\n" + b'{"input": "')
        await wait_until(lambda: gateway.budget.held > 0, what="the stalled body held")
        reader, asking = await asyncio.open_connection("127.0.0.1", port)
        asking.write(head + b"Expect: 100-continue\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(4096), timeout=10)
        over, too_large = await asyncio.open_connection("127.0.0.1", port)
        too_large.write(head.replace(b"200000", b"200001") + b"Expect: 100-continue\r\n\r\n")
        refused = await asyncio.wait_for(over.read(4096), timeout=10)
        for writer in (stalled, asking, too_large):
            writer.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b'"code":"server_busy"' in answer
    assert refused.startswith(b"HTTP/1.1 413"), refused
    assert a.received == []


async def test_a_retry_returns_to_the_only_pod_once_it_is_ready_again(
    stubs: tuple[Stub, Stub],
) -> None:
    """L6: a single replica that dropped a request and came back on the same address (a
    restart) answers its retry, instead of the request waiting out its whole timeout for
    another pod and getting the first attempt's 502."""
    pod, _ = stubs
    pod.deaths = 1
    discovery = ListDiscovery([Service("s", ("m",), frozenset({pod.url}))])
    async with running_gateway(discovery, request_timeout=5.0) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 1), what="the endpoint ready")
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = await _embed(url)
        waited = loop.time() - started
    assert answer.status_code == 200, answer.text
    assert answer.json()["served_by"] == pod.url
    assert len(pod.received) == 2
    assert waited < 2.5, f"the retry waited {waited:.1f} s"
    assert _sample(gateway, "retries_total", {"model": "m", "reason": "connection"}) == 1


async def test_a_body_over_the_limit_is_a_413(stubs: tuple[Stub, Stub]) -> None:
    discovery = ListDiscovery([Service("s", ("m",), frozenset({stubs[0].url}))])
    async with (
        running_gateway(discovery, max_request_bytes=1000) as (_gateway, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        answer = await client.post("/v1/embeddings", json={"model": "m", "input": "x" * 2000})
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "payload_too_large"
    assert stubs[0].received == []


async def test_a_model_without_endpoints_holds_then_503s_with_retry_after() -> None:
    discovery = ListDiscovery([Service("s", ("cold",), frozenset())])
    async with (
        running_gateway(discovery, hold_timeout=0.3) as (gateway, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        held = asyncio.create_task(
            client.post("/v1/embeddings", json={"model": "cold", "input": "x"})
        )
        await wait_until(
            lambda: (
                _sample(gateway, "held_requests", {"model": "cold", "embedding_service": "s"}) == 1
            ),
            what="the request held",
        )
        answer = await held
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "model_unavailable"
    assert int(answer.headers["Retry-After"]) >= 1
    assert _sample(gateway, "held_requests", {"model": "cold", "embedding_service": "s"}) == 0
    assert (
        _sample(
            gateway, "last_request_timestamp_seconds", {"model": "cold", "embedding_service": "s"}
        )
        > 0
    )


async def test_a_held_request_is_answered_once_an_endpoint_appears() -> None:
    stub = await Stub("cold").start()
    discovery = ListDiscovery([Service("s", ("cold",), frozenset())])
    try:
        async with (
            running_gateway(discovery, hold_timeout=10) as (gateway, url),
            httpx.AsyncClient(base_url=url, timeout=15) as client,
        ):
            held = asyncio.create_task(
                client.post("/v1/embeddings", json={"model": "cold", "input": "x"})
            )
            await wait_until(lambda: gateway.holding.held("cold") == 1, what="held")
            discovery.set([Service("s", ("cold",), frozenset({stub.url}))])
            answer = await held
    finally:
        await stub.stop()
    assert answer.status_code == 200 and answer.json()["served_by"] == stub.url


async def _held_then_ready(
    stub: Stub, *, hold_for: float, **settings: float
) -> tuple[Gateway, httpx.Response, float, float]:
    """A request for a model with no endpoint, held ``hold_for`` seconds before ``stub``
    appears: the gateway, the answer, seconds from sending to the answer and from the
    endpoint's appearance to the answer."""
    discovery = ListDiscovery([Service("s", ("cold",), frozenset())])
    loop = asyncio.get_running_loop()
    async with (
        running_gateway(discovery, **settings) as (gateway, url),
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        sent = loop.time()
        held = asyncio.create_task(
            client.post("/v1/embeddings", json={"model": "cold", "input": "x"})
        )
        await wait_until(lambda: gateway.holding.held("cold") == 1, what="held")
        await asyncio.sleep(hold_for - (loop.time() - sent))
        assert not held.done(), "answered while held"
        appeared = loop.time()
        discovery.set([Service("s", ("cold",), frozenset({stub.url}))])
        answer = await held
        answered = loop.time()
    return gateway, answer, answered - sent, answered - appeared


async def test_a_request_held_longer_than_the_request_timeout_is_still_answered() -> None:
    # A cold start outlasts --request-timeout: the hold has its own deadline, and the request
    # released from it is answered, not cut short by the time it spent held.
    stub = await Stub("cold").start()
    stub.delay = 0.2
    try:
        gateway, answer, total, _ = await _held_then_ready(
            stub, hold_for=1.5, request_timeout=1.0, hold_timeout=10
        )
    finally:
        await stub.stop()
    assert answer.status_code == 200 and answer.json()["served_by"] == stub.url
    # The request-latency histogram is still arrival to answer, the hold included.
    observed = _sample(gateway, "request_seconds_sum", {"model": "cold"})
    assert _sample(gateway, "request_seconds_count", {"model": "cold"}) == 1
    assert 1.5 <= observed <= total


async def test_a_released_request_gets_the_whole_request_timeout_upstream() -> None:
    # Held 1.5 s, then sent to a pod that takes 2.5 s: the 504 comes a whole
    # --request-timeout (1 s) after the pod appeared, not at once for the time already held.
    stub = await Stub("cold").start()
    stub.delay = 2.5
    try:
        _, answer, _, upstream = await _held_then_ready(
            stub, hold_for=1.5, request_timeout=1.0, hold_timeout=10
        )
    finally:
        await stub.stop()
    assert answer.status_code == 504
    assert answer.json()["error"]["code"] == "upstream_timeout"
    assert len(stub.received) == 1
    assert upstream >= 1.0


async def test_the_hold_runs_to_its_own_deadline_not_the_request_timeout() -> None:
    discovery = ListDiscovery([Service("s", ("cold",), frozenset())])
    loop = asyncio.get_running_loop()
    async with (
        running_gateway(discovery, hold_timeout=0.8, request_timeout=0.2) as (gateway, url),
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        sent = loop.time()
        answer = await client.post("/v1/embeddings", json={"model": "cold", "input": "x"})
        waited = loop.time() - sent
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "model_unavailable"
    assert int(answer.headers["Retry-After"]) >= 1
    assert waited >= 0.8
    assert (
        _sample(gateway, "routing_decisions_total", {"model": "cold", "decision": "hold_timeout"})
        == 1
    )


async def test_a_retry_without_another_pod_is_held_within_the_request_timeout(
    stubs: tuple[Stub, Stub],
) -> None:
    # The only pod answers 503 (draining): the retry waits for another one, but only as long
    # as the upstream deadline allows, and then the client gets the first pod's answer.
    draining, fresh = stubs
    draining.status = 503
    discovery = ListDiscovery([Service("s", ("m",), frozenset({draining.url}))])
    async with (
        running_gateway(discovery, request_timeout=0.5, hold_timeout=10) as (gateway, url),
        httpx.AsyncClient(base_url=url, timeout=5) as client,
    ):
        await wait_until(lambda: _ready(gateway, "m", 1), what="the endpoint ready")
        body = {"model": "m", "input": "x"}
        # Within the client's 5 s: the 0.5 s request timeout bounds the retry's wait, not
        # what is left of the 10 s hold.
        alone = await client.post("/v1/embeddings", json=body)
        assert alone.status_code == 503 and alone.json()["served_by"] == draining.url
    # A second pod that appears while the retry is held answers it.
    async with (
        running_gateway(discovery, request_timeout=5, hold_timeout=10) as (gateway, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        await wait_until(lambda: _ready(gateway, "m", 1), what="the endpoint ready")
        held = asyncio.create_task(client.post("/v1/embeddings", json=body))
        await wait_until(lambda: gateway.holding.held("m") == 1, what="the retry held")
        discovery.set([Service("s", ("m",), frozenset({draining.url, fresh.url}))])
        answer = await held
    assert answer.status_code == 200 and answer.json()["served_by"] == fresh.url
    assert len(draining.received) == 2 and len(fresh.received) == 1


async def test_retry_after_is_half_the_hold_timeout_up_to_30_s() -> None:
    # With the default 300 s hold, a client told to come back in 150 s would miss a model
    # that woke meanwhile.
    discovery = ListDiscovery([Service("s", ("cold",), frozenset())])
    answers = {}
    for hold_timeout in (300.0, 20.0, 0.0):
        async with (
            running_gateway(discovery, hold_timeout=hold_timeout, max_held_requests=0) as (_, url),
            httpx.AsyncClient(base_url=url) as client,
        ):
            answer = await client.post("/v1/embeddings", json={"model": "cold", "input": "x"})
            assert answer.status_code == 503
            answers[hold_timeout] = answer.headers["Retry-After"]
    assert answers == {300.0: "30", 20.0: "10", 0.0: "1"}


async def test_a_client_that_hangs_up_leaves_the_holding_queue() -> None:
    # The held-requests gauge is what scales a model from zero: it must count live demand.
    discovery = ListDiscovery([Service("s", ("cold",), frozenset())])
    async with running_gateway(discovery, hold_timeout=30) as (gateway, url):
        client = httpx.AsyncClient(base_url=url)
        held = asyncio.create_task(
            client.post("/v1/embeddings", json={"model": "cold", "input": "x"})
        )
        await wait_until(lambda: gateway.holding.held("cold") == 1, what="held")
        held.cancel()
        await client.aclose()
        await wait_until(lambda: gateway.holding.held("cold") == 0, what="the hold released")
        assert _sample(gateway, "held_requests", {"model": "cold", "embedding_service": "s"}) == 0


async def test_holding_is_bounded_per_model() -> None:
    discovery = ListDiscovery([Service("s", ("cold",), frozenset())])
    async with (
        running_gateway(discovery, hold_timeout=1, max_held_requests=1) as (gateway, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        body = {"model": "cold", "input": "x"}
        first = asyncio.create_task(client.post("/v1/embeddings", json=body))
        await wait_until(lambda: gateway.holding.held("cold") == 1, what="held")
        second = await client.post("/v1/embeddings", json=body)
        assert second.status_code == 503 and "Retry-After" in second.headers
        assert "holds as many" in second.json()["error"]["message"]
        assert (await first).status_code == 503


async def test_held_interactive_requests_are_released_before_bulk_ones() -> None:
    holding = Holding(max_requests=10, max_tokens=100)
    order: list[str] = []

    async def hold(priority: str) -> None:
        assert await holding.wait("m", 1, priority, 5)  # type: ignore[arg-type]
        order.append(priority)

    tasks = [asyncio.create_task(hold(p)) for p in ("bulk", "bulk", "interactive")]
    await wait_until(lambda: holding.held("m") == 3, what="three held")
    assert holding.release("m") == 3
    await asyncio.gather(*tasks)
    assert order == ["interactive", "bulk", "bulk"]
    with pytest.raises(HoldFullError):
        await Holding(max_requests=10, max_tokens=5).wait("m", 6, "bulk", 1)


async def test_bulk_gets_429_when_every_pod_is_saturated_and_interactive_goes_through(
    stubs: tuple[Stub, Stub],
) -> None:
    stub = stubs[0]
    stub.load = BUSY
    discovery = ListDiscovery([Service("s", ("m",), frozenset({stub.url}))])
    async with running_gateway(discovery, bulk_routes=["/v2/embed"]) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 1), what="the endpoint ready")
        await wait_until(
            lambda: (
                gateway._poller is not None
                and gateway._poller.endpoints[stub.url].backlog_seconds > 0
            ),
            what="the load polled",
        )
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": "m", "input": "x"}
            bulk = await client.post("/v1/embeddings", json=body, headers={"X-Priority": "bulk"})
            by_route = await client.post("/v2/embed", json=body)
            interactive = await client.post("/v1/embeddings", json=body)
            overridden = await client.post(
                "/v2/embed", json=body, headers={"X-Priority": "interactive"}
            )
            bad = await client.post("/v1/embeddings", json=body, headers={"X-Priority": "x"})
    assert bulk.status_code == by_route.status_code == 429
    assert bulk.json()["error"]["type"] == "rate_limit_error" and "Retry-After" in bulk.headers
    assert interactive.status_code == overridden.status_code == 200
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Priority"
    assert len(stub.received) == 2


async def test_the_pod_hears_the_priority_the_gateway_decided(stubs: tuple[Stub, Stub]) -> None:
    # The server admits and batches by X-Priority: a request the gateway treats as bulk by
    # its route must reach the pod as bulk, whatever the pod's own --bulk-routes say.
    stub = stubs[0]
    discovery = ListDiscovery([Service("s", ("m",), frozenset({stub.url}))])
    async with running_gateway(discovery, bulk_routes=["/v2/embed"]) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 1), what="the endpoint ready")
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": "m", "input": "x"}
            for path, headers in (
                ("/v2/embed", {}),
                ("/v1/embeddings", {}),
                ("/v2/embed", {"x-priority": "Interactive"}),
                ("/v1/embeddings", {"X-Priority": "bulk"}),
            ):
                answer = await client.post(path, json=body, headers=headers)
                assert answer.status_code == 200
    assert stub.priorities == ["bulk", "interactive", "interactive", "bulk"]


async def test_metrics_count_requests_by_model_and_status(stubs: tuple[Stub, Stub]) -> None:
    discovery = ListDiscovery([Service("s", ("m",), frozenset({stubs[0].url}))])
    async with running_gateway(discovery) as (gateway, url):
        await wait_until(lambda: _ready(gateway, "m", 1), what="the endpoint ready")
        async with httpx.AsyncClient(base_url=url) as client:
            await client.post("/v1/embeddings", json={"model": "m", "input": "x"})
            await client.post("/v1/embeddings", json={"model": "zz", "input": "x"})
            text = (await client.get("/metrics")).text
    assert 'embedding_gateway_requests_total{model="m",status="200"} 1.0' in text
    assert 'embedding_gateway_requests_total{model="",status="404"} 1.0' in text
    assert 'embedding_gateway_request_seconds_count{model="m"} 1.0' in text
    assert 'embedding_gateway_ready_endpoints{model="m"} 1.0' in text
    assert 'embedding_gateway_routing_decisions_total{decision="only",model="m"} 1.0' in text


def test_the_gateway_forwards_exactly_the_servers_model_routes() -> None:
    from embedding_server.api.app import ROUTERS

    posts = {
        route.path  # type: ignore[attr-defined]
        for router in ROUTERS
        for route in router.routes
        if "POST" in getattr(route, "methods", ())
    }
    assert set(FORWARDED_ROUTES) == posts


async def test_a_body_that_trickles_in_gets_a_408_within_the_body_timeout(
    stubs: tuple[Stub, Stub],
) -> None:
    """A client that sends its headers and then holds back the body cannot keep a handler
    (and its connection) forever: it is answered 408 at the body timeout."""
    a, _ = stubs
    discovery = ListDiscovery([Service("s", ("m",), frozenset({a.url}))])
    async with running_gateway(discovery, body_timeout=0.5) as (_gateway, url):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"model": "m", "input": "x"}'
        writer.write(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body[:5]
        )
        await writer.drain()
        loop = asyncio.get_running_loop()
        sent = loop.time()
        answer = await asyncio.wait_for(reader.read(4096), timeout=10)
        waited = loop.time() - sent
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"code":"request_timeout"' in answer
    assert 0.4 <= waited < 5, waited
    assert a.received == [], "nothing reached the pod"
