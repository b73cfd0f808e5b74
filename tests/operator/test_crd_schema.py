"""The CRD is the API: every field documented, the spec model in lockstep, examples valid.

``crds/embeddingservices.yaml`` is the single source of truth. These tests fail when the
operator's typed spec model (spec.py) drifts from it (a field added on one side only, a default
changed on one side only), when a field lacks the description ``kubectl explain`` prints, or
when an example stops validating.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

import jsonschema
import pytest
import yaml
from embedding_operator.profiles import BUILTIN_PROFILES
from embedding_operator.spec import (
    BUILTIN_GPU_TYPES,
    CODE_LOADING_ENV,
    CODE_LOADING_ENV_PREFIXES,
    EMBED_ONLY_FIELDS,
    MAX_ALIASES,
    MEDIA_DOMAIN_PATTERN,
    MODEL_NAME_PATTERN,
    SERVER_QUEUE_TOKENS,
    VERSIONED_NAME,
    VERSIONED_NAME_PROBLEM,
    EmbeddingServiceSpec,
    InvalidSpecError,
    media_domain_problem,
    parse_spec,
)
from pydantic import BaseModel

from tests.support.operator import EXAMPLES


def _walk(node: dict[str, Any], path: str) -> typing.Iterator[tuple[str, dict[str, Any]]]:
    for name, prop in (node.get("properties") or {}).items():
        yield f"{path}.{name}", prop
        yield from _walk(prop, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield f"{path}[]", node["items"]
        yield from _walk(node["items"], f"{path}[]")


def test_every_field_has_a_description(schema: dict[str, Any]) -> None:
    missing = [
        path
        for path, prop in _walk(schema, "")
        if path not in {".metadata"} and not prop.get("description")
    ]
    assert not missing, f"fields without a description: {missing}"


def test_api_shape(crd: dict[str, Any]) -> None:
    assert crd["metadata"]["name"] == "embeddingservices.embedding-operator.dev"
    names = crd["spec"]["names"]
    assert crd["spec"]["scope"] == "Namespaced"
    assert "es" not in names["shortNames"] and "embsvc" in names["shortNames"]
    assert names["categories"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Model"] == ".spec.model.name"
    assert columns["GPU"] == ".spec.gpu.type"
    assert columns["Replicas"] == ".status.replicas"
    assert columns["Ready"] == ".status.readyReplicas"
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_status_has_no_phase(schema: dict[str, Any]) -> None:
    status = schema["properties"]["status"]["properties"]
    assert "phase" not in status
    assert {
        "observedGeneration",
        "conditions",
        "replicas",
        "readyReplicas",
        "selector",
        "endpoint",
        "model",
    } <= set(status)


# --- spec model <-> schema drift ------------------------------------------------------------


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``X | None`` / ``list[X]``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            found = _model_class(arg)
            if found is not None:
                return found
    if typing.get_origin(annotation) is list:
        return _model_class(typing.get_args(annotation)[0])
    return None


def _literal_values(annotation: Any) -> set[Any]:
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    return {v for arg in typing.get_args(annotation) for v in _literal_values(arg)}


def _compare(model: type[BaseModel], node: dict[str, Any], path: str, problems: list[str]) -> None:
    if node.get("type") == "array":
        node = node["items"]
    fields = {(f.alias or n): f for n, f in model.model_fields.items()}
    props = node.get("properties") or {}
    if set(fields) != set(props):
        problems.append(
            f"{path}: model has {sorted(set(fields) - set(props))} extra, "
            f"schema has {sorted(set(props) - set(fields))} extra"
        )
    for name in set(fields) & set(props):
        field, prop = fields[name], props[name]
        sub = _model_class(field.annotation)
        if sub is not None and "properties" in (prop.get("items") or prop):
            _compare(sub, prop, f"{path}.{name}", problems)
            continue
        if "default" in prop:
            default = field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = default.model_dump(by_alias=True, exclude_none=True)
            if default != prop["default"]:
                problems.append(
                    f"{path}.{name}: default {default!r} in the model, "
                    f"{prop['default']!r} in the schema"
                )
        elif field.is_required() != (name in (node.get("required") or [])):
            problems.append(f"{path}.{name}: required differs")
        if "enum" in prop:
            allowed = _literal_values(field.annotation)
            if set(prop["enum"]) != allowed:
                problems.append(f"{path}.{name}: enum {prop['enum']} vs {sorted(allowed, key=str)}")


def test_spec_model_matches_schema(schema: dict[str, Any]) -> None:
    problems: list[str] = []
    _compare(EmbeddingServiceSpec, schema["properties"]["spec"], "spec", problems)
    assert not problems, "\n".join(problems)


def test_object_defaults_apply_nested_defaults(schema: dict[str, Any]) -> None:
    # `default: {}` on a parent is what makes the API server fill in its children's defaults
    # for a manifest that omits the parent entirely.
    spec = schema["properties"]["spec"]["properties"]
    for name in (
        "embedding",
        "server",
        "parallelism",
        "gpu",
        "autoscaling",
        "rollout",
        "modelCache",
        "service",
    ):
        assert spec[name].get("default") == {}, name


# --- examples and bad manifests --------------------------------------------------------------


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> Any:
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path: Any, validator: Any) -> None:
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs, path
    for doc in docs:
        assert doc["apiVersion"] == "embedding-operator.dev/v1alpha1"
        assert doc["kind"] == "EmbeddingService"
        errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, errors
        parse_spec(doc["spec"])


def test_examples_cover_the_advertised_cases() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "minilm-cpu.yaml",
        "bge-h100.yaml",
        "qwen3-embedding-l4.yaml",
        "bge-reranker-l4.yaml",
        "mpnet-search-cpu.yaml",
        "ms-marco-reranker-cpu.yaml",
        "hybrid-search-l4.yaml",
        "image-search-clip.yaml",
    } <= names


def test_the_image_search_example_serves_clip_with_data_uris_by_default() -> None:
    """examples/image-search-clip.yaml: CLIP on CPU, embed, its media limits set and no host
    fetched from until the user uncomments allowedDomains."""
    path = next(p for p in EXAMPLES if p.name == "image-search-clip.yaml")
    (doc,) = yaml.safe_load_all(path.read_text())
    spec = parse_spec(doc["spec"])
    assert spec.model.name == "openai/clip-vit-base-patch32"
    assert spec.task == "embed" and spec.gpu.type == "cpu"
    assert spec.media is not None and spec.media.allowed_domains == []
    assert spec.media.image_bytes == 4 * 1024 * 1024
    assert "# allowedDomains:" in path.read_text()


def test_the_hybrid_search_example_pairs_an_embedder_and_a_yes_no_reranker() -> None:
    """examples/hybrid-search-l4.yaml: bge-m3 embedding and Qwen3-Reranker with task score
    (without it a *ForCausalLM reranker is refused), each its own service."""
    path = next(p for p in EXAMPLES if p.name == "hybrid-search-l4.yaml")
    specs = {d["metadata"]["name"]: d["spec"] for d in yaml.safe_load_all(path.read_text())}
    assert {n: (s["model"]["name"], s["task"]) for n, s in specs.items()} == {
        "bge-m3": ("BAAI/bge-m3", "embed"),
        "qwen3-reranker": ("Qwen/Qwen3-Reranker-0.6B", "score"),
    }
    assert parse_spec(specs["qwen3-reranker"]).task == "score"


BAD_SPECS = {
    "tensorParallelSize": {"model": {"name": "m"}, "parallelism": {"tensorParallelSize": 3}},
    "replicas": {"model": {"name": "m"}, "replicas": -1},
    "dimensions": {"model": {"name": "m"}, "embedding": {"dimensions": 0}},
    "pooling": {"model": {"name": "m"}, "embedding": {"pooling": "median"}},
    "task": {"model": {"name": "m"}, "task": "rerank"},
    "model": {"embedding": {}},
    "metric": {"model": {"name": "m"}, "autoscaling": {"metric": "cpu"}},
    "apiWorkers": {"model": {"name": "m"}, "server": {"apiWorkers": 0}},
    "otlpEndpoint": {"model": {"name": "m"}, "tracing": {"otlpEndpoint": "collector:4318"}},
    "samplingRatio": {
        "model": {"name": "m"},
        "tracing": {"otlpEndpoint": "http://collector:4318", "samplingRatio": 1.5},
    },
    "backend": {"model": {"name": "m"}, "server": {"backend": "onnx"}},
    "quantization": {"model": {"name": "m"}, "server": {"quantization": "fp8"}},
    "allowedDomains": {"model": {"name": "m"}, "media": {"allowedDomains": ["https://x.io/a"]}},
    "maxImagesPerRequest": {"model": {"name": "m"}, "media": {"maxImagesPerRequest": 0}},
    "maxImageBytes": {"model": {"name": "m"}, "media": {"maxImageBytes": "8MB"}},
    "fetchTimeoutSeconds": {"model": {"name": "m"}, "media": {"fetchTimeoutSeconds": 0}},
    "servedModelAliases": {"model": {"name": "m"}, "servedModelAliases": ["a,b"]},
}


@pytest.mark.parametrize("field", sorted(BAD_SPECS))
def test_schema_refuses_bad_values(field: str, validator: Any) -> None:
    doc = {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {"name": "bad"},
        "spec": BAD_SPECS[field],
    }
    assert not validator.is_valid(doc)
    with pytest.raises(InvalidSpecError, match=field):
        parse_spec(BAD_SPECS[field])


def test_cel_rules_are_mirrored_by_the_model(schema: dict[str, Any]) -> None:
    # The API server evaluates these CEL rules; the model states the same rules so that the
    # operator never renders what the API server would have refused.
    rules = [
        r["rule"]
        for _, prop in _walk(schema, "")
        for r in prop.get("x-kubernetes-validations") or []
    ]
    assert any("minReplicas <= self.maxReplicas" in r for r in rules)
    assert any("has(self.size)" in r for r in rules)
    assert any("self.readOnly" in r for r in rules)
    queue = f"has(self.maxQueueTokens) ? self.maxQueueTokens : {SERVER_QUEUE_TOKENS})"
    assert any(queue in r for r in rules)
    assert any("self.server.maxRequestTokens >= self.embedding.maxInputTokens" in r for r in rules)
    assert any("self.server.backend != 'transformers'" in r for r in rules)
    for field in EMBED_ONLY_FIELDS:
        assert any(f"!has(self.embedding.{field})" in r for r in rules), field
    cases = {
        "minReplicas": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
        "size": {"modelCache": {"mode": "pvc"}},
        "claimName": {"modelCache": {"mode": "existing"}},
        "readOnly needs mode existing": {
            "modelCache": {"mode": "pvc", "size": 1, "readOnly": True}
        },
        "matryoshkaDimensions": {
            "embedding": {"dimensions": 100, "matryoshkaDimensions": [64, 128]}
        },
        "maxQueueTokens": {"server": {"maxBatchTokens": 100, "maxQueueTokens": 10}},
        "maxRequestTokens must be at most maxQueueTokens": {
            "server": {"maxQueueTokens": 1000, "maxRequestTokens": 1001}
        },
        "262144 when unset": {"server": {"maxRequestTokens": 262145}},
        "server.maxRequestTokens must be at least embedding.maxInputTokens": {
            "embedding": {"maxInputTokens": 512},
            "server": {"maxRequestTokens": 511},
        },
        "spec: embedding.pooling applies to task embed only": {
            "task": "score",
            "embedding": {"pooling": "mean"},
        },
        "embedding.normalize applies": {"task": "classify", "embedding": {"normalize": True}},
        "server.backend transformers runs the whole model on one device": {
            "server": {"backend": "transformers"},
            "parallelism": {"tensorParallelSize": 2},
        },
        "embedding.dimensions applies": {"task": "score", "embedding": {"dimensions": 8}},
        "embedding.matryoshkaDimensions applies": {
            "task": "score",
            "embedding": {"matryoshkaDimensions": [8]},
        },
    }
    for expected, extra in cases.items():
        with pytest.raises(InvalidSpecError, match=expected):
            parse_spec({"model": {"name": "m"}, **extra})


def test_env_names_that_load_code_are_refused_by_the_schema_as_by_the_model(
    schema: dict[str, Any],
) -> None:
    """``server.env[]``'s CEL rule lists exactly the names spec.py refuses, so kubectl apply
    refuses them with the field path, and the operator never renders one."""
    env = schema["properties"]["spec"]["properties"]["server"]["properties"]["env"]["items"]
    (rule,) = env["x-kubernetes-validations"]
    assert rule["fieldPath"] == ".name" and rule["reason"] == "FieldValueForbidden"
    prefixes = [f"!self.name.startsWith('{p}')" for p in CODE_LOADING_ENV_PREFIXES]
    names = ", ".join(f"'{n}'" for n in CODE_LOADING_ENV)
    assert rule["rule"] == " && ".join([*prefixes, f"!(self.name in [{names}])"])
    # Bounded, so the API server can bound the rule's cost.
    assert env["properties"]["name"]["maxLength"] == 256
    for name in ("LD_PRELOAD", "PYTHONPATH", "PYTHONSTARTUP", *CODE_LOADING_ENV):
        with pytest.raises(InvalidSpecError, match=r"spec\.server\.env\.0\.name: "):
            parse_spec({"model": {"name": "m"}, "server": {"env": [{"name": name}]}})


AUTOSCALING_REFUSALS = {
    "minReplicas 0 needs autoscaler keda": {"minReplicas": 0},
    "targetPerPod applies to metric queueRequests or queueTokens": {"targetPerPod": 8},
    "targetBacklogSeconds applies to metric backlogSeconds only": {
        "metric": "queueRequests",
        "targetBacklogSeconds": 1,
    },
}


@pytest.mark.parametrize("message", sorted(AUTOSCALING_REFUSALS))
def test_autoscaling_rules_are_in_the_schema_and_the_model(
    schema: dict[str, Any], message: str
) -> None:
    """What the API server refuses (CEL, same message) the operator refuses too; the e2e
    tier has the real API server evaluate the rules."""
    autoscaling = schema["properties"]["spec"]["properties"]["autoscaling"]
    messages = [r["message"] for r in autoscaling["x-kubernetes-validations"]]
    assert any(m.startswith(message) for m in messages)
    with pytest.raises(InvalidSpecError, match=message):
        parse_spec({"model": {"name": "m"}, "autoscaling": AUTOSCALING_REFUSALS[message]})


def test_autoscaling_defaults_for_a_new_service() -> None:
    """A new object gets backlogSeconds; the autoscaler has no default in the schema, so the
    operator's configured default applies to every service that names none."""
    auto = parse_spec({"model": {"name": "m"}}).autoscaling
    assert auto.metric == "backlogSeconds" and auto.autoscaler is None
    zero = parse_spec(
        {"model": {"name": "m"}, "autoscaling": {"autoscaler": "keda", "minReplicas": 0}}
    )
    assert zero.autoscaling.min_replicas == 0
    queue = parse_spec({"model": {"name": "m"}, "autoscaling": {"metric": "queueRequests"}})
    assert queue.autoscaling.metric == "queueRequests"  # what existing objects were stored with


MEDIA_DOMAIN_REFUSALS = {
    "https://images.example.com": "not URLs (no scheme such as https://)",
    "images.example.com/cats": "a path is not allowed",
    "images.example.com:8443": "a port or an IPv6 address is not allowed",
    "fd00::1": "a port or an IPv6 address is not allowed",
    "169.254.169.254": "an IP address is not allowed",
    "*.10": "an IP address is not allowed",
    "Images.Example.com": "lists lowercase host names",
    "*": "lists lowercase host names",
    "*.*.example.com": "lists lowercase host names",
}


@pytest.mark.parametrize("domain", sorted(MEDIA_DOMAIN_REFUSALS))
def test_media_domains_are_host_names_in_the_schema_and_the_model(
    schema: dict[str, Any], validator: Any, domain: str
) -> None:
    """``media.allowedDomains[]``: the CRD refuses a scheme, a path, a port or an IP literal
    (CEL, with a message naming the field) or anything else that is not a host name (its
    pattern); the model refuses the same with the same words, so the operator never renders
    a list the server would match nothing against."""
    items = schema["properties"]["spec"]["properties"]["media"]["properties"]["allowedDomains"]
    items = items["items"]
    messages = [r["message"] for r in items["x-kubernetes-validations"]]
    assert all(m.startswith("media.allowedDomains") for m in messages)
    expected = MEDIA_DOMAIN_REFUSALS[domain]
    cel = [m for m in messages if expected in m]
    if not cel:  # not a CEL refusal: the schema's pattern refuses it
        doc = {
            "apiVersion": "embedding-operator.dev/v1alpha1",
            "kind": "EmbeddingService",
            "metadata": {"name": "bad"},
            "spec": {"model": {"name": "m"}, "media": {"allowedDomains": [domain]}},
        }
        assert not validator.is_valid(doc)
    with pytest.raises(InvalidSpecError, match=r"spec\.media\.allowedDomains: ") as refused:
        parse_spec({"model": {"name": "m"}, "media": {"allowedDomains": [domain]}})
    assert expected in str(refused.value)
    for message in cel:
        assert message in str(refused.value)


def test_media_domain_rules_in_the_schema_are_the_models(schema: dict[str, Any]) -> None:
    """The schema's pattern on ``media.allowedDomains[]`` is the model's, and host names a
    user would list pass both."""
    items = schema["properties"]["spec"]["properties"]["media"]["properties"]["allowedDomains"]
    assert items["items"]["pattern"] == MEDIA_DOMAIN_PATTERN.pattern
    for domain in ("images.example.com", "*.example.com", "localhost", "cdn-1.example.co.uk"):
        assert re.fullmatch(items["items"]["pattern"], domain)
        assert media_domain_problem(domain) is None
        spec = parse_spec({"model": {"name": "m"}, "media": {"allowedDomains": [domain]}})
        assert spec.media is not None and spec.media.allowed_domains == [domain]


def test_media_takes_task_embed_only(schema: dict[str, Any]) -> None:
    """Images go to embedding models (CLIP, SigLIP); a score, classify, token_classify,
    reward or sparse service has nothing to do with them, so the CRD refuses the combination
    (CEL, FieldValueForbidden on .media) as the model does."""
    rules = schema["properties"]["spec"]["x-kubernetes-validations"]
    (rule,) = [r for r in rules if r.get("fieldPath") == ".media"]
    assert rule["rule"] == "!has(self.media) || !has(self.task) || self.task == 'embed'"
    assert rule["reason"] == "FieldValueForbidden"
    for task in ("score", "classify", "token_classify", "reward", "sparse"):
        with pytest.raises(InvalidSpecError, match="media applies to task embed only"):
            parse_spec({"model": {"name": "m"}, "task": task, "media": {}})
        assert rule["message"].startswith("media applies to task embed only")
    assert parse_spec({"model": {"name": "m"}, "media": {}}).media is not None


def test_aliases_are_a_bounded_set_of_names_in_the_schema_and_the_model(
    schema: dict[str, Any], validator: Any
) -> None:
    """``servedModelAliases``: names the server's comma-separated flag can carry (the same
    pattern on both sides), at most 16, unique (``x-kubernetes-list-type: set``: the API
    server refuses a repeat; the model says so too)."""
    field = schema["properties"]["spec"]["properties"]["servedModelAliases"]
    assert field["items"]["pattern"] == MODEL_NAME_PATTERN.pattern
    assert field["maxItems"] == MAX_ALIASES
    assert field["x-kubernetes-list-type"] == "set"

    def doc(aliases: list[str]) -> dict[str, Any]:
        spec = {"model": {"name": "m"}, "servedModelAliases": aliases}
        return {
            "apiVersion": "x/v1",
            "kind": "EmbeddingService",
            "metadata": {"name": "a"},
            "spec": spec,
        }

    good = ["text-embedding-3-small", "BAAI/bge-small-en-v1.5", "e5:large@v2", "a+b_c"]
    assert validator.is_valid(doc(good))
    assert parse_spec(doc(good)["spec"]).served_model_aliases == good
    for bad in (["has space"], ["a,b"], ["-lead"], [""], ["x" * 257]):
        assert not validator.is_valid(doc(bad)), bad
        with pytest.raises(InvalidSpecError, match=r"spec\.servedModelAliases"):
            parse_spec(doc(bad)["spec"])
    too_many = [f"n{i}" for i in range(MAX_ALIASES + 1)]
    assert not validator.is_valid(doc(too_many))
    with pytest.raises(InvalidSpecError, match=r"spec\.servedModelAliases"):
        parse_spec(doc(too_many)["spec"])
    with pytest.raises(InvalidSpecError, match="lists a name twice"):
        parse_spec(doc(["a", "b", "a"])["spec"])


def test_an_alias_may_not_repeat_the_served_name(schema: dict[str, Any]) -> None:
    """CEL on spec (the API server's) and the model refuse the same, with the same words;
    a clash between two services is not the schema's to see: the gateway reports it."""
    rules = schema["properties"]["spec"]["x-kubernetes-validations"]
    (rule,) = [r for r in rules if r.get("fieldPath") == ".servedModelAliases"]
    assert rule["rule"] == (
        "!has(self.servedModelAliases) || !has(self.servedModelName) || "
        "!(self.servedModelName in self.servedModelAliases)"
    )
    assert rule["reason"] == "FieldValueDuplicate"
    with pytest.raises(InvalidSpecError, match=rule["message"]):
        parse_spec(
            {"model": {"name": "m"}, "servedModelName": "x", "servedModelAliases": ["y", "x"]}
        )
    spec = parse_spec({"model": {"name": "m"}, "servedModelName": "x", "servedModelAliases": ["y"]})
    assert spec.served_model_aliases == ["y"]


def test_a_name_may_not_spell_a_versioned_name(schema: dict[str, Any]) -> None:
    """Issue 47, item 4: ``name@<8 to 16 hex digits>`` is what the gateway names each version
    of a model, so neither servedModelName nor an alias may end that way: the CRD's CEL rule
    (on the field, and on each alias, so the API server names the item) and the model refuse
    it with the same words; an @ followed by anything else is a name as before."""
    spec = schema["properties"]["spec"]["properties"]
    for node in (spec["servedModelName"], spec["servedModelAliases"]["items"]):
        (rule,) = node["x-kubernetes-validations"]
        assert rule["rule"] == f"!self.matches('{VERSIONED_NAME.pattern}')"
        assert rule["message"] == VERSIONED_NAME_PROBLEM
    for bad in ("bge@0123abcd", "bge@0123456789ABCDEF", "a/b@deadbeef00"):
        with pytest.raises(InvalidSpecError, match=r"spec\.servedModelName"):
            parse_spec({"model": {"name": "m"}, "servedModelName": bad})
        with pytest.raises(InvalidSpecError, match=r"spec\.servedModelAliases"):
            parse_spec({"model": {"name": "m"}, "servedModelAliases": ["fine", bad]})
    for good in ("e5:large@v2", "bge@0123456", "bge@0123abcdg", "x@0123456789abcdef0"):
        assert parse_spec({"model": {"name": "m"}, "servedModelName": good}).served_name == good
        spec_ = parse_spec({"model": {"name": "m"}, "servedModelAliases": [good]})
        assert spec_.served_model_aliases == [good]


# --- server.quantization int8 ------------------------------------------------------------------

INT8_REFUSALS = {
    "dtype bfloat16": ("server", {"dtype": "bfloat16"}),
    "dtype float16": ("server", {"dtype": "float16"}),
    "backend transformers": ("server", {"backend": "transformers"}),
    "tensorParallelSize 2": ("spec", {"parallelism": {"tensorParallelSize": 2}}),
    "gpu.type h100": ("spec", {"gpu": {"type": "h100"}}),
    "gpu.type t4": ("spec", {"gpu": {"type": "t4"}}),
}


def _int8_rules(schema: dict[str, Any], level: str) -> list[dict[str, Any]]:
    node = schema["properties"]["spec"]
    if level == "server":
        node = node["properties"]["server"]
    return [r for r in node["x-kubernetes-validations"] if "int8" in r["rule"]]


PREFIX_CACHE_REFUSALS = {
    "backend transformers": ("server", {"backend": "transformers"}, ".prefixCache"),
}


@pytest.mark.parametrize("case", sorted(PREFIX_CACHE_REFUSALS))
def test_prefix_cache_is_refused_where_the_server_would_refuse_it(
    schema: dict[str, Any], case: str
) -> None:
    """What the server refuses at start under ``--prefix-cache-bytes`` that a spec can show
    (the transformers backend), the CRD refuses at ``kubectl apply`` and
    the model with the same words; a bidirectional model is the server's to refuse, from
    its config.json."""
    level, extra, field = PREFIX_CACHE_REFUSALS[case]
    server = {"prefixCache": "64Mi", **(extra if level == "server" else {})}
    raw = {"model": {"name": "m"}, "server": server, **(extra if level == "spec" else {})}
    with pytest.raises(InvalidSpecError) as refused:
        parse_spec(raw)
    path, message = str(refused.value).split(": ", 1)
    assert path == ("spec.server" if level == "server" else "spec")
    node = schema["properties"]["spec"]
    if level == "server":
        node = node["properties"]["server"]
    (rule,) = [r for r in node["x-kubernetes-validations"] if r["message"] == message]
    assert (rule["reason"], rule["fieldPath"]) == ("FieldValueForbidden", field)
    assert "prefixCache" in rule["rule"]
    server.pop("prefixCache")
    parse_spec(raw)  # the rest is fine alone


@pytest.mark.parametrize("value", ["0", "-1Mi", "lots", 0])
def test_prefix_cache_must_be_a_positive_quantity(validator: Any, value: object) -> None:
    spec = {"model": {"name": "m"}, "server": {"prefixCache": value}}
    doc = {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {"name": "bad"},
        "spec": spec,
    }
    if value != "0":  # the schema's pattern admits "0"; the model (and the server) do not
        assert not validator.is_valid(doc)
    with pytest.raises(InvalidSpecError, match=r"^spec\.server\.prefixCache: "):
        parse_spec(spec)


@pytest.mark.parametrize("case", sorted(INT8_REFUSALS))
def test_int8_is_refused_where_the_server_would_refuse_it(
    schema: dict[str, Any], case: str
) -> None:
    """What the server refuses at start under ``--quantization int8`` (a crash-looping pod),
    the CRD refuses at ``kubectl apply`` (CEL, FieldValueForbidden on the quantization field)
    and the model with the same words, naming the field."""
    level, extra = INT8_REFUSALS[case]
    server = {"quantization": "int8", **(extra if level == "server" else {})}
    raw = {"model": {"name": "m"}, "server": server, **(extra if level == "spec" else {})}
    with pytest.raises(InvalidSpecError) as refused:
        parse_spec(raw)
    path, message = str(refused.value).split(": ", 1)
    assert path == ("spec.server" if level == "server" else "spec")
    (rule,) = [r for r in _int8_rules(schema, level) if r["message"] == message]
    assert rule["reason"] == "FieldValueForbidden"
    assert rule["fieldPath"] == (".quantization" if level == "server" else ".server.quantization")
    # The same spec without int8 is fine: the rule is about the combination.
    server.pop("quantization")
    parse_spec(raw)


def test_int8_rules_name_every_builtin_gpu_and_refuse_nothing_else(
    schema: dict[str, Any],
) -> None:
    """The CEL rule cannot read the operator's profile file, so it lists the built-in GPU
    profiles (``plan`` refuses an admin's own GPU profile); the rules' shapes are pinned so
    that a spec without int8 can never trip them."""
    names = ", ".join(f"'{n}'" for n in BUILTIN_GPU_TYPES)
    assert set(BUILTIN_GPU_TYPES) == {n for n, p in BUILTIN_PROFILES.items() if p.resource_name}
    assert "cpu" not in BUILTIN_GPU_TYPES and len(BUILTIN_GPU_TYPES) == len(BUILTIN_PROFILES) - 1
    guard = "!has(self.server) || !has(self.server.quantization) || "
    guard += "self.server.quantization != 'int8'"
    assert sorted(r["rule"] for r in _int8_rules(schema, "spec")) == sorted(
        [
            f"{guard} || !has(self.gpu) || !has(self.gpu.type) || !(self.gpu.type in [{names}])",
            f"{guard} || !has(self.parallelism) || !has(self.parallelism.tensorParallelSize) "
            "|| self.parallelism.tensorParallelSize == 1",
        ]
    )
    guard = "!has(self.quantization) || self.quantization != 'int8'"
    assert sorted(r["rule"] for r in _int8_rules(schema, "server")) == sorted(
        [
            f"{guard} || !has(self.backend) || self.backend != 'transformers'",
            f"{guard} || !has(self.dtype) || !(self.dtype in ['bfloat16', 'float16'])",
        ]
    )


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"server": {"quantization": "int8", "dtype": "float32", "backend": "native"}},
        {"server": {"quantization": "int8", "dtype": "auto", "backend": "auto"}},
        {"server": {"quantization": "int8"}, "gpu": {"type": "cpu-amx"}},
        {"server": {"quantization": "none", "dtype": "bfloat16"}, "gpu": {"type": "h100"}},
    ],
)
def test_int8_on_the_cpu_is_admitted(validator: Any, extra: dict[str, Any]) -> None:
    doc = {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingService",
        "metadata": {"name": "int8"},
        "spec": {"model": {"name": "m"}, **extra},
    }
    assert validator.is_valid(doc)
    quantization = extra.get("server", {}).get("quantization", "none")
    assert parse_spec(doc["spec"]).server.quantization == quantization
