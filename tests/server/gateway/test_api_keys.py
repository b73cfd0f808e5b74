"""Priority by API key: ``--bulk-api-keys-file`` makes a key's requests bulk whatever their
``X-Priority`` says, before ``--bulk-routes``; the keys stay secret (digests only, never logged)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import pytest
from embedding_server.gateway import server as gateway_server
from embedding_server.gateway.apikeys import BulkApiKeys, BulkApiKeysFile, parse_keys
from embedding_server.gateway.discovery import Service
from embedding_server.gateway.proxy import Gateway
from embedding_server.gateway.server import run_gateway
from embedding_server.gateway.settings import GatewaySettings

from tests.server.gateway.stubs import ListDiscovery, Stub, running_gateway, wait_until

pytestmark = pytest.mark.timeout(60)

BULK_KEY = "sk-indexer-7f3a9c"
OTHER_BULK_KEY = "sk-batch-0001"


def test_a_bearer_key_in_the_file_is_bulk_and_nothing_else_is() -> None:
    keys = BulkApiKeys(parse_keys(f"# the indexers\n{BULK_KEY}\n\n  {OTHER_BULK_KEY}  \n"))
    assert len(keys) == 2
    assert keys.is_bulk(f"Bearer {BULK_KEY}")
    assert keys.is_bulk(f"bearer {OTHER_BULK_KEY}")
    for header in (
        None,
        "",
        "Bearer sk-search",
        f"Bearer {BULK_KEY}x",
        f"Bearer {BULK_KEY[:-1]}",
        BULK_KEY,  # not a bearer token
        f"Basic {BULK_KEY}",
        "Bearer # the indexers",
    ):
        assert not keys.is_bulk(header), header
    assert not BulkApiKeys().is_bulk(f"Bearer {BULK_KEY}")


def test_only_digests_are_kept() -> None:
    keys = BulkApiKeys([BULK_KEY])
    assert BULK_KEY not in repr(vars(keys)) and BULK_KEY.encode() not in b"".join(keys._digests)


def test_the_file_is_read_again_when_it_changes_and_kept_when_it_breaks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{BULK_KEY}\n")
    with caplog.at_level(logging.INFO):
        source = BulkApiKeysFile(str(path))
        assert source.keys.is_bulk(f"Bearer {BULK_KEY}")
        path.write_text(f"{OTHER_BULK_KEY}\n")
        os.utime(path, ns=(1, 2_000_000_000))
        source.reload_if_changed()
        assert source.keys.is_bulk(f"Bearer {OTHER_BULK_KEY}")
        assert not source.keys.is_bulk(f"Bearer {BULK_KEY}")
        path.write_bytes(b"\xff" + BULK_KEY.encode())  # not text: the last keys stay
        os.utime(path, ns=(1, 3_000_000_000))
        source.reload_if_changed()
        assert source.keys.is_bulk(f"Bearer {OTHER_BULK_KEY}")
        path.unlink()
        source.reload_if_changed()
        assert source.keys.is_bulk(f"Bearer {OTHER_BULK_KEY}")
    text = caplog.text
    assert "read 1 bulk API keys" in text and "keeping the last keys" in text
    assert BULK_KEY not in text and OTHER_BULK_KEY not in text


def test_a_keys_file_that_cannot_be_read_stops_the_gateway_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"discovery": "static", "routes": ["m=http://127.0.0.1:9"], "port": 1}
    missing = GatewaySettings(**options, bulk_api_keys_file=str(tmp_path / "none"))
    with pytest.raises(OSError):
        Gateway(missing, ListDiscovery([]))
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xfe" + BULK_KEY.encode())
    # run_gateway would install its own root handler in place of the test's.
    monkeypatch.setattr(gateway_server, "configure_logging", lambda *_: None)
    with caplog.at_level(logging.ERROR):
        assert run_gateway(GatewaySettings(**options, bulk_api_keys_file=str(binary))) == 2
    log = caplog.text
    assert "cannot start the gateway" in log and "not UTF-8 text" in log
    assert BULK_KEY not in log


async def test_a_bulk_key_stays_bulk_and_the_header_decides_before_the_route(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{BULK_KEY}\n")
    stub = await Stub("m").start()
    try:
        discovery = ListDiscovery([Service("s", ("m",), frozenset({stub.url}))])
        async with running_gateway(
            discovery, bulk_routes=["/v2/embed"], bulk_api_keys_file=str(path)
        ) as (gateway, url):
            await wait_until(
                lambda: bool(gateway.ready_endpoints(gateway.catalog.by_name["m"])),
                what="the endpoint ready",
            )
            body = {"model": "m", "input": "x"}
            bulk = {"Authorization": f"Bearer {BULK_KEY}"}
            search = {"Authorization": "Bearer sk-search"}
            async with httpx.AsyncClient(base_url=url) as client:
                for path_, headers in (
                    ("/v1/embeddings", bulk),  # the key: bulk
                    ("/v1/embeddings", search),  # another key, an interactive route
                    ("/v2/embed", search),  # another key, a bulk route
                    # A bulk key cannot make itself interactive (issue 48, L5).
                    ("/v1/embeddings", {**bulk, "X-Priority": "interactive"}),
                    ("/v2/embed", {**search, "X-Priority": "interactive"}),  # the header
                    ("/v1/embeddings", {**search, "X-Priority": "bulk"}),  # the header
                    ("/v1/embeddings", {}),  # no key
                ):
                    answer = await client.post(path_, json=body, headers=headers)
                    assert answer.status_code == 200
    finally:
        await stub.stop()
    assert stub.priorities == [
        "bulk",
        "interactive",
        "bulk",
        "bulk",
        "interactive",
        "bulk",
        "interactive",
    ]
