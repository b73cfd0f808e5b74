"""``embedding-server run-batch``, the command as users run it: the packaged MiniLM answers
a batch file with sentence-transformers' vectors and the HTTP API's errors, a killed run
resumes and answers every request once, and unusable files are refused before any load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from embedding_server.fingerprint import is_fingerprint
from sentence_transformers import SentenceTransformer

from tests.support.models import MINILM_DIR

SCRIPT = os.path.join(os.path.dirname(sys.executable), "embedding-server")
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TEXTS = ["a cat sits on the mat", "Das Wetter ist heute schön.", "x " * 120, "short"]


def run_batch(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")}
    return subprocess.run(
        [SCRIPT, "run-batch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def request(custom_id: str | None, url: str, body: dict[str, Any]) -> bytes:
    line: dict[str, Any] = {"method": "POST", "url": url, "body": body}
    if custom_id is not None:
        line["custom_id"] = custom_id
    return orjson.dumps(line) + b"\n"


def answers(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(raw) for raw in path.read_bytes().splitlines()]


def test_a_batch_file_gets_sentence_transformers_vectors_and_the_apis_errors(
    tmp_path: Path,
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(
        request("one", "/v1/embeddings", {"model": MODEL, "input": TEXTS[0]})
        + request("many", "/v1/embeddings", {"model": MODEL, "input": TEXTS})
        + b"\n"
        + request(
            "cohere",
            "/v2/embed",
            {
                "model": MODEL,
                "texts": TEXTS[:2],
                "input_type": "search_document",
                "embedding_types": ["float"],
            },
        )
        + request("score", "/score", {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:3]})
        + request(None, "/v1/embeddings", {"model": MODEL, "input": TEXTS[3]})
        + b"{not json\n"
        + request("nowhere", "/v1/chat/completions", {"model": MODEL})
        + request("no-input", "/v1/embeddings", {"model": MODEL})
        + request("other-model", "/v1/embeddings", {"model": "not-this-one", "input": "x"})
    )
    out = tmp_path / "out.jsonl"
    result = run_batch("-i", str(source), "-o", str(out), "--dtype", "float32")
    assert result.returncode == 0, result.stderr[-3000:]
    by_id = {(a["custom_id"] or a["id"]): a for a in answers(out)}
    # One answer per request line (the blank line is not one), each once.
    assert len(answers(out)) == 9 == len(by_id)
    # Every answer with vectors says what computed them: one fingerprint, the server's.
    fingerprints = {a["response"].get("fingerprint") for a in by_id.values() if a["error"] is None}
    assert len(fingerprints) == 1 and is_fingerprint(fingerprints.pop() or "")
    assert "fingerprint" not in by_id["no-input"]["response"]

    reference = SentenceTransformer(str(MINILM_DIR), device="cpu")
    expected = reference.encode(TEXTS, normalize_embeddings=True)

    def vectors(answer: dict[str, Any]) -> np.ndarray:
        assert answer["error"] is None and answer["response"]["status_code"] == 200, answer
        body = answer["response"]["body"]
        rows = (
            [d["embedding"] for d in body["data"]]
            if "data" in body
            else body["embeddings"]["float"]
        )
        return np.asarray(rows, dtype=np.float32)

    def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
        return (
            np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        )

    assert cosines(vectors(by_id["one"]), expected[:1]).min() >= 0.9999
    assert cosines(vectors(by_id["many"]), expected).min() >= 0.9999
    assert cosines(vectors(by_id["cohere"]), expected[:2]).min() >= 0.9999
    assert cosines(vectors(by_id["batch_req_6"]), expected[3:]).min() >= 0.9999
    scores = [d["score"] for d in by_id["score"]["response"]["body"]["data"]]
    want = [float(np.dot(expected[0], expected[1])), float(np.dot(expected[0], expected[2]))]
    assert np.allclose(scores, want, atol=1e-4)

    assert by_id["batch_req_7"]["error"]["code"] == "invalid_batch_line"
    assert "line 7 is not JSON" in by_id["batch_req_7"]["error"]["message"]
    assert "not a route of this server" in by_id["nowhere"]["error"]["message"]
    # Refused by the API itself, with its status and OpenAI-shaped body.
    missing = by_id["no-input"]
    assert missing["response"]["status_code"] == 400
    assert missing["response"]["body"]["error"]["param"] == "input"
    assert missing["error"]["code"] == missing["response"]["body"]["error"]["code"]
    assert by_id["other-model"]["response"]["status_code"] == 404
    assert by_id["other-model"]["response"]["body"]["error"]["param"] == "model"
    assert "9 requests answered" in result.stderr
    assert "(5 succeeded, 4 with an error, 0 by an earlier run)" in result.stderr


def test_a_killed_run_resumes_and_answers_every_request_once(tmp_path: Path) -> None:
    """SIGKILL mid-run, a torn last line, then the same command again: every custom_id has
    exactly one answer, and what the first run wrote is kept as it was."""
    source = tmp_path / "in.jsonl"
    count = 300
    source.write_bytes(
        b"".join(
            request(f"doc-{i}", "/v1/embeddings", {"model": "fake", "input": [f"text {i}"] * 3})
            for i in range(count)
        )
    )
    out = tmp_path / "out.jsonl"
    args = [
        "-i",
        str(source),
        "-o",
        str(out),
        "--model",
        "fake?delay_ms=20",
        "--max-in-flight",
        "4",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")}
    process = subprocess.Popen(
        [SCRIPT, "run-batch", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_bytes().count(b"\n") >= 40):
            assert process.poll() is None, "run-batch ended before it could be killed"
            assert time.monotonic() < deadline, "run-batch wrote no answers within 120 s"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    first = out.read_bytes()
    kept = first[: first.rindex(b"\n") + 1]
    assert 40 <= kept.count(b"\n") < count, "the kill came after the run had finished"
    # What a kill inside a write leaves: half of one more line.
    out.write_bytes(kept + first.splitlines()[0][:37])

    result = run_batch(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cut a torn last line" in result.stderr
    final = out.read_bytes()
    assert final.startswith(kept)
    ids = [a["custom_id"] for a in answers(out)]
    assert sorted(ids) == sorted(f"doc-{i}" for i in range(count))
    assert all(a["response"]["status_code"] == 200 for a in answers(out))


def test_a_repeated_custom_id_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    line = request("same", "/v1/embeddings", {"input": "x"})
    source.write_bytes(line + line)
    out = tmp_path / "out.jsonl"
    # A model that would need a download: the refusal comes before it is looked for.
    result = run_batch("-i", str(source), "-o", str(out), "--model", "no-such-org/no-such-model")
    assert result.returncode == 2
    assert "custom_id 'same' is on line 1 and line 2" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: (d / "out.jsonl").write_text('{"a": 1}\n'), "line 1: not a batch output line"),
        (lambda d: None, "No such file or directory"),
    ],
)
def test_an_unusable_input_or_output_is_refused_with_exit_2(
    tmp_path: Path, setup: Any, message: str
) -> None:
    setup(tmp_path)
    source = tmp_path / "in.jsonl"
    if (tmp_path / "out.jsonl").exists():
        source.write_bytes(request("a", "/v1/embeddings", {"input": "x"}))
    result = run_batch("-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", "fake")
    assert result.returncode == 2
    assert message in result.stderr


def test_a_model_that_is_not_the_expected_one_ends_the_run_with_1(tmp_path: Path) -> None:
    """A server stays up, not ready, when its fingerprint is not --expect-fingerprint's (a
    rollout stops at that pod); run-batch must end instead, saying why, answering nothing
    (it waited forever)."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(request("a", "/v1/embeddings", {"input": "x"}))
    out = tmp_path / "out.jsonl"
    other = "0123456789abcdef"
    result = run_batch(
        "-i", str(source), "-o", str(out), "--model", "fake", "--expect-fingerprint", other,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"expected {other}" in result.stderr
    assert not out.exists() or out.read_bytes() == b""


def test_an_s3_input_is_streamed_and_an_s3_output_refused(tmp_path: Path) -> None:
    """-i s3://bucket/key reads the requests from the store (moto on 127.0.0.1); -o s3://
    is refused before any load, saying why: an object cannot be appended to."""
    from tests.support.s3 import moto_s3

    count = 30
    with moto_s3() as store:
        bucket = store.new_bucket()
        with store.filesystem().open_output_stream(f"{bucket}/in/requests.jsonl") as stream:
            stream.write(
                b"".join(
                    request(f"doc-{i}", "/v1/embeddings", {"model": "fake", "input": f"t {i}"})
                    for i in range(count)
                )
            )
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")},
            **store.environment,
        }
        url = f"s3://{bucket}/in/requests.jsonl"
        out = tmp_path / "out.jsonl"
        result = subprocess.run(
            [SCRIPT, "run-batch", "-i", url, "-o", str(out), "--model", "fake"],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        ids = sorted(a["custom_id"] for a in answers(out))
        assert ids == sorted(f"doc-{i}" for i in range(count))

        refused = subprocess.run(
            [SCRIPT, "run-batch", "-i", url, "-o", f"s3://{bucket}/out.jsonl", "--model", "fake"],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            check=False,
        )
    assert refused.returncode == 2
    assert f"-o s3://{bucket}/out.jsonl: the output must be a local file" in refused.stderr
