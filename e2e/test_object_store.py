"""The e2e tier's object store (e2e/harness/object_store.py) as the EmbeddingJob workers meet
it: a pod on the real node, in the server image (where `embedding-server job` runs), reads a
Parquet file that pyarrow on the host wrote through the S3 API, and writes one back, with the
standard AWS variables and nothing else; the store refuses a wrong secret."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq
import pytest

from e2e.harness.cluster import REAL_NODE_TAINT_KEY, KubeClient, poll_until
from e2e.harness.images import ImageSet
from e2e.harness.node import NODE_NAME
from e2e.harness.object_store import REGION, ObjectStore
from e2e.harness.operator import field_of, get_json

POD_TIMEOUT_S = 180.0

# In the pod: read the host's file through S3, write its ids doubled back, print what it read.
ROUND_TRIP = """
import json, os, sys
import pyarrow as pa, pyarrow.fs, pyarrow.parquet as pq
bucket = sys.argv[1]
fs = pyarrow.fs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"])
table = pq.read_table(f"{bucket}/in/rows.parquet", filesystem=fs)
doubled = pa.table({"id": [i * 2 for i in table.column("id").to_pylist()]})
pq.write_table(doubled, f"{bucket}/out/doubled.parquet", filesystem=fs)
print(json.dumps({"rows": table.num_rows, "texts": table.column("text").to_pylist()[:2]}))
"""


@pytest.mark.local_node
def test_a_pod_on_the_real_node_reads_and_writes_parquet_through_the_store(
    cluster: KubeClient, object_store: ObjectStore, e2e_images: ImageSet, namespace: str
) -> None:
    bucket = object_store.create_bucket("roundtrip")
    fs = object_store.filesystem()
    rows = pa.table({"id": list(range(1000)), "text": [f"row {i}" for i in range(1000)]})
    pq.write_table(rows, f"{bucket}/in/rows.parquet", filesystem=fs)

    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "s3-roundtrip", "namespace": namespace},
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": {"kubernetes.io/hostname": NODE_NAME},
                "tolerations": [
                    {"key": REAL_NODE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
                ],
                "containers": [
                    {
                        "name": "roundtrip",
                        "image": e2e_images.server,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["python", "-c", ROUND_TRIP, bucket],
                        "env": [{"name": k, "value": v} for k, v in object_store.pod_env().items()],
                        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
                    }
                ],
            },
        }
    )

    def finished() -> str | None:
        pod = get_json(cluster, "pod", "s3-roundtrip", "-n", namespace)
        phase: str | None = field_of(pod, "status", "phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = poll_until(finished, timeout=POD_TIMEOUT_S, what="the round-trip pod", interval=1.0)
    logs = cluster.kubectl("logs", "-n", namespace, "s3-roundtrip").stdout
    assert phase == "Succeeded", (
        f"the pod failed:\n{logs}\nlast requests of the store:\n{object_store.log_tail()}"
    )
    assert json.loads(logs.strip().splitlines()[-1]) == {"rows": 1000, "texts": ["row 0", "row 1"]}
    back = pq.read_table(f"{bucket}/out/doubled.parquet", filesystem=fs)
    assert back.column("id").to_pylist() == [i * 2 for i in range(1000)]

    wrong = pyarrow.fs.S3FileSystem(
        access_key=object_store.access_key,
        secret_key="not-the-secret",
        endpoint_override=object_store.url,
        region=REGION,
        scheme="http",
    )
    with pytest.raises(OSError, match=r"(?i)signature|denied|forbidden"):
        pq.read_table(f"{bucket}/in/rows.parquet", filesystem=wrong)
