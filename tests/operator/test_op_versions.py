"""Which watch events of KEDA's ScaledObjects wake the reconciler (versions.ScaledObjectEvents)."""

from __future__ import annotations

import copy
from typing import Any

from embedding_operator.versions import ScaledObjectEvents


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
    events = ScaledObjectEvents()
    assert events.worth_a_reconcile(
        "default", "minilm", scaledobject(last_active="2026-11-28T18:41:02Z"), deleted=False
    ), "the first sighting always counts"
    for n, second in enumerate(("07", "12", "17.5", "59")):
        body = scaledobject(version=str(101 + n), last_active=f"2026-11-28T18:41:{second}Z")
        assert not events.worth_a_reconcile("default", "minilm", body, deleted=False), second


def test_the_next_minute_a_condition_or_a_spec_change_wakes_the_reconciler() -> None:
    events = ScaledObjectEvents()
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
    events = ScaledObjectEvents()
    body = scaledobject(last_active="2026-11-28T18:41:02Z")
    events.worth_a_reconcile("default", "minilm", body, deleted=False)
    assert events.worth_a_reconcile("default", "minilm", body, deleted=True)
    assert events.worth_a_reconcile("default", "minilm", body, deleted=False), (
        "a re-created ScaledObject is a first sighting"
    )


def test_objects_are_told_apart_by_namespace_and_name() -> None:
    events = ScaledObjectEvents()
    body = scaledobject(last_active="2026-11-28T18:41:02Z")
    assert events.worth_a_reconcile("default", "minilm", body, deleted=False)
    assert events.worth_a_reconcile("other", "minilm", body, deleted=False)
    assert events.worth_a_reconcile("default", "bge", body, deleted=False)
