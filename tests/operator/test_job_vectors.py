"""An EmbeddingJob's ``spec.output.vectors`` and ``spec.input.inputType``: the CRD's schema and
CEL rule, the spec model's refusals with the same words and field paths, and the workers'
flags (``job work --vectors``, ``--input-type``), which ``tests/server/batch/test_job_vectors.py``
runs against real servers."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import yaml
from embedding_operator.builders.common import Owner
from embedding_operator.jobs import spec as job_spec
from embedding_operator.jobs.builders import build_worker_job
from embedding_operator.jobs.spec import parse_job_spec
from embedding_operator.spec import InvalidSpecError
from embedding_server.batch.embedder import VECTORS

from tests.support.operator import JOB_CRD_PATH

SPEC: dict[str, Any] = {
    "service": "bge-m3",
    "input": {"urls": ["s3://corpus/docs/*.parquet"], "format": "parquet"},
    "output": {"url": "s3://corpus/out/"},
    "storage": {"s3": {}},
}
OWNER = Owner(name="corpus", namespace="team", uid="uid-job", generation=1)
URL = "http://bge-m3.team.svc.cluster.local:80"


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    crd = yaml.safe_load(JOB_CRD_PATH.read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> Any:
    return jsonschema.Draft7Validator(schema)


def _doc(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingJob",
        "metadata": {"name": "job"},
        "spec": spec,
    }


def _with(output: dict[str, Any] | None = None, **input_fields: Any) -> dict[str, Any]:
    return {
        **SPEC,
        "input": {**SPEC["input"], **input_fields},
        "output": {**SPEC["output"], **(output or {})},
    }


def test_vectors_are_a_set_of_the_servers_outputs_dense_by_default(
    schema: dict[str, Any],
) -> None:
    """The words are the server's (/info outputs, job work --vectors): the CRD's enum is the
    worker's list. The API server refuses a repeated one (list-type set: uniqueItems is not
    allowed in a structural schema) and an empty list (minItems)."""
    node = schema["properties"]["spec"]["properties"]["output"]["properties"]["vectors"]
    assert node["items"]["enum"] == list(VECTORS)
    assert list(job_spec.Vector.__args__) == list(VECTORS)  # type: ignore[attr-defined]
    assert node["x-kubernetes-list-type"] == "set"
    assert (node["minItems"], node["maxItems"], node["default"]) == (1, 3, ["dense"])
    assert parse_job_spec(SPEC).output.vectors == ["dense"]
    assert parse_job_spec(SPEC).input.input_type is None


@pytest.mark.parametrize(
    "vectors", [["dense"], ["sparse"], ["multi_vector"], ["multi_vector", "dense", "sparse"]]
)
def test_any_set_of_outputs_is_admitted(validator: Any, vectors: list[str]) -> None:
    spec = _with({"vectors": vectors}, inputType="search_document")
    assert validator.is_valid(_doc(spec))
    parsed = parse_job_spec(spec)
    assert parsed.output.vectors == vectors and parsed.input.input_type == "search_document"


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (_with({"vectors": []}), "spec.output.vectors", "at least 1 item"),
        (_with({"vectors": ["colbert"]}), "spec.output.vectors.0", "'dense', 'sparse'"),
        (_with({"vectors": ["dense", "dense"]}), "spec.output.vectors", job_spec.VECTORS_TWICE),
        (_with(inputType=""), "spec.input.inputType", "at least 1 character"),
        (_with(inputType="search query"), "spec.input.inputType", "pattern"),
    ],
)
def test_bad_vectors_and_input_types_are_refused_naming_the_field(
    validator: Any, spec: dict[str, Any], field: str, words: str
) -> None:
    if job_spec.VECTORS_TWICE not in words:  # the API server's list-type set refuses that one
        assert not validator.is_valid(_doc(spec))
    with pytest.raises(InvalidSpecError) as refused:
        parse_job_spec(spec)
    assert f"{field}: " in str(refused.value) and words in str(refused.value)


def test_images_have_dense_vectors_only_in_the_crds_words(
    schema: dict[str, Any], validator: Any
) -> None:
    """A CEL rule on spec (it reads input and output), fieldPath .output.vectors, and the
    model's refusal say the same words; an image job that keeps dense vectors is admitted."""
    spec_node = schema["properties"]["spec"]
    rules = {" ".join(r["message"].split()): r for r in spec_node["x-kubernetes-validations"]}
    rule = rules[job_spec.IMAGES_ARE_DENSE]
    assert rule["rule"] == (
        "!has(self.input.imageField) || !has(self.output.vectors) "
        "|| self.output.vectors == ['dense']"
    )
    assert (rule["fieldPath"], rule["reason"]) == (".output.vectors", "FieldValueInvalid")
    with pytest.raises(InvalidSpecError) as refused:
        parse_job_spec(_with({"vectors": ["dense", "sparse"]}, imageField="url"))
    assert str(refused.value) == f"spec: {job_spec.IMAGES_ARE_DENSE}"
    dense = _with({"vectors": ["dense"]}, imageField="url")
    assert validator.is_valid(_doc(dense)) and parse_job_spec(dense).output.vectors == ["dense"]


def _args(spec: dict[str, Any]) -> list[str]:
    job = build_worker_job(
        OWNER, parse_job_spec(spec), shards=2, rows=10, image="img", service_url=URL
    )
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


def test_the_workers_get_the_vectors_and_input_type_as_flags() -> None:
    """Only when not the defaults, so a server image older than the flags still embeds a
    dense job."""
    plain = _args(SPEC)
    assert "--vectors" not in plain and "--input-type" not in plain
    args = _args(_with({"vectors": ["multi_vector", "sparse", "dense"]}, inputType="search_query"))
    assert args[args.index("--vectors") + 1] == "multi_vector,sparse,dense"
    assert args[args.index("--input-type") + 1] == "search_query"
