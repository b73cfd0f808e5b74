"""The batch file format, line by line: what is a request, what each answer line says, and
what a resumed run reads back."""

from __future__ import annotations

import orjson
import pytest
from embedding_server.batch.lines import (
    BatchFileError,
    BatchRequest,
    LineRefusal,
    answer_line,
    answered_key,
    parse_line,
    refusal_line,
)

URLS = frozenset({"/v1/embeddings", "/score"})


def line(**fields: object) -> bytes:
    return orjson.dumps(fields) + b"\n"


def test_a_request_line_keeps_its_custom_id_url_and_body() -> None:
    body = {"model": "m", "input": ["a", "b"], "dimensions": 8}
    item = parse_line(3, line(custom_id="x", method="POST", url="/v1/embeddings", body=body), URLS)
    assert isinstance(item, BatchRequest)
    assert (item.line, item.custom_id, item.url, item.key) == (3, "x", "/v1/embeddings", "x")
    assert orjson.loads(item.body) == body
    assert item.request_id == "batch_req_3"


def test_a_line_without_custom_id_is_known_by_its_number() -> None:
    item = parse_line(7, line(url="/score", body={"text_1": "a", "text_2": "b"}), URLS)
    assert isinstance(item, BatchRequest)
    assert item.custom_id is None and item.key == 7


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"not json\n", "line 5 is not JSON"),
        (b"[1, 2]\n", "a batch line is a JSON object"),
        (line(custom_id=3, url="/score", body={}), "custom_id must be a string, not a number"),
        (line(custom_id="x", url="/metrics", body={}), "url '/metrics' is not a route"),
        (line(custom_id="x", method="GET", url="/score", body={}), "method must be POST"),
        (line(custom_id="x", url="/score", body=[1]), "body must be a JSON object, not an array"),
        (line(custom_id="x", url="/score", body={}, extra=1), "unknown field 'extra'"),
    ],
)
def test_a_line_that_is_not_a_request_is_refused_with_its_number_and_field(
    raw: bytes, reason: str
) -> None:
    item = parse_line(5, raw, URLS)
    assert isinstance(item, LineRefusal)
    assert reason in item.message and item.message.startswith("line 5")
    answer = orjson.loads(refusal_line(item))
    assert answer["response"] is None
    assert answer["error"]["code"] == "invalid_batch_line"
    assert answer["error"]["line"] == 5 and reason in answer["error"]["message"]
    assert answered_key(refusal_line(item)) == item.key


def test_an_unknown_url_names_the_routes_there_are() -> None:
    item = parse_line(1, line(custom_id="x", url="/v1/chat/completions", body={}), URLS)
    assert isinstance(item, LineRefusal)
    assert "/v1/embeddings" in item.message and "/score" in item.message


def test_an_answer_line_splices_the_body_and_lifts_an_error_out_of_it() -> None:
    request = BatchRequest(4, "x", "/v1/embeddings", b"{}")
    ok_body = b'{"object":"list","data":[{"embedding":[0.1,-2.5e-08]}]}'
    ok = orjson.loads(answer_line(request, 200, "rid", ok_body))
    assert ok == {
        "id": "batch_req_4",
        "custom_id": "x",
        "response": {"status_code": 200, "request_id": "rid", "body": orjson.loads(ok_body)},
        "error": None,
    }
    # The vector's floats are the server's text, not re-encoded.
    assert b"-2.5e-08" in answer_line(request, 200, "rid", ok_body)
    bad_body = orjson.dumps(
        {
            "error": {
                "message": "input: Field required",
                "type": "invalid_request_error",
                "param": "input",
                "code": "invalid_value",
            }
        }
    )
    bad = orjson.loads(answer_line(request, 400, "rid", bad_body))
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "input"
    assert bad["error"] == {"code": "invalid_value", "message": "input: Field required"}


def test_an_answer_line_keeps_the_answers_fingerprint() -> None:
    request = BatchRequest(2, "y", "/v1/embeddings", b"{}")
    line = answer_line(request, 200, "rid", b'{"data":[]}', fingerprint="0123456789abcdef")
    assert orjson.loads(line)["response"]["fingerprint"] == "0123456789abcdef"
    assert "fingerprint" not in orjson.loads(answer_line(request, 200, "rid", b"{}"))["response"]


def test_an_answer_that_is_not_json_is_kept_as_text() -> None:
    request = BatchRequest(1, None, "/score", b"{}")
    answer = orjson.loads(answer_line(request, 502, "rid", b"Bad Gateway", json_body=False))
    assert answer["response"]["body"] == "Bad Gateway"
    assert answer["error"]["code"] == "502"
    assert answered_key(answer_line(request, 502, "rid", b"x", json_body=False)) == 1


@pytest.mark.parametrize("raw", [b"{", b'{"id": "x"}', b'{"custom_id": null, "id": "other_1"}'])
def test_a_line_that_is_not_batch_output_is_refused(raw: bytes) -> None:
    with pytest.raises(BatchFileError, match="not a batch output line"):
        answered_key(raw)
