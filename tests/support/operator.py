"""Test doubles for the operator's cluster-free tests: render inputs and an in-memory API."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import yaml
from embedding_operator.builders.common import Owner, RenderInput
from embedding_operator.kube import ApiError, ObjectRef, ref_of, resource_path
from embedding_operator.profiles import GpuProfiles
from embedding_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "embeddingservices.yaml"
JOB_CRD_PATH = ROOT / "crds" / "embeddingjobs.yaml"


def _kinds(path: Path) -> set[str]:
    return {str(doc.get("kind")) for doc in yaml.safe_load_all(path.read_text()) if doc}


ALL_EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
EXAMPLES = [p for p in ALL_EXAMPLES if _kinds(p) == {"EmbeddingService"}]
"""The EmbeddingService examples."""
JOB_EXAMPLES = [p for p in ALL_EXAMPLES if _kinds(p) == {"EmbeddingJob"}]
"""The EmbeddingJob examples."""


def render_input(
    spec: dict[str, Any], name: str = "emb", namespace: str = "ns", uid: str = "uid-1"
) -> RenderInput:
    parsed = parse_spec(spec)
    return RenderInput(
        owner=Owner(name=name, namespace=namespace, uid=uid, generation=1),
        spec=parsed,
        profile=GpuProfiles.builtin().resolve(parsed.gpu.type),
    )


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def _others_fields(live: dict[str, Any], manifest: dict[str, Any]) -> bool:
    """Whether ``live`` holds values another writer set that ``manifest`` would change
    (approximately: it is not controlled by the manifest's owner, and its spec differs)."""
    ours = {r.get("uid") for r in manifest["metadata"].get("ownerReferences") or []}
    theirs = {r.get("uid") for r in live["metadata"].get("ownerReferences") or []}
    return not (ours & theirs) and live.get("spec") != manifest.get("spec")


class FakeCluster:
    """An in-memory API: enough semantics (uids, generations, apply, status) for reconcile."""

    def __init__(self) -> None:
        self.objects: dict[ObjectRef, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self._counter = itertools.count(1)

    def add(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{next(self._counter)}")
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._counter))
        self.objects[ref_of(obj)] = obj
        return obj

    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        self.calls.append(("get", ref.kind))
        resource_path(ref)  # a kind the real client has no path for fails here too
        obj = self.objects.get(ref)
        return copy.deepcopy(obj) if obj is not None else None

    def apply(self, manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        """Server-side apply. As the API server does: a ``metadata.uid`` that is not the live
        object's is refused (422, the uid is immutable), and without ``force`` fields another
        manager set to other values are a conflict (409)."""
        self.calls.append(("apply", manifest["kind"]))
        resource_path(ref_of(manifest))  # a kind the real client has no path for fails here too
        ref = ref_of(manifest)
        live = self.objects.get(ref)
        if live is None:
            return copy.deepcopy(self.add(manifest))
        uid = manifest["metadata"].get("uid")
        if uid is not None and uid != live["metadata"]["uid"]:
            raise ApiError(422, f'metadata.uid: Invalid value: "{uid}": field is immutable')
        if not force and _others_fields(live, manifest):
            raise ApiError(409, "Apply failed with conflicts: fields owned by another manager")
        before = copy.deepcopy(live.get("spec"))
        # Server-side apply, approximately: our fields win; a field we dropped goes away.
        if "spec" in live and "spec" in manifest and "replicas" not in manifest["spec"]:
            live["spec"].pop("replicas", None)
        _merge(live, copy.deepcopy(manifest))
        if manifest["kind"] == "Service" and "selector" in manifest.get("spec", {}):
            # The selector is ours whole: server-side apply drops a key we no longer send.
            live["spec"]["selector"] = copy.deepcopy(manifest["spec"]["selector"])
        if live.get("spec") != before:
            live["metadata"]["generation"] += 1
        live["metadata"]["resourceVersion"] = str(next(self._counter))
        return copy.deepcopy(live)

    def merge_patch(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("merge_patch", manifest["kind"]))
        resource_path(ref_of(manifest))  # a kind the real client has no path for fails here too
        live = self.objects[ref_of(manifest)]
        uid = manifest["metadata"].get("uid")
        if uid is not None and uid != live["metadata"]["uid"]:
            raise ApiError(422, f'metadata.uid: Invalid value: "{uid}": field is immutable')
        _merge(live, copy.deepcopy(manifest))
        live["metadata"]["resourceVersion"] = str(next(self._counter))
        return copy.deepcopy(live)

    def delete(self, ref: ObjectRef, uid: str | None = None) -> None:
        self.calls.append(("delete", ref.kind))
        resource_path(ref)  # a kind the real client has no path for fails here too
        live = self.objects.get(ref)
        if live is not None and uid is not None and live["metadata"].get("uid") != uid:
            raise ApiError(409, "Precondition failed: UID in precondition")
        self.objects.pop(ref, None)

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self.calls.append(("get", "Pod"))
        wanted = dict(part.split("=", 1) for part in label_selector.split(","))
        return [
            copy.deepcopy(obj)
            for ref, obj in self.objects.items()
            if ref.kind == "Pod"
            and ref.namespace == namespace
            and wanted.items() <= (obj["metadata"].get("labels") or {}).items()
        ]

    def patch_status(self, ref: ObjectRef, status: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("status", ref.kind))
        resource_path(ref)  # a kind the real client has no path for fails here too
        obj = self.objects[ref]
        obj["status"] = _merge(obj.get("status") or {}, status)
        obj["metadata"]["resourceVersion"] = str(next(self._counter))
        return copy.deepcopy(obj)

    # Lease API (create/replace with compare-and-swap), for leader election tests.
    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("create", manifest["kind"]))
        if "name" not in manifest["metadata"]:
            manifest = copy.deepcopy(manifest)
            manifest["metadata"]["name"] = manifest["metadata"]["generateName"] + str(
                next(self._counter)
            )
        if ref_of(manifest) in self.objects:
            raise ApiError(409, "already exists")
        return copy.deepcopy(self.add(manifest))

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        ref = ref_of(manifest)
        live = self.objects.get(ref)
        if live is None:
            raise ApiError(404, "not found")
        if manifest["metadata"].get("resourceVersion") != live["metadata"]["resourceVersion"]:
            raise ApiError(409, "conflict")
        new = copy.deepcopy(manifest)
        new["metadata"] = {**live["metadata"], "resourceVersion": str(next(self._counter))}
        self.objects[ref] = new
        return copy.deepcopy(new)

    def writes(self) -> list[tuple[str, str]]:
        return [c for c in self.calls if c[0] != "get"]


def golden_answer(
    fingerprint: str = "0123456789abcdef", state: str = "unchecked", **check: Any
) -> dict[str, Any]:
    """A server's ``GET /golden`` answer (the shape ``embedding_server.api.golden`` serves)."""
    return {
        "probe_set": "v1",
        "fingerprint": fingerprint,
        "fingerprint_inputs": {"dtype": "float32"},
        "model": "m",
        "dimensions": 2,
        "probes": ["hello", "world"],
        "vectors": ["AACAPwAAAAA=", "AAAAAAAAgD8="],
        "check": {"state": state, **check},
    }


class FakeGolden:
    """The operator's view of the pods' probe ports: ``answers`` by pod IP; an IP without one
    is unreachable. ``asked`` lists the IPs asked, in order."""

    def __init__(self, answers: dict[str, dict[str, Any]] | None = None) -> None:
        self.answers = answers or {}
        self.asked: list[str] = []

    def __call__(self, ip: str) -> dict[str, Any]:
        from embedding_operator.golden import GoldenUnreachable

        self.asked.append(ip)
        if ip not in self.answers:
            raise GoldenUnreachable(f"GET http://{ip}:8001/golden: connection refused")
        return copy.deepcopy(self.answers[ip])


def server_pod(
    name: str,
    *,
    key: str,
    ip: str = "10.0.0.1",
    ready: bool = True,
    node: str = "node-1",
    instance: str = "emb",
    namespace: str = "team",
) -> dict[str, Any]:
    """A running server pod of EmbeddingService ``instance`` with contract key ``key``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": "embedding-server",
                "app.kubernetes.io/instance": instance,
                "embedding-operator.dev/contract": key,
            },
        },
        "spec": {"nodeName": node},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "embedding-server", "state": {"running": {}}}],
        },
    }


def golden_record(
    key: str,
    answer: dict[str, Any],
    *,
    name: str = "emb",
    namespace: str = "team",
    owner_uid: str = "owner-uid",
) -> dict[str, Any]:
    """The ConfigMap ``<name>-golden`` as the operator writes it, holding ``answer`` for
    contract ``key``."""
    import json

    record = {k: v for k, v in answer.items() if k != "check"}
    record["recordedFrom"] = {"pod": f"{name}-first", "node": "node-1"}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{name}-golden",
            "namespace": namespace,
            "ownerReferences": [
                {
                    "apiVersion": "embedding-operator.dev/v1alpha1",
                    "kind": "EmbeddingService",
                    "name": name,
                    "uid": owner_uid,
                    "controller": True,
                }
            ],
        },
        "data": {f"{key}.json": json.dumps(record)},
    }


def rolled_out(cluster: FakeCluster, ref: ObjectRef, ready: int | None = None) -> None:
    """What kube-controller-manager does once a Deployment's pods are ready: its status says
    every replica of its spec runs the current template, ``ready`` of them ready (all)."""
    dep = cluster.objects[ref]
    want = dep["spec"].get("replicas", 1)
    ready = want if ready is None else ready
    dep["metadata"]["resourceVersion"] += "+status"
    dep["status"] = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": want,
        "updatedReplicas": want,
        "readyReplicas": ready,
        "availableReplicas": ready,
        "conditions": [{"type": "Available", "status": "True" if ready else "False"}],
    }
