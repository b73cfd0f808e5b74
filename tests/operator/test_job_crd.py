"""The EmbeddingJob CRD is the API: documented, mirrored by the spec model, copied by the chart.

``crds/embeddingjobs.yaml`` is the source of truth. These tests fail when the typed model
(``embedding_operator.jobs.spec``) drifts from it, when a CEL rule and the model's refusal
stop saying the same words, when a field lacks its ``kubectl explain`` description, when the
chart's copy or the generated reference page is stale, or when the example stops validating.
The real API server evaluates the CEL rules in the e2e tier; here each rule's refusal is
checked to be the model's, with the field path.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import yaml
from embedding_operator.crd_reference import render_reference
from embedding_operator.jobs import spec as job_spec
from embedding_operator.jobs.spec import EmbeddingJobSpec, parse_job_spec
from embedding_operator.spec import InvalidSpecError

from tests.operator.test_crd_schema import _compare, _walk
from tests.support.operator import CRD_PATH, JOB_CRD_PATH, JOB_EXAMPLES, ROOT

CHART_COPY = ROOT / "charts" / "embedding-operator" / "files" / "crds" / "embeddingjobs.yaml"
REFERENCE = ROOT / "docs" / "reference" / "embeddingjob.md"
REFERENCE_COMMAND = "PYTHONPATH=operator python -m embedding_operator.crd_reference"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return dict(yaml.safe_load(JOB_CRD_PATH.read_text()))


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> Any:
    return jsonschema.Draft7Validator(schema)


S3_SPEC: dict[str, Any] = {
    "service": "minilm",
    "input": {"urls": ["s3://corpus/docs/*.parquet"], "format": "parquet"},
    "output": {"url": "s3://corpus/out/"},
    "storage": {"s3": {"credentialsSecret": {"name": "creds"}}},
}


MODEL_SPEC: dict[str, Any] = {
    **{k: v for k, v in S3_SPEC.items() if k != "service"},
    "model": {"name": "BAAI/bge-small-en-v1.5"},
}


def _doc(spec: dict[str, Any], name: str = "job") -> dict[str, Any]:
    return {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def test_api_shape(crd: dict[str, Any]) -> None:
    assert crd["metadata"]["name"] == "embeddingjobs.embedding-operator.dev"
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["kind"] == "EmbeddingJob"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    shown = [n for n, c in columns.items() if not c.get("priority")]
    assert shown == ["Service", "Phase", "Rows Done", "Rows", "Age"]
    assert columns["Phase"]["jsonPath"] == ".status.phase"
    assert columns["Rows Done"]["jsonPath"] == ".status.rowsDone"
    assert columns["ETA"]["priority"] == 1


def test_every_field_has_a_description(schema: dict[str, Any]) -> None:
    missing = [
        p for p, prop in _walk(schema, "") if p != ".metadata" and not prop.get("description")
    ]
    assert not missing, f"fields without a description: {missing}"


def test_spec_model_matches_schema(schema: dict[str, Any]) -> None:
    problems: list[str] = []
    _compare(EmbeddingJobSpec, schema["properties"]["spec"], "spec", problems)
    assert not problems, "\n".join(problems)


def test_status_phases_are_the_models(schema: dict[str, Any]) -> None:
    import typing

    from embedding_operator.jobs.status import Phase

    phases = schema["properties"]["status"]["properties"]["phase"]["enum"]
    assert phases == list(typing.get_args(Phase))


def test_the_chart_carries_the_canonical_crd() -> None:
    assert CHART_COPY.read_bytes() == JOB_CRD_PATH.read_bytes(), (
        f"the chart's CRD drifted: cp {JOB_CRD_PATH.relative_to(ROOT)} "
        f"{CHART_COPY.relative_to(ROOT)}"
    )
    template = ROOT / "charts" / "embedding-operator" / "templates" / "crd-embeddingjobs.yaml"
    assert '.Files.Get "files/crds/embeddingjobs.yaml"' in template.read_text()


def test_the_reference_page_is_the_crd_rendered(crd: dict[str, Any]) -> None:
    page = render_reference(crd, "crds/embeddingjobs.yaml")
    committed = REFERENCE.read_text() if REFERENCE.exists() else ""
    assert committed == page, f"docs/reference/embeddingjob.md is stale: run {REFERENCE_COMMAND}"
    for path, _ in _walk(schema_of(crd), ""):
        field = path.lstrip(".").replace(".[]", "[]")
        if field.startswith(("spec.", "status.")) and not field.endswith("[]"):
            assert f"`{field}`" in page, field


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("path", JOB_EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path: Any, validator: Any) -> None:
    (doc,) = yaml.safe_load_all(path.read_text())
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, errors
    spec = parse_job_spec(doc["spec"])
    assert spec.parallelism >= 2 and spec.storage is not None and spec.storage.s3 is not None


def test_an_example_exists() -> None:
    assert [p.name for p in JOB_EXAMPLES] == ["embeddingjob.yaml", "one-off-corpus-l4.yaml"]


def test_the_one_off_example_runs_its_model_on_the_l4_profiles_nodes() -> None:
    """examples/one-off-corpus-l4.yaml: no service, the model on a GPU per worker, placed as
    an EmbeddingService of gpu.type l4 is (the profile's node selector and toleration)."""
    from embedding_operator.profiles import BUILTIN_PROFILES

    (path,) = [p for p in JOB_EXAMPLES if p.name == "one-off-corpus-l4.yaml"]
    spec = parse_job_spec(yaml.safe_load(path.read_text())["spec"])
    assert spec.service is None and spec.model is not None and spec.gpu
    l4 = BUILTIN_PROFILES["l4"]
    assert spec.scheduling.node_selector == l4.node_selector
    tolerations = [
        t.model_dump(by_alias=True, exclude_none=True) for t in spec.scheduling.tolerations
    ]
    assert tolerations == l4.tolerations


BAD_VALUES = {
    "spec.parallelism": {**S3_SPEC, "parallelism": 0},
    "spec.input.format": {**S3_SPEC, "input": {"urls": ["s3://corpus/a"], "format": "xml"}},
    "spec.input.urls": {**S3_SPEC, "input": {"urls": [], "format": "csv"}},
    "spec.output.url": {**S3_SPEC, "output": {"url": "https://corpus/out"}},
    "spec.service": {**S3_SPEC, "service": "Not_A_Name"},
    "spec.backoffLimitPerIndex": {**S3_SPEC, "backoffLimitPerIndex": -1},
    "spec.shardRows": {**S3_SPEC, "shardRows": 0},
    "spec.storage.s3.endpoint": {**S3_SPEC, "storage": {"s3": {"endpoint": "seaweedfs:8333"}}},
    "spec.model.name": {**MODEL_SPEC, "model": {"name": ""}},
    "spec.model.dtype": {**MODEL_SPEC, "model": {"name": "m", "dtype": "int4"}},
    "spec.model.pooling": {**MODEL_SPEC, "model": {"name": "m", "pooling": "sum"}},
    "spec.modelCache.mode": {**MODEL_SPEC, "modelCache": {"mode": "pvc", "size": "10Gi"}},
    "spec.scheduling.tolerations": {
        **S3_SPEC,
        "scheduling": {"tolerations": [{"key": "gpu", "operator": "Maybe"}]},
    },
    "spec.output.format": {**S3_SPEC, "output": {"url": "s3://corpus/out/", "format": "csv"}},
    "spec.input.imageField": {
        **S3_SPEC,
        "input": {"urls": ["s3://corpus/a"], "format": "csv", "imageField": ""},
    },
}


@pytest.mark.parametrize("field", sorted(BAD_VALUES))
def test_schema_and_model_refuse_bad_values(field: str, validator: Any) -> None:
    spec = BAD_VALUES[field]
    assert not validator.is_valid(_doc(spec)), field
    with pytest.raises(InvalidSpecError, match=field.replace(".", r"\.").replace("urls", "urls")):
        parse_job_spec(spec)


def _spec_rules(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = schema["properties"]["spec"]
    rules = {" ".join(r["message"].split()): r for r in spec["x-kubernetes-validations"]}
    for name in ("storage", "modelCache"):
        nested = spec["properties"][name]["x-kubernetes-validations"]
        rules.update({" ".join(r["message"].split()): r for r in nested})
    return rules


CEL_REFUSALS = {
    job_spec.S3_NEEDS_STORAGE: {**S3_SPEC, "storage": None},
    job_spec.PATH_NEEDS_STORAGE: {**S3_SPEC, "output": {"url": "/data/out"}},
    job_spec.UNUSED_S3: {
        **S3_SPEC,
        "input": {"urls": ["/data/in.csv"], "format": "csv"},
        "output": {"url": "/data/out"},
        "storage": {"s3": {}, "pvc": {"claimName": "corpus"}},
    },
    job_spec.UNUSED_PVC: {**S3_SPEC, "storage": {"s3": {}, "pvc": {"claimName": "corpus"}}},
    job_spec.STORAGE_NEEDS_ONE: {**S3_SPEC, "storage": {}},
}

MODEL_REFUSALS = {
    # message: (the spec, the field path the CRD's rule reports and the model names)
    job_spec.SERVICE_OR_MODEL: (
        {k: v for k, v in S3_SPEC.items() if k != "service"},
        "spec.service",
    ),
    job_spec.NOT_BOTH: ({**S3_SPEC, "model": {"name": "m"}}, "spec.service"),
    job_spec.CACHE_NEEDS_MODEL: (
        {**S3_SPEC, "modelCache": {"mode": "existing", "claimName": "hf"}},
        "spec.modelCache",
    ),
    job_spec.CACHE_NEEDS_CLAIM: ({**MODEL_SPEC, "modelCache": {"mode": "existing"}}, None),
    job_spec.READ_ONLY_NEEDS_CLAIM: ({**MODEL_SPEC, "modelCache": {"readOnly": True}}, None),
}


@pytest.mark.parametrize("message", sorted(MODEL_REFUSALS))
def test_service_or_model_rules_are_the_models_refusals(
    schema: dict[str, Any], validator: Any, message: str
) -> None:
    """Each rule on spec.service / spec.model / spec.modelCache is in the CRD with the model's
    words, a field path and a reason, and the model refuses the same spec naming that path
    (the cache's own rules: spec.modelCache, as EmbeddingService's report it)."""
    rules = _spec_rules(schema)
    assert message in rules, sorted(rules)
    rule = rules[message]
    raw, path = MODEL_REFUSALS[message]
    if path is not None:
        assert "spec" + rule["fieldPath"] == path and rule["reason"].startswith("Field")
    else:
        assert rule["fieldPath"] in (".claimName", ".readOnly") and rule["reason"]
    # The structural schema admits the spec: only the rule refuses it.
    assert validator.is_valid(_doc(raw))
    with pytest.raises(InvalidSpecError) as refused:
        parse_job_spec(raw)
    assert str(refused.value) == f"{path or 'spec.modelCache'}: {message}"


def test_a_model_job_is_admitted_with_the_services_words(validator: Any) -> None:
    spec = {
        **MODEL_SPEC,
        "model": {
            "name": "hf://BAAI/bge-small-en-v1.5",
            "revision": "5c38ec7c405ec4b44b94cc5a9bb96e735b38267a",
            "dtype": "bfloat16",
            "pooling": "cls",
            "normalize": True,
            "hubTokenSecretRef": {"name": "hf"},
        },
        "modelCache": {"mode": "existing", "claimName": "hf-cache", "readOnly": True},
        "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "16Gi"}},
        "scheduling": {
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "priorityClassName": "batch-low",
        },
    }
    assert validator.is_valid(_doc(spec))
    parsed = parse_job_spec(spec)
    assert parsed.service is None and parsed.model is not None
    assert parsed.model.server_model == "BAAI/bge-small-en-v1.5"
    assert parsed.model.hub_token_secret_ref is not None
    assert parsed.model.hub_token_secret_ref.key == "token"  # the service's default key
    assert parsed.gpu and parsed.model_cache is not None and parsed.model_cache.read_only
    plain = parse_job_spec(MODEL_SPEC)
    assert plain.model is not None and plain.model.dtype == "auto" and not plain.gpu
    assert plain.model_cache is None and plain.scheduling.node_selector == {}


def test_the_model_fields_are_the_services(schema: dict[str, Any]) -> None:
    """spec.model and spec.scheduling reuse EmbeddingService's schema: the same types, enums
    and defaults (descriptions aside), so one manifest's words work in the other."""
    service = yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"][0]["schema"]
    service_spec = service["openAPIV3Schema"]["properties"]["spec"]["properties"]
    job = schema["properties"]["spec"]["properties"]

    def shape(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: shape(v) for k, v in node.items() if k != "description"}
        return node

    model = job["model"]["properties"]
    for name in ("name", "revision", "trustRemoteCode", "hubTokenSecretRef"):
        assert shape(model[name]) == shape(service_spec["model"]["properties"][name]), name
    assert shape(model["dtype"]) == shape(service_spec["server"]["properties"]["dtype"])
    for name in ("pooling", "normalize"):
        assert shape(model[name]) == shape(service_spec["embedding"]["properties"][name]), name
    assert shape(job["scheduling"]) == shape(service_spec["scheduling"])


@pytest.mark.parametrize("message", sorted(CEL_REFUSALS))
def test_cel_rules_are_the_models_refusals(schema: dict[str, Any], message: str) -> None:
    """Each storage rule exists in the CRD with the model's words and a field path, and the
    model refuses the same spec naming spec.storage."""
    rules = _spec_rules(schema)
    assert message in rules, sorted(rules)
    rule = rules[message]
    if message != job_spec.STORAGE_NEEDS_ONE:
        assert rule["fieldPath"].startswith(".storage") and rule["reason"]
    raw = {k: v for k, v in CEL_REFUSALS[message].items() if v is not None}
    with pytest.raises(InvalidSpecError) as refused:
        parse_job_spec(raw)
    assert str(refused.value).startswith("spec")
    assert message in str(refused.value)


def test_storage_fitting_the_urls_is_admitted(validator: Any) -> None:
    both = {
        **S3_SPEC,
        "output": {"url": "/data/vectors"},
        "storage": {"s3": {"region": "eu-west-1"}, "pvc": {"claimName": "vectors"}},
    }
    pvc_only = {
        "service": "minilm",
        "input": {"urls": ["/data/corpus/*.jsonl"], "format": "jsonl"},
        "output": {"url": "/data/vectors/"},
        "storage": {"pvc": {"claimName": "corpus"}},
    }
    for spec in (S3_SPEC, both, pvc_only):
        assert validator.is_valid(_doc(spec))
        parsed = parse_job_spec(spec)
        assert parsed.input.id_field == "id" and parsed.input.text_column == "text"
        assert parsed.input.image_field is None and parsed.output.format == "parquet"
        assert parsed.parallelism == 1 and parsed.backoff_limit_per_index == 3
        assert parsed.shard_rows is None and not parsed.suspend


def test_fields_that_shape_the_shards_are_immutable(schema: dict[str, Any]) -> None:
    """A transition rule (``self == oldSelf``) on each: an edit after the planner ran would
    describe shards that were never cut. suspend and parallelism stay mutable."""
    props = schema["properties"]["spec"]["properties"]
    for name in ("service", "model", "modelCache", "input", "output", "storage", "shardRows"):
        rules = [r["rule"] for r in props[name].get("x-kubernetes-validations") or []]
        assert "self == oldSelf" in rules, name
    for name in ("suspend", "parallelism", "ttlSecondsAfterFinished"):
        assert not props[name].get("x-kubernetes-validations"), name


def test_the_name_leaves_room_for_the_pods(schema: dict[str, Any]) -> None:
    (rule,) = schema["x-kubernetes-validations"]
    assert "size(self.metadata.name) <= 52" in rule["rule"]


def test_a_job_embeds_a_text_or_an_image_never_both(schema: dict[str, Any], validator: Any) -> None:
    """The CEL rule on spec.input (fieldPath .imageField) and the model say the same words;
    textField has no schema default, so the rule can tell it was given, and it means text
    when neither is."""
    input_schema = schema["properties"]["spec"]["properties"]["input"]
    assert "default" not in input_schema["properties"]["textField"]
    rules = {" ".join(r["message"].split()): r for r in input_schema["x-kubernetes-validations"]}
    rule = rules[job_spec.TEXT_OR_IMAGE]
    assert rule["rule"] == "!(has(self.imageField) && has(self.textField))"
    assert (rule["fieldPath"], rule["reason"]) == (".imageField", "FieldValueForbidden")
    both = {
        **S3_SPEC,
        "input": {**S3_SPEC["input"], "textField": "caption", "imageField": "url"},
    }
    with pytest.raises(InvalidSpecError) as refused:
        parse_job_spec(both)
    assert str(refused.value) == f"spec.input.imageField: {job_spec.TEXT_OR_IMAGE}"
    images = {**S3_SPEC, "input": {**S3_SPEC["input"], "imageField": "url"}}
    assert validator.is_valid(_doc(images))
    parsed = parse_job_spec(images).input
    assert (parsed.text_column, parsed.image_field) == (None, "url")
    texts = parse_job_spec({**S3_SPEC, "input": {**S3_SPEC["input"], "textField": "body"}})
    assert (texts.input.text_column, texts.input.image_field) == ("body", None)


def test_output_format_is_parquet_or_jsonl(validator: Any) -> None:
    for fmt in ("parquet", "jsonl"):
        spec = {**S3_SPEC, "output": {"url": "s3://corpus/out/", "format": fmt}}
        assert validator.is_valid(_doc(spec))
        assert parse_job_spec(spec).output.format == fmt
