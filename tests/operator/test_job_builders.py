"""An EmbeddingJob's children as the pods will run them: the worker contract, secrets by
reference only, suspend, the pods' identity and hardening."""

from __future__ import annotations

from typing import Any

from embedding_operator.builders.common import Owner
from embedding_operator.jobs.builders import (
    ROWS_ANNOTATION,
    build_planner_job,
    build_service_account,
    build_worker_job,
    mutable_fields,
    pod_selector,
)
from embedding_operator.jobs.spec import parse_job_spec

OWNER = Owner(name="corpus", namespace="team", uid="uid-job", generation=1)
IMAGE = "registry.example/embedding-server:1.2"
URL = "http://minilm.team.svc.cluster.local:80"
SPEC: dict[str, Any] = {
    "service": "minilm",
    "input": {"urls": ["s3://corpus/a/*.parquet", "s3://corpus/b.parquet"], "format": "parquet"},
    "output": {"url": "s3://corpus/out/"},
    "storage": {
        "s3": {
            "endpoint": "http://seaweedfs:8333",
            "region": "us-east-1",
            "credentialsSecret": {"name": "corpus-s3"},
        }
    },
    "parallelism": 4,
}


def _worker(spec: dict[str, Any] = SPEC, shards: int = 10, **kw: Any) -> dict[str, Any]:
    return build_worker_job(
        OWNER, parse_job_spec(spec), shards=shards, rows=12345, image=IMAGE, service_url=URL, **kw
    )


def _container(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_planner_runs_job_plan_with_every_input() -> None:
    job = build_planner_job(OWNER, parse_job_spec({**SPEC, "shardRows": 5000}), IMAGE)
    container = _container(job)
    assert container["image"] == IMAGE and container["command"] == ["embedding-server"]
    assert container["args"] == [
        "job",
        "plan",
        "--input",
        "s3://corpus/a/*.parquet",
        "--input",
        "s3://corpus/b.parquet",
        "--format",
        "parquet",
        "--id-field",
        "id",
        "--text-field",
        "text",
        "--output",
        "s3://corpus/out/",
        "--shard-rows",
        "5000",
        "--s3-endpoint",
        "http://seaweedfs:8333",
        "--termination-log",
        "/dev/termination-log",
    ]
    assert job["metadata"]["name"] == "corpus-plan"
    assert job["spec"]["completions"] == 1 and job["spec"]["suspend"] is False


def test_images_and_jsonl_are_the_planners_to_pass_and_the_servers_parser_takes_them() -> None:
    """``input.imageField`` replaces ``--text-field``; ``output.format: jsonl`` adds
    ``--output-format`` (Parquet, the default, adds nothing, so an older server image still
    plans). The plan keeps both, so the workers' flags do not change; and the server's own
    parser takes what the planner is given."""
    from embedding_server.cli import build_parser

    images = {**SPEC, "input": {**SPEC["input"], "imageField": "picture"}}
    jsonl = {**SPEC, "output": {**SPEC["output"], "format": "jsonl"}}
    both = {**images, "output": jsonl["output"]}
    parser = build_parser()
    for raw, text, image, fmt in [
        (SPEC, "text", None, "parquet"),
        (images, None, "picture", "parquet"),
        (jsonl, "text", None, "jsonl"),
        (both, None, "picture", "jsonl"),
    ]:
        args = _container(build_planner_job(OWNER, parse_job_spec(raw), IMAGE))["args"]
        assert ("--output-format" in args) == (fmt != "parquet")
        parsed = parser.parse_args(args)
        assert (parsed.text_field, parsed.image_field, parsed.output_format) == (text, image, fmt)
        worker = _container(_worker(raw))["args"]
        assert worker == _container(_worker())["args"]
        parser.parse_args(worker)


def test_worker_is_an_indexed_job_over_the_shards() -> None:
    job = _worker(model="all-MiniLM-L6-v2")
    spec = job["spec"]
    assert job["metadata"]["name"] == "corpus-work"
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == 10 and spec["parallelism"] == 4
    assert spec["backoffLimitPerIndex"] == 3
    assert "maxFailedIndexes" not in spec  # every shard is tried before the job fails
    assert job["metadata"]["annotations"][ROWS_ANNOTATION] == "12345"
    args = _container(job)["args"]
    assert args[:6] == ["job", "work", "--output", "s3://corpus/out/", "--service", URL]
    assert args[args.index("--model") + 1] == "all-MiniLM-L6-v2"
    assert "--index" not in args  # JOB_COMPLETION_INDEX, set by the Job controller
    assert "--max-in-flight" not in args and "--batch-size" not in args  # worker defaults
    tuned = _container(_worker({**SPEC, "maxInFlight": 8, "batchSize": 64}))["args"]
    assert tuned[tuned.index("--max-in-flight") + 1] == "8"
    assert tuned[tuned.index("--batch-size") + 1] == "64"


def test_never_more_pods_than_shards() -> None:
    assert _worker(shards=2)["spec"]["parallelism"] == 2


def test_bad_arguments_fail_the_job_and_disruptions_cost_no_retry() -> None:
    rules = _worker()["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "job", "operator": "In", "values": [2]},
    }
    assert rules[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert _worker()["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_credentials_come_from_the_secret_by_reference() -> None:
    for job in (_worker(), build_planner_job(OWNER, parse_job_spec(SPEC), IMAGE)):
        env = {e["name"]: e for e in _container(job)["env"]}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key] == {
                "name": key,
                "valueFrom": {"secretKeyRef": {"name": "corpus-s3", "key": key}},
            }
        assert env["AWS_REGION"]["value"] == "us-east-1"
        assert all("value" not in e for k, e in env.items() if k.startswith("AWS_") and "KEY" in k)


def test_pvc_storage_is_mounted_at_data() -> None:
    spec = {
        "service": "minilm",
        "input": {"urls": ["/data/in/*.jsonl"], "format": "jsonl"},
        "output": {"url": "/data/out/"},
        "storage": {"pvc": {"claimName": "corpus"}},
    }
    job = _worker(spec)
    pod = job["spec"]["template"]["spec"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}} in pod["volumes"]
    assert {"name": "data", "mountPath": "/data"} in _container(job)["volumeMounts"]
    assert _container(job)["env"] == []
    assert "--s3-endpoint" not in _container(job)["args"]


def test_suspend_is_mirrored_and_the_only_fields_kept_in_step() -> None:
    suspended = parse_job_spec({**SPEC, "suspend": True})
    assert _worker({**SPEC, "suspend": True})["spec"]["suspend"] is True
    assert build_planner_job(OWNER, suspended, IMAGE)["spec"]["suspend"] is True
    assert mutable_fields(suspended, 10) == {"parallelism": 4, "suspend": True}
    assert mutable_fields(suspended, None) == {"suspend": True}


def test_pods_have_their_own_identity_and_no_token() -> None:
    account = build_service_account(OWNER)
    assert account["metadata"]["name"] == "corpus-embedding-job"
    assert account["automountServiceAccountToken"] is False
    for job in (_worker(), build_planner_job(OWNER, parse_job_spec(SPEC), IMAGE)):
        pod = job["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "corpus-embedding-job"
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        security = _container(job)["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert {"name": "tmp", "mountPath": "/tmp"} in _container(job)["volumeMounts"]
        assert _container(job)["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_children_are_owned_by_the_embedding_job() -> None:
    for child in (_worker(), build_service_account(OWNER)):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["kind"] == "EmbeddingJob" and ref["uid"] == "uid-job" and ref["controller"]
    labels = _worker()["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "embedding-job"
    assert labels["app.kubernetes.io/component"] == "worker"
    assert "app.kubernetes.io/component=worker" in pod_selector(OWNER, "worker")


def test_memory_request_is_the_limit_when_none_is_set() -> None:
    job = _worker({**SPEC, "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}})
    assert _container(job)["resources"] == {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"memory": "256Mi"},
    }


def test_render_shows_what_the_operator_would_create(tmp_path: Any, capsys: Any) -> None:
    """``embedding-operator render`` of an EmbeddingJob beside its EmbeddingService: the same
    builders, the service's image and port, and the shards given on the command line."""
    import yaml
    from embedding_operator.cli import main

    from tests.support.operator import JOB_EXAMPLES, ROOT

    manifest = tmp_path / "both.yaml"
    service = yaml.safe_load((ROOT / "examples" / "minilm-cpu.yaml").read_text())
    service["spec"]["server"] = {"image": "registry.example/embedding-server:3"}
    service["spec"]["service"] = {"port": 8080}
    job = yaml.safe_load(JOB_EXAMPLES[0].read_text())
    manifest.write_text(yaml.safe_dump_all([service, job]))
    assert main(["render", "-f", str(manifest), "--namespace", "demo", "--job-shards", "6"]) == 0
    docs = {
        (d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(capsys.readouterr().out)
    }
    worker = docs[("Job", "corpus-minilm-work")]
    assert worker["spec"]["completions"] == 6
    assert "ownerReferences" not in worker["metadata"]
    container = _container(worker)
    assert container["image"] == "registry.example/embedding-server:3"
    args = container["args"]
    assert args[args.index("--service") + 1] == "http://minilm.demo.svc.cluster.local:8080"
    assert ("ServiceAccount", "corpus-minilm-embedding-job") in docs
    assert ("Job", "corpus-minilm-plan") in docs


def test_render_refuses_a_bad_job(tmp_path: Any, capsys: Any) -> None:
    from embedding_operator.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: embedding-operator.dev/v1alpha1\nkind: EmbeddingJob\n"
        "metadata: {name: j}\nspec: {service: minilm, input: {urls: ['s3://corpus/a'], "
        "format: csv}, output: {url: 's3://corpus/o'}}\n"
    )
    assert main(["render", "-f", str(bad)]) == 2
    assert "spec: storage.s3 is required" in capsys.readouterr().err


def test_the_services_network_policy_admits_the_jobs_workers() -> None:
    """An EmbeddingJob runs in its service's namespace, and the service's NetworkPolicy admits
    every pod of that namespace (a namespace peer without a pod selector), so the workers need
    no rule of their own. If the policy ever narrows to pods, this fails and the job's pods
    (label app.kubernetes.io/name=embedding-job) must be added to it."""
    from embedding_operator.builders.networkpolicy import build_network_policy

    from tests.support.operator import render_input

    render = render_input(
        {"model": {"name": "m"}, "networkPolicy": {"enabled": True}},
        name="minilm",
        namespace="team",
    )
    rule = build_network_policy(render)["spec"]["ingress"][0]  # the client port's
    (peer,) = rule["from"]
    assert "podSelector" not in peer
    (expression,) = peer["namespaceSelector"]["matchExpressions"]
    assert "team" in expression["values"]


def test_the_job_watch_is_label_selected() -> None:
    from embedding_operator.handlers import JOB_RESOURCE, MANAGED_SELECTOR, kopf_settings
    from embedding_operator.settings import OperatorSettings

    settings = kopf_settings(OperatorSettings())
    assert settings.watching.label_selectors[JOB_RESOURCE] == MANAGED_SELECTOR


MODEL_SPEC: dict[str, Any] = {
    **{k: v for k, v in SPEC.items() if k != "service"},
    "model": {
        "name": "hf://BAAI/bge-small-en-v1.5",
        "revision": "5c38ec7c405ec4b44b94cc5a9bb96e735b38267a",
        "dtype": "bfloat16",
        "normalize": False,
        "hubTokenSecretRef": {"name": "hf", "key": "hub-token"},
    },
    "resources": {"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": 1, "memory": "16Gi"}},
}


def _model_worker(spec: dict[str, Any] = MODEL_SPEC) -> dict[str, Any]:
    return build_worker_job(
        OWNER, parse_job_spec(spec), shards=10, rows=12345, image=IMAGE, service_url=None
    )


def _job_work_parser() -> Any:
    from embedding_server.cli import build_parser

    return build_parser()


def test_a_model_job_loads_the_model_in_its_workers_with_the_services_flags() -> None:
    """spec.model: ``job work --local`` and the engine flags, no service URL; the server's
    own parser reads them as the settings serve would take for that model."""
    from embedding_server.batch.job import local_settings

    container = _container(_model_worker())
    args = container["args"]
    assert "--service" not in args and URL not in " ".join(args)
    assert args[:4] == ["job", "work", "--output", "s3://corpus/out/"]
    parsed = _job_work_parser().parse_args(args)
    assert parsed.local and parsed.service is None
    settings = local_settings(parsed)
    assert settings.model == "BAAI/bge-small-en-v1.5"  # the hf:// prefix is the CRD's
    assert settings.revision == "5c38ec7c405ec4b44b94cc5a9bb96e735b38267a"
    assert (settings.device, settings.dtype, settings.pooling) == ("cuda", "bfloat16", "auto")
    assert settings.normalize is False and settings.cache_dir == "/cache"
    assert not settings.trust_remote_code
    # No GPU asked for: the CPU, named (never auto), and serve's defaults for the rest.
    cpu = {**MODEL_SPEC, "model": {"name": "BAAI/bge-small-en-v1.5"}, "resources": {}}
    plain = local_settings(_job_work_parser().parse_args(_container(_model_worker(cpu))["args"]))
    assert (plain.device, plain.dtype, plain.normalize, plain.revision) == (
        "cpu",
        "auto",
        None,
        None,
    )


def test_a_model_jobs_workers_get_the_model_as_a_services_pods_do() -> None:
    """The model-cache volume at /cache (an emptyDir, or the claim), HF_HOME on it,
    HF_HUB_OFFLINE for a read-only claim and HF_TOKEN by reference, as the Deployment's pods
    (builders.deployment's own helpers); the planner gets none of it, nor the GPU."""
    worker = _container(_model_worker())
    env = {e["name"]: e for e in worker["env"]}
    assert env["HF_HOME"]["value"] == "/cache/huggingface"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "hub-token"}}
    assert "HF_HUB_OFFLINE" not in env
    assert "AWS_ACCESS_KEY_ID" in env  # the store's credentials stay
    assert {"name": "model-cache", "mountPath": "/cache"} in worker["volumeMounts"]
    volumes = _model_worker()["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model-cache", "emptyDir": {}} in volumes
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": "1", "memory": "16Gi"}

    shared = {**MODEL_SPEC, "modelCache": {"mode": "existing", "claimName": "hf", "readOnly": True}}
    job = _model_worker(shared)
    container = _container(job)
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    assert {"name": "model-cache", "mountPath": "/cache", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "hf", "readOnly": True},
    } in job["spec"]["template"]["spec"]["volumes"]

    planner = _container(build_planner_job(OWNER, parse_job_spec(shared), IMAGE))
    assert not any(e["name"].startswith("HF_") for e in planner["env"])
    assert all(m["name"] != "model-cache" for m in planner["volumeMounts"])
    assert planner["resources"] == {
        "requests": {"cpu": "4"},
        "limits": {"memory": "16Gi"},
    }


def test_a_service_job_loads_no_model() -> None:
    container = _container(_worker())
    assert "--local" not in container["args"]
    assert not any(e["name"].startswith("HF_") for e in container["env"])
    assert all(m["name"] != "model-cache" for m in container["volumeMounts"])


def test_scheduling_places_both_pods() -> None:
    """spec.scheduling (EmbeddingService's shape) on the planner's and the workers' pods,
    each field only when set."""
    placed = {
        **MODEL_SPEC,
        "scheduling": {
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
            "priorityClassName": "batch-low",
        },
    }
    spec = parse_job_spec(placed)
    planner = build_planner_job(OWNER, spec, IMAGE)["spec"]["template"]["spec"]
    worker = _model_worker(placed)["spec"]["template"]["spec"]
    for pod in (planner, worker):
        assert pod["nodeSelector"] == {"pool": "gpu"}
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        assert pod["affinity"] == placed["scheduling"]["affinity"]
        assert pod["priorityClassName"] == "batch-low"
    unplaced = _worker()["spec"]["template"]["spec"]
    assert not {"nodeSelector", "tolerations", "affinity", "priorityClassName"} & set(unplaced)


def test_render_of_a_model_job_needs_no_service(tmp_path: Any, capsys: Any) -> None:
    import yaml
    from embedding_operator.cli import main

    manifest = tmp_path / "job.yaml"
    doc = {
        "apiVersion": "embedding-operator.dev/v1alpha1",
        "kind": "EmbeddingJob",
        "metadata": {"name": "one-off"},
        "spec": MODEL_SPEC,
    }
    manifest.write_text(yaml.safe_dump(doc))
    assert main(["render", "-f", str(manifest), "--default-image", IMAGE]) == 0
    docs = {
        (d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(capsys.readouterr().out)
    }
    worker = _container(docs[("Job", "one-off-work")])
    assert worker["image"] == IMAGE and "--local" in worker["args"]


def test_a_model_job_pinned_to_a_fingerprint_has_its_workers_check_it() -> None:
    pinned = {**MODEL_SPEC, "fingerprint": "60e90041"}
    args = _container(_model_worker(pinned))["args"]
    parsed = _job_work_parser().parse_args(args)
    assert parsed.local and parsed.expect_fingerprint == "60e90041"
