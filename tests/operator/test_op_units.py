"""Small pure pieces: spec parsing, profiles, status merging, subset compare, settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from embedding_operator.apply import is_subset
from embedding_operator.kube import ObjectRef, controller_of, resource_path
from embedding_operator.profiles import (
    GpuProfiles,
    ProfileConfigError,
    UnknownGpuTypeError,
)
from embedding_operator.settings import OperatorSettings
from embedding_operator.spec import InvalidSpecError, parse_spec
from embedding_operator.status import Condition, merge_conditions, status_patch
from embedding_operator.workqueue import retry_delay

# --- spec ---------------------------------------------------------------------------------


def test_defaults_mirror_the_crd() -> None:
    spec = parse_spec({"model": {"name": "BAAI/bge-small-en-v1.5"}})
    assert spec.gpu.type == "cpu" and spec.parallelism.tensor_parallel_size == 1
    assert spec.replicas == 1 and not spec.autoscaling.enabled
    assert (spec.rollout.max_surge, spec.rollout.max_unavailable) == (0, 1)
    assert spec.service.port == 80 and spec.model_cache.mode == "none"
    assert spec.served_name == "bge-small-en-v1.5"


def test_served_name() -> None:
    assert parse_spec({"model": {"name": "hf://org/m"}}).served_name == "m"
    assert parse_spec({"model": {"name": "/cache/models/m2/"}}).served_name == "m2"
    assert parse_spec({"model": {"name": "x/y"}, "servedModelName": "z"}).served_name == "z"


def test_errors_name_field_paths() -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec({"model": {"name": "m"}, "replicas": -1, "bogus": 1})
    message = str(err.value)
    assert "spec.replicas:" in message and "spec.bogus:" in message


# --- profiles -------------------------------------------------------------------------------


def test_builtin_profiles_match_gpu_feature_discovery_labels() -> None:
    profiles = GpuProfiles.builtin()
    assert profiles.resolve("h100").node_selector == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
    }
    assert profiles.resolve("l4").node_selector == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert profiles.resolve("a100-80gb").node_selector == {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"
    }
    assert profiles.resolve("cpu").resource_name is None
    with pytest.raises(UnknownGpuTypeError, match="known types: a100-40gb"):
        profiles.resolve("tpu")


def test_profile_file_overlays_builtins(tmp_path: Path) -> None:
    path = tmp_path / "profiles.yaml"
    path.write_text(
        "profiles:\n"
        "  h100-mig:\n"
        "    resourceName: nvidia.com/mig-3g.40gb\n"
        "    nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}\n"
        "  l4:\n"
        "    nodeSelector: {pool: l4}\n"
    )
    profiles = GpuProfiles.load(path)
    assert profiles.resolve("h100-mig").resource_name == "nvidia.com/mig-3g.40gb"
    assert profiles.resolve("l4").node_selector == {"pool": "l4"}
    assert profiles.resolve("h100").resource_name == "nvidia.com/gpu"
    # Overlaid fields only: l4 keeps its GPU resource and toleration.
    assert profiles.resolve("l4").resource_name == "nvidia.com/gpu"
    assert profiles.resolve("l4").tolerations == profiles.resolve("h100").tolerations


def test_overlaid_cpu_profile_stays_cpu(tmp_path: Path) -> None:
    """A dedicated CPU pool (`gpuProfiles.cpu.nodeSelector` in the chart) must not turn the cpu
    profile into one that asks for a GPU; Helm drops nulls, so "" spells no accelerator."""
    path = tmp_path / "profiles.yaml"
    path.write_text(
        "profiles:\n"
        "  cpu: {nodeSelector: {pool: cpu}}\n"
        "  cpu-big: {resourceName: '', nodeSelector: {pool: big}}\n"
    )
    profiles = GpuProfiles.load(path)
    assert profiles.resolve("cpu").resource_name is None
    assert profiles.resolve("cpu").node_selector == {"pool": "cpu"}
    assert profiles.resolve("cpu-big").resource_name is None


@pytest.mark.parametrize("text", ["profiles: [1]", "profiles:\n  x: {bogus: 1}", "[: bad"])
def test_malformed_profile_file_fails_loudly(tmp_path: Path, text: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ProfileConfigError):
        GpuProfiles.load(path)
    with pytest.raises(ProfileConfigError):
        GpuProfiles.load(tmp_path / "missing.yaml")


# --- status ---------------------------------------------------------------------------------


def test_merge_conditions_keeps_transition_time_unless_status_flips() -> None:
    old = [
        {
            "type": "Ready",
            "status": "False",
            "reason": "A",
            "message": "",
            "lastTransitionTime": "t0",
            "observedGeneration": 1,
        }
    ]
    same = merge_conditions(old, [Condition("Ready", "False", "B", "m")], generation=2, now="t1")
    assert same[0]["lastTransitionTime"] == "t0" and same[0]["reason"] == "B"
    assert same[0]["observedGeneration"] == 2
    flipped = merge_conditions(old, [Condition("Ready", "True", "C", "")], generation=2, now="t1")
    assert flipped[0]["lastTransitionTime"] == "t1"


def test_status_patch_is_minimal_and_removes_stale_keys() -> None:
    old = {"a": 1, "model": {"name": "x", "revision": "r"}, "gone": 2}
    assert status_patch(old, old) is None
    patch = status_patch(old, {"a": 1, "model": {"name": "x"}})
    assert patch == {"model": {"revision": None}, "gone": None}


# --- apply ----------------------------------------------------------------------------------


def test_subset_compare() -> None:
    assert is_subset({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}, "d": 3})
    assert not is_subset({"a": {"b": 1}}, {"a": {"b": 2}})
    assert not is_subset({"a": [1, 2]}, {"a": [1]})
    assert is_subset({"q": "32000"}, {"q": "32k"})
    assert is_subset({"q": "1024Mi"}, {"q": "1Gi"})
    assert not is_subset({"q": "1"}, {"q": 1})  # type matters outside quantities
    assert not is_subset({"flag": True}, {"flag": 1})
    assert not is_subset({"name": "x"}, {})


def test_resource_paths() -> None:
    assert resource_path(ObjectRef("v1", "Service", "n", "s")) == "/api/v1/namespaces/n/services/s"
    assert (
        resource_path(ObjectRef("apps/v1", "Deployment", "n", "d"))
        == "/apis/apps/v1/namespaces/n/deployments/d"
    )
    assert (
        resource_path(
            ObjectRef("embedding-operator.dev/v1alpha1", "EmbeddingService", "n", "e"), "status"
        )
        == "/apis/embedding-operator.dev/v1alpha1/namespaces/n/embeddingservices/e/status"
    )


def test_controller_of_finds_the_one_controller_reference() -> None:
    owner = {"apiVersion": "x/v1", "kind": "EmbeddingService", "name": "e", "uid": "u1"}
    obj = {
        "metadata": {
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "u0"},
                {**owner, "controller": True},
            ]
        }
    }
    assert controller_of(obj) == {**owner, "controller": True}
    assert controller_of({"metadata": {"ownerReferences": [owner]}}) is None
    assert controller_of({"metadata": {}}) is None


def test_retry_delay_grows_and_caps() -> None:
    delays = [retry_delay(i) for i in range(8)]
    assert delays[:4] == [5, 10, 20, 40]
    assert max(delays) == 60 and delays == sorted(delays)


# --- settings -------------------------------------------------------------------------------


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDDING_OPERATOR_NAMESPACES", "a, b,team-*")
    monkeypatch.setenv("EMBEDDING_OPERATOR_LEADER_ELECT", "true")
    monkeypatch.setenv("EMBEDDING_OPERATOR_LIVENESS", "")
    config = OperatorSettings()
    assert config.namespaces == ["a", "b", "team-*"] and not config.clusterwide
    assert config.leader_elect and config.liveness is None
    assert OperatorSettings(namespaces=[]).clusterwide


def test_lease_timing_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="retry_period_seconds"):
        OperatorSettings(lease_duration_seconds=5, renew_deadline_seconds=10)


def test_controller_dedupes_and_resyncs_known_objects() -> None:
    import asyncio
    import threading

    from embedding_operator.controller import Controller

    calls: list[tuple[str, str]] = []
    release = threading.Event()

    class Recorder:
        def reconcile(self, namespace: str, name: str) -> None:
            release.wait(5)
            calls.append((namespace, name))

        def forget(self, namespace: str, name: str) -> None:
            pass

    controller = Controller(Recorder(), resync_seconds=0.05, workers=2)
    controller.seen("a", "x")
    controller.seen("b", "y")
    controller.seen("b", "z")
    controller.gone("b", "z")

    async def main() -> None:
        stop = asyncio.Event()
        for _ in range(5):  # a burst of child events for one owner ...
            controller.enqueue("c", "burst")
        task = asyncio.create_task(controller.run(stop))
        release.set()
        while len(set(calls)) < 3:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert calls.count(("c", "burst")) == 1  # ... is one reconcile
    assert {("a", "x"), ("b", "y")} <= set(calls) and ("b", "z") not in calls


def test_events_are_posted_as_core_v1_events() -> None:
    from embedding_operator.events import ApiEventRecorder
    from embedding_operator.kube import ApiError

    from tests.support.operator import FakeCluster

    cluster = FakeCluster()
    body = {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {"name": "emb", "namespace": "ns", "uid": "u1"},
    }
    ApiEventRecorder(cluster, "op-1")(
        body, type="Warning", reason="UnknownGPUType", message="x" * 5000
    )
    (event,) = [o for o in cluster.objects.values() if o["kind"] == "Event"]
    assert event["metadata"]["namespace"] == "ns"
    assert event["involvedObject"]["uid"] == "u1"
    assert (event["type"], event["reason"]) == ("Warning", "UnknownGPUType")
    assert len(event["message"]) == 1024 and event["reportingInstance"] == "op-1"

    def failing(manifest: dict[str, object]) -> dict[str, object]:
        raise ApiError(403, "forbidden")

    cluster.create = failing  # type: ignore[method-assign]
    ApiEventRecorder(cluster)(body, type="Normal", reason="Available", message="")  # no raise
