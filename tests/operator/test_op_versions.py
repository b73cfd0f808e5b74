"""Which watch events wake the reconciler (versions.EssenceChanges): ScaledObjects, owners."""

from __future__ import annotations

import copy
from typing import Any

from embedding_operator.versions import EssenceChanges, owner_essence, scaledobject_essence


def scaledobject(*, version: str = "100", last_active: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "ScaledObjectReady"},
            {"type": "Active", "status": "True", "reason": "ScalerActive"},
        ],
        "hpaName": "keda-hpa-minilm",
    }
    if last_active is not None:
        status["lastActiveTime"] = last_active
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {
            "name": "minilm",
            "namespace": "default",
            "resourceVersion": version,
            "generation": 1,
            "labels": {"app.kubernetes.io/managed-by": "embedding-operator"},
            "managedFields": [{"manager": "keda", "time": f"2026-11-28T18:00:{version[-2:]}Z"}],
        },
        "spec": {"minReplicaCount": 0, "maxReplicaCount": 4, "pollingInterval": 5},
        "status": status,
    }


def test_kedas_per_poll_last_active_time_within_a_minute_wakes_nothing() -> None:
    events = EssenceChanges(scaledobject_essence)
    assert events.worth_a_reconcile(
        "default", "minilm", scaledobject(last_active="2026-11-28T18:41:02Z"), deleted=False
    ), "the first sighting always counts"
    for n, second in enumerate(("07", "12", "17.5", "59")):
        body = scaledobject(version=str(101 + n), last_active=f"2026-11-28T18:41:{second}Z")
        assert not events.worth_a_reconcile("default", "minilm", body, deleted=False), second


def test_the_next_minute_a_condition_or_a_spec_change_wakes_the_reconciler() -> None:
    events = EssenceChanges(scaledobject_essence)
    base = scaledobject(last_active="2026-11-28T18:41:02Z")
    events.worth_a_reconcile("default", "minilm", base, deleted=False)

    next_minute = scaledobject(version="101", last_active="2026-11-28T18:42:01Z")
    assert events.worth_a_reconcile("default", "minilm", next_minute, deleted=False)

    inactive = copy.deepcopy(next_minute)
    inactive["metadata"]["resourceVersion"] = "102"
    inactive["status"]["conditions"][1]["status"] = "False"
    assert events.worth_a_reconcile("default", "minilm", inactive, deleted=False)

    edited = copy.deepcopy(inactive)
    edited["metadata"]["resourceVersion"] = "103"
    edited["spec"]["maxReplicaCount"] = 9  # someone else's edit: drift to undo
    assert events.worth_a_reconcile("default", "minilm", edited, deleted=False)

    relabelled = copy.deepcopy(edited)
    relabelled["metadata"]["resourceVersion"] = "104"
    relabelled["metadata"]["labels"]["team"] = "search"
    assert events.worth_a_reconcile("default", "minilm", relabelled, deleted=False)


def test_deletion_always_counts_and_forgets_the_object() -> None:
    events = EssenceChanges(scaledobject_essence)
    body = scaledobject(last_active="2026-11-28T18:41:02Z")
    events.worth_a_reconcile("default", "minilm", body, deleted=False)
    assert events.worth_a_reconcile("default", "minilm", body, deleted=True)
    assert events.worth_a_reconcile("default", "minilm", body, deleted=False), (
        "a re-created ScaledObject is a first sighting"
    )


def test_objects_are_told_apart_by_namespace_and_name() -> None:
    events = EssenceChanges(scaledobject_essence)
    body = scaledobject(last_active="2026-11-28T18:41:02Z")
    assert events.worth_a_reconcile("default", "minilm", body, deleted=False)
    assert events.worth_a_reconcile("other", "minilm", body, deleted=False)
    assert events.worth_a_reconcile("default", "bge", body, deleted=False)


def embeddingservice(version: str = "7") -> dict[str, Any]:
    return {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {
            "name": "minilm",
            "namespace": "default",
            "resourceVersion": version,
            "generation": 1,
            "labels": {"team": "search"},
            "annotations": {},
        },
        "spec": {"model": "sentence-transformers/all-MiniLM-L6-v2"},
        "status": {"phase": "Pending"},
    }


def test_an_embeddingservice_wakes_the_reconciler_on_creation_and_edits_not_status_writes() -> None:
    events = EssenceChanges(owner_essence)
    created = embeddingservice()
    assert events.worth_a_reconcile("default", "minilm", created, deleted=False), (
        "created, or listed at startup: reconciled"
    )
    status_write = copy.deepcopy(created)
    status_write["metadata"]["resourceVersion"] = "8"
    status_write["status"] = {"phase": "Ready", "readyReplicas": 1}
    assert not events.worth_a_reconcile("default", "minilm", status_write, deleted=False), (
        "our own status write must not wake the reconciler again"
    )
    for change in ("spec", "labels", "annotations", "deletion"):
        edited = copy.deepcopy(status_write)
        edited["metadata"]["resourceVersion"] = f"9-{change}"
        if change == "spec":
            edited["spec"]["replicas"] = 3
        elif change == "labels":
            edited["metadata"]["labels"]["tier"] = "gold"
        elif change == "annotations":
            edited["metadata"]["annotations"]["embedding-operator.dev/served-model-aliases"] = "a"
        else:
            edited["metadata"]["deletionTimestamp"] = "2026-11-28T18:40:00Z"
        assert events.worth_a_reconcile("default", "minilm", edited, deleted=False), change
        status_write = edited
