"""Golden vectors, the operator's half: the contract key, what the pod template carries, the
record taken from the first ready pod, and the pods kept out named (issue 47, item 2)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from embedding_operator.builders.deployment import build_deployment, server_args
from embedding_operator.builders.golden import contract_key
from embedding_operator.golden import GoldenUnreachable, http_fetch
from embedding_operator.kube import ObjectRef
from embedding_operator.profiles import GpuProfiles
from embedding_operator.reconcile import Reconciler, owner_ref
from embedding_operator.spec import InvalidSpecError, parse_spec

from tests.support.operator import (
    FakeCluster,
    FakeGolden,
    golden_answer,
    golden_record,
    render_input,
    rolled_out,
    server_pod,
)

NS = "team"
MODEL: dict[str, Any] = {"model": {"name": "sentence-transformers/all-MiniLM-L6-v2"}}
CONFIGMAP = ObjectRef("v1", "ConfigMap", NS, "emb-golden")
DEPLOYMENT = ObjectRef("apps/v1", "Deployment", NS, "emb")


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def __call__(self, body: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        self.posted.append((type, reason, message))


def _service(cluster: FakeCluster, spec: dict[str, Any]) -> None:
    cluster.add(
        {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingService",
            "metadata": {"name": "emb", "namespace": NS, "uid": "owner-uid", "generation": 1},
            "spec": spec,
        }
    )


def _reconciler(cluster: FakeCluster, golden: FakeGolden, events: Events) -> Reconciler:
    return Reconciler(
        cluster=cluster,
        profiles=GpuProfiles.builtin(),
        default_image="img:1",
        recorder=events,
        golden_fetch=golden,
    )


def _status(cluster: FakeCluster) -> dict[str, Any]:
    return dict(cluster.objects[owner_ref(NS, "emb")].get("status") or {})


def _conditions(cluster: FakeCluster) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in _status(cluster).get("conditions") or []}


# The contract key and the pod template.


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"name": "BAAI/bge-small-en-v1.5"}},
        {"model": {**MODEL["model"], "revision": "v2"}},
        {"embedding": {"pooling": "cls"}},
        {"embedding": {"dimensions": 128}},
        {"embedding": {"normalize": False}},
        {"embedding": {"maxInputTokens": 128}},
        {"embedding": {"prompts": {"defaultName": "query"}}},
        {"server": {"dtype": "bfloat16"}},
        {"server": {"quantization": "int8"}},
        {"server": {"backend": "transformers"}},
    ],
    ids=lambda change: json.dumps(change, sort_keys=True),
)
def test_a_change_of_the_models_own_fields_is_a_new_contract(change: dict[str, Any]) -> None:
    assert contract_key(parse_spec({**MODEL, **change})) != contract_key(parse_spec(MODEL))


@pytest.mark.parametrize(
    "change",
    [
        {"servedModelName": "minilm", "servedModelAliases": ["mini"]},
        {"replicas": 3},
        {"resources": {"requests": {"memory": "2Gi"}}},
        {"autoscaling": {"enabled": True, "maxReplicas": 8}},
        # Drift the operator cannot see: the pod that gets it is compared, not re-recorded.
        {"server": {"extraArgs": ["--dtype", "bfloat16"]}},
        {"server": {"image": "registry.example/embedding-server:2"}},
        {"gpu": {"type": "l4"}},
        {"contract": {"policy": "allowDrift", "minCosine": 0.99}},
    ],
    ids=lambda change: json.dumps(change, sort_keys=True),
)
def test_names_scale_placement_and_extra_args_keep_the_contract(change: dict[str, Any]) -> None:
    assert contract_key(parse_spec({**MODEL, **change})) == contract_key(parse_spec(MODEL))


def test_the_pod_template_names_its_record_and_the_bar() -> None:
    render = render_input({**MODEL, "server": {"extraArgs": ["--golden-min-cosine", "0.5"]}})
    key = contract_key(render.spec)
    args = server_args(render)
    at = args.index("--golden-vectors")
    assert args[at + 1] == f"/etc/embedding-server/golden/{key}.json"
    assert args[args.index("--golden-min-cosine") + 1] == "0.9999"
    # extraArgs come last, so a user may still override the bar (argparse: the last wins).
    assert args[-2:] == ["--golden-min-cosine", "0.5"]
    template = build_deployment(render)["spec"]["template"]
    assert template["metadata"]["labels"]["embedding-operator.dev/contract"] == key
    # The Deployment's selector is immutable: the key is on the template only.
    assert (
        "embedding-operator.dev/contract"
        not in build_deployment(render)["spec"]["selector"]["matchLabels"]
    )
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "golden")
    assert volume["configMap"] == {"name": "emb-golden", "optional": True}


def test_allow_drift_passes_its_tolerance_and_strict_refuses_one() -> None:
    drift = render_input({**MODEL, "contract": {"policy": "allowDrift", "minCosine": 0.995}})
    args = server_args(drift)
    assert args[args.index("--golden-min-cosine") + 1] == "0.995"
    default = render_input({**MODEL, "contract": {"policy": "allowDrift"}})
    assert server_args(default)[server_args(default).index("--golden-min-cosine") + 1] == "0.999"
    with pytest.raises(InvalidSpecError, match=r"contract.*minCosine needs policy allowDrift"):
        parse_spec({**MODEL, "contract": {"minCosine": 0.9}})


# Recording and checking, through the reconciler.


def test_the_first_ready_pod_is_recorded_once_and_named_in_the_status() -> None:
    cluster, events = FakeCluster(), Events()
    _service(cluster, MODEL)
    key = contract_key(parse_spec(MODEL))
    golden = FakeGolden({"10.0.0.7": golden_answer("feedfacecafebeef")})
    rec = _reconciler(cluster, golden, events)
    rec.reconcile(NS, "emb")
    assert _status(cluster)["contract"]["state"] == "Pending"
    assert CONFIGMAP not in cluster.objects

    rolled_out(cluster, DEPLOYMENT)
    cluster.add(server_pod("emb-1", key=key, ip="10.0.0.7", node="gpu-a"))
    rec.reconcile(NS, "emb")
    configmap = cluster.objects[CONFIGMAP]
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == "owner-uid"
    record = json.loads(configmap["data"][f"{key}.json"])
    assert record["fingerprint"] == "feedfacecafebeef"
    assert record["vectors"] == golden_answer()["vectors"]
    assert record["recordedFrom"] == {"pod": "emb-1", "node": "gpu-a"}
    assert "check" not in record, "the record is what was embedded, not the pod's own check"
    contract = _status(cluster)["contract"]
    assert contract["state"] == "Recorded"
    assert contract["fingerprint"] == "feedfacecafebeef"
    assert contract["recordedFrom"] == {"pod": "emb-1", "node": "gpu-a"}
    assert contract["key"] == key and contract["minCosine"] == 0.9999
    assert _conditions(cluster)["Ready"]["status"] == "True"

    # Recorded once: a second pod turning ready later is not recorded over the first.
    golden.answers["10.0.0.8"] = golden_answer("0000000000000000")
    cluster.add(server_pod("emb-2", key=key, ip="10.0.0.8"))
    rec.reconcile(NS, "emb")
    assert json.loads(cluster.objects[CONFIGMAP]["data"][f"{key}.json"])["fingerprint"] == (
        "feedfacecafebeef"
    )


def test_a_pod_whose_vectors_changed_is_named_with_its_node_cosine_and_inputs() -> None:
    cluster, events = FakeCluster(), Events()
    spec = {**MODEL, "replicas": 2}
    _service(cluster, spec)
    key = contract_key(parse_spec(spec))
    changed = golden_answer(
        "1111222233334444",
        state="changed",
        min_cosine=0.99812,
        probe=3,
        expected_fingerprint="feedfacecafebeef",
        differs={"dtype": ["float32", "bfloat16"]},
    )
    golden = FakeGolden({"10.0.0.9": changed})
    rec = _reconciler(cluster, golden, events)
    rec.reconcile(NS, "emb")
    cluster.add(golden_record(key, golden_answer("feedfacecafebeef")))
    cluster.add(server_pod("emb-old", key=key, ip="10.0.0.7"))
    cluster.add(server_pod("emb-new", key=key, ip="10.0.0.9", ready=False, node="cpu-b"))
    rolled_out(cluster, DEPLOYMENT, ready=1)
    outcome = rec.reconcile(NS, "emb")

    assert outcome is not None and outcome.retry, "asked again: the pod may be replaced"
    degraded = _conditions(cluster)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "VectorsChanged")
    for said in ("emb-new", "cpu-b", "0.998120", "probe 3", "0.9999", "dtype float32 -> bfloat16"):
        assert said in degraded["message"], said
    assert ("Warning", "VectorsChanged", degraded["message"]) in events.posted
    assert golden.asked == ["10.0.0.9"], "only the pod that is not ready is asked"
    # The record is the first pod's, untouched.
    assert _status(cluster)["contract"]["fingerprint"] == "feedfacecafebeef"
    assert json.loads(cluster.objects[CONFIGMAP]["data"][f"{key}.json"])["fingerprint"] == (
        "feedfacecafebeef"
    )


def test_a_model_change_records_anew_from_a_pod_of_the_new_model() -> None:
    cluster, events = FakeCluster(), Events()
    _service(cluster, MODEL)
    old_key = contract_key(parse_spec(MODEL))
    golden = FakeGolden(
        {
            "10.0.0.1": golden_answer("0ld0ld0ld0ld0ld0"),
            "10.0.0.2": golden_answer("new0new0new0new0"),
        }
    )
    rec = _reconciler(cluster, golden, events)
    rec.reconcile(NS, "emb")
    cluster.add(golden_record(old_key, golden_answer("0ld0ld0ld0ld0ld0")))
    new_spec = {"model": {"name": "BAAI/bge-small-en-v1.5"}}
    new_key = contract_key(parse_spec(new_spec))
    body = cluster.objects[owner_ref(NS, "emb")]
    body["spec"], body["metadata"]["generation"] = new_spec, 2
    rec.reconcile(NS, "emb")
    # Only the old model's pod is ready: nothing is recorded from it for the new model.
    cluster.add(server_pod("emb-old", key=old_key, ip="10.0.0.1"))
    rolled_out(cluster, DEPLOYMENT)
    rec.reconcile(NS, "emb")
    assert _status(cluster)["contract"] == {
        **_status(cluster)["contract"],
        "key": new_key,
        "state": "Pending",
    }
    assert "10.0.0.1" not in golden.asked
    del cluster.objects[ObjectRef("v1", "Pod", NS, "emb-old")]  # the kubelet's doing
    cluster.add(server_pod("emb-new", key=new_key, ip="10.0.0.2"))
    rec.reconcile(NS, "emb")
    data = cluster.objects[CONFIGMAP]["data"]
    assert json.loads(data[f"{new_key}.json"])["fingerprint"] == "new0new0new0new0"
    assert _status(cluster)["contract"]["fingerprint"] == "new0new0new0new0"


def test_a_configmap_of_that_name_it_does_not_own_is_never_written() -> None:
    cluster, events = FakeCluster(), Events()
    _service(cluster, MODEL)
    key = contract_key(parse_spec(MODEL))
    theirs = golden_record(key, golden_answer("7e7e7e7e7e7e7e7e"), owner_uid="someone-else")
    theirs["metadata"].pop("ownerReferences")
    cluster.add(theirs)
    golden = FakeGolden({"10.0.0.1": golden_answer()})
    rec = _reconciler(cluster, golden, events)
    rec.reconcile(NS, "emb")
    rolled_out(cluster, DEPLOYMENT)
    cluster.add(server_pod("emb-1", key=key, ip="10.0.0.1"))
    rec.reconcile(NS, "emb")
    assert cluster.objects[CONFIGMAP]["data"] == theirs["data"]
    assert golden.asked == []
    degraded = _conditions(cluster)["Degraded"]
    assert degraded["reason"] == "GoldenRecordConflict"
    assert "emb-golden" in degraded["message"] and "never adopts" in degraded["message"]
    assert _status(cluster)["contract"]["state"] == "Conflict"


def test_a_task_without_embeddings_is_said_unsupported_and_nothing_is_written() -> None:
    cluster, events = FakeCluster(), Events()
    _service(cluster, MODEL)
    key = contract_key(parse_spec(MODEL))
    answer = golden_answer(state="unsupported", reason="task score embeds nothing")
    answer.pop("vectors")
    rec = _reconciler(cluster, FakeGolden({"10.0.0.1": answer}), events)
    rec.reconcile(NS, "emb")
    rolled_out(cluster, DEPLOYMENT)
    cluster.add(server_pod("emb-1", key=key, ip="10.0.0.1"))
    rec.reconcile(NS, "emb")
    assert CONFIGMAP not in cluster.objects
    contract = _status(cluster)["contract"]
    assert (contract["state"], contract["message"]) == ("Unsupported", "task score embeds nothing")
    assert _conditions(cluster)["Ready"]["status"] == "True"


def test_a_ready_pod_that_cannot_be_read_leaves_the_record_pending_and_comes_back() -> None:
    cluster, events = FakeCluster(), Events()
    _service(cluster, MODEL)
    key = contract_key(parse_spec(MODEL))
    rec = _reconciler(cluster, FakeGolden(), events)
    rec.reconcile(NS, "emb")
    rolled_out(cluster, DEPLOYMENT)
    cluster.add(server_pod("emb-1", key=key, ip="10.0.0.1"))
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.requeue_after is not None
    contract = _status(cluster)["contract"]
    assert contract["state"] == "Pending"
    assert "10.0.0.1:8001/golden" in contract["message"]
    # Not a fault of the service: it is Ready, and not Degraded.
    assert _conditions(cluster)["Ready"]["status"] == "True"
    assert _conditions(cluster)["Degraded"]["status"] == "False"


# The real fetch, against a real HTTP server on 127.0.0.1.


class _Handler(http.server.BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def do_GET(self) -> None:
        status, headers, body = self.answers[self.path]
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def probe_port(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[dict[str, tuple[int, dict[str, str], bytes]]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    monkeypatch.setattr("embedding_operator.golden.PROBE_PORT", server.server_address[1])
    answers: dict[str, tuple[int, dict[str, str], bytes]] = {}
    _Handler.answers = answers
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield answers
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_the_fetch_reads_a_pods_golden_answer(
    probe_port: dict[str, tuple[int, dict[str, str], bytes]],
) -> None:
    probe_port["/golden"] = (200, {}, json.dumps(golden_answer("abababababababab")).encode())
    assert http_fetch("127.0.0.1")["fingerprint"] == "abababababababab"


def test_the_fetch_follows_no_redirect_a_pod_answers(
    probe_port: dict[str, tuple[int, dict[str, str], bytes]],
) -> None:
    """A pod runs the image its spec names; its answer must not send the operator elsewhere."""
    probe_port["/golden"] = (302, {"Location": "/elsewhere"}, b"")
    probe_port["/elsewhere"] = (200, {}, json.dumps(golden_answer()).encode())
    with pytest.raises(GoldenUnreachable, match="302"):
        http_fetch("127.0.0.1")


def test_the_fetch_refuses_an_answer_too_large_to_be_a_record(
    probe_port: dict[str, tuple[int, dict[str, str], bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("embedding_operator.golden.MAX_ANSWER_BYTES", 1000)
    probe_port["/golden"] = (200, {}, b"[" + b"0," * 1000 + b"0]")
    with pytest.raises(GoldenUnreachable, match="over 1000 bytes"):
        http_fetch("127.0.0.1")
    probe_port["/golden"] = (200, {}, b"not json")
    with pytest.raises(GoldenUnreachable, match="not JSON"):
        http_fetch("127.0.0.1")


def test_a_pod_still_comparing_is_asked_again_soon_without_a_problem() -> None:
    """A pod whose vectors changed stays not ready, which makes no pod event: the operator
    must come back on its own, not wait for the resync."""
    cluster, events = FakeCluster(), Events()
    spec = {**MODEL, "replicas": 2}
    _service(cluster, spec)
    key = contract_key(parse_spec(spec))
    golden = FakeGolden({"10.0.0.9": golden_answer(state="unchecked")})
    rec = _reconciler(cluster, golden, events)
    rec.reconcile(NS, "emb")
    cluster.add(golden_record(key, golden_answer("feedfacecafebeef")))
    cluster.add(server_pod("emb-old", key=key, ip="10.0.0.7"))
    cluster.add(server_pod("emb-new", key=key, ip="10.0.0.9", ready=False))
    rolled_out(cluster, DEPLOYMENT, ready=1)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is None
    assert outcome.requeue_after == 10.0
    # Then it finds them changed.
    golden.answers["10.0.0.9"] = golden_answer(state="changed", min_cosine=0.5, probe=0)
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.problem is not None
    assert outcome.problem.reason == "VectorsChanged"


def test_disabled_records_and_checks_nothing_and_asks_no_pod() -> None:
    spec = {**MODEL, "contract": {"policy": "disabled"}}
    assert "--golden-vectors" not in server_args(render_input(spec))
    cluster, events = FakeCluster(), Events()
    _service(cluster, spec)
    golden = FakeGolden({"10.0.0.1": golden_answer()})
    rec = _reconciler(cluster, golden, events)
    rec.reconcile(NS, "emb")
    rolled_out(cluster, DEPLOYMENT)
    cluster.add(server_pod("emb-1", key=contract_key(parse_spec(spec)), ip="10.0.0.1"))
    outcome = rec.reconcile(NS, "emb")
    assert outcome is not None and outcome.requeue_after is None
    assert golden.asked == [] and CONFIGMAP not in cluster.objects
    assert _status(cluster)["contract"]["state"] == "Disabled"
    assert not [c for c in cluster.calls if c[1] == "ConfigMap"]


def test_an_unreachable_probe_port_is_asked_again_less_and_less_often() -> None:
    cluster, events = FakeCluster(), Events()
    _service(cluster, MODEL)
    rec = _reconciler(cluster, FakeGolden(), events)
    rec.reconcile(NS, "emb")
    rolled_out(cluster, DEPLOYMENT)
    cluster.add(server_pod("emb-1", key=contract_key(parse_spec(MODEL)), ip="10.0.0.1"))
    delays = []
    for _ in range(5):
        outcome = rec.reconcile(NS, "emb")
        assert outcome is not None
        delays.append(outcome.requeue_after)
    assert delays == [10.0, 20.0, 40.0, 60.0, 60.0]
