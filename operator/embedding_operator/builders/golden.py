"""The golden-vectors contract, as the pod template carries it (pure: no cluster, no clock).

Each server pod is told which record its vectors answer to: ``--golden-vectors`` names the file
``<contract key>.json`` in the ConfigMap ``<name>-golden``, mounted read-only and optional (it
does not exist until the service's first pod of that model turned Ready and the operator
recorded what it embeds, ``embedding_operator.golden``). A server whose file is absent embeds
its probe set and waits; one whose file is there compares before it reports ready, and keeps
comparing as the kubelet refreshes the volume.

The contract key is a hash of the spec fields that choose the computation on purpose: the
model and its revision, the task, the embedding fields and the server's dtype, backend and
quantization. A change of one of them is a new model, recorded anew. Everything else that may
move a vector without anyone asking (the GPU type a pod lands on, what ``auto`` resolves to
there, the image's libraries, ``server.extraArgs``) keeps the key, so the pod it moves is
compared with the record and kept out when it differs. Names, aliases, replicas, resources and
scaling keep the key too: they decide no vector.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from embedding_operator.builders.common import Owner
from embedding_operator.spec import EmbeddingServiceSpec

CONTRACT_LABEL = "embedding-operator.dev/contract"
MOUNT_PATH = "/etc/embedding-server/golden"
VOLUME_NAME = "golden"
KEY_LENGTH = 12


def contract_key(spec: EmbeddingServiceSpec) -> str:
    """12 hex digits of sha256 over the fields that choose the model's computation."""
    decided = {
        "model": spec.model.model_dump(
            by_alias=True, include={"name", "revision", "trust_remote_code"}
        ),
        "task": spec.task,
        "embedding": spec.embedding.model_dump(by_alias=True, exclude_none=True),
        "server": spec.server.model_dump(
            by_alias=True, include={"dtype", "backend", "quantization"}
        ),
    }
    canonical = json.dumps(decided, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_LENGTH]


def configmap_name(owner: Owner) -> str:
    return f"{owner.name}-golden"


def record_file(key: str) -> str:
    """The ConfigMap key (and file name in the mount) of one contract's record."""
    return f"{key}.json"


def server_args(spec: EmbeddingServiceSpec) -> list[str]:
    if spec.contract.policy == "disabled":
        return []
    key = contract_key(spec)
    return [
        "--golden-vectors",
        f"{MOUNT_PATH}/{record_file(key)}",
        "--golden-min-cosine",
        format(spec.contract.threshold, "g"),
    ]


def volume(owner: Owner) -> dict[str, Any]:
    # optional: the pod starts before the record exists; the kubelet fills the volume in when
    # the ConfigMap appears and refreshes it on change (files swapped through a symlink).
    return {"name": VOLUME_NAME, "configMap": {"name": configmap_name(owner), "optional": True}}


def volume_mount() -> dict[str, Any]:
    return {"name": VOLUME_NAME, "mountPath": MOUNT_PATH, "readOnly": True}
