"""The chat-template attacks of the third hardening review (H1, M1 and M3 in docs/security.md),
replayed against a real ``embedding-server serve`` process, as ``test_abuse`` replays the
others: the fake backend with its Zephyr-style chat template (the end-of-sequence token after
every message, ``raise_exception`` on a role it does not take), default limits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.api.test_abuse import Served, Watch, assert_refused, post_json, serve

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("abuse-chat") / "server.log"
    with serve(log, "--model", "fake?dim=32&chat=true") as served:
        yield served


def _post(served: Served, body: dict[str, Any]) -> httpx.Response:
    raw = json.dumps(body, separators=(",", ":")).encode()
    return post_json(served.url + "/v1/embeddings", raw, timeout=120)


def _still_chats(served: Served) -> None:
    response = _post(served, {"messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 200, response.text[:500]
    assert "Traceback" not in served.log_text()


def test_a_special_token_set_by_the_request_is_refused_before_rendering(
    chat_server: Served,
) -> None:
    # 0.34 MiB: eos_token of 300,000 characters, which the template writes after each of
    # 2000 messages. It rendered 600 M characters (+575 MiB, /health held 0.5 s) and
    # answered 200.
    body = {
        "messages": [{"role": "user", "content": "x"}] * 2000,
        "chat_template_kwargs": {"eos_token": "A" * 300_000},
        "truncate_prompt_tokens": 8,
    }
    with Watch(chat_server) as watch:
        response = _post(chat_server, body)
    message = assert_refused(response, 400, param="chat_template_kwargs.eos_token")
    assert "cannot be set by a request" in message
    watch.assert_unharmed(memory_mib=64)
    _still_chats(chat_server)


def test_raise_exception_cannot_be_shadowed_and_the_template_refusal_stays_a_400(
    chat_server: Served,
) -> None:
    tool = {"messages": [{"role": "tool", "content": "x"}]}
    # The template's own refusal of a role it does not take.
    assert "unknown role tool" in assert_refused(_post(chat_server, tool), 400, param="messages")
    # raise_exception replaced by a number made that refusal a 500 with a traceback.
    shadowed = {**tool, "chat_template_kwargs": {"raise_exception": 1}}
    assert_refused(_post(chat_server, shadowed), 400, param="chat_template_kwargs.raise_exception")
    _still_chats(chat_server)


def test_more_messages_than_allowed_are_refused_before_each_is_parsed(
    chat_server: Served,
) -> None:
    # 250,000 messages in 7.2 MiB: each was validated and parsed on the event loop (8.5 s,
    # /health held 1.4 s) before the rendered text was found too long for the model.
    body = {"messages": [{"role": "user", "content": "x"}] * 250_000}
    with Watch(chat_server) as watch:
        response = _post(chat_server, body)
    assert "at most 2048" in assert_refused(response, 400, param="messages")
    # What is left is parsing 7.2 MiB of JSON on a worker thread, which holds the GIL for
    # ~0.1-0.2 s; the margin is for two busy CI cores (the refusal above is what the fix
    # changed; the old code's 1.4 s hold is in docs/security.md).
    watch.assert_unharmed(loop_s=1.0, memory_mib=256)
    _still_chats(chat_server)
