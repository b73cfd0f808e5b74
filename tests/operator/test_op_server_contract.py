"""The operator's enums and rendered flags are ones the bundled server accepts.

The two packages never import each other (import-linter), so this test is where a value the
CRD admits but the server would refuse at start (a crash-looping pod) gets caught.
"""

from __future__ import annotations

import itertools
import typing

import pytest
import torch
from embedding_operator import spec as operator_spec
from embedding_operator.builders.deployment import SERVER_DRAIN_SECONDS, server_args
from embedding_operator.builders.hpa import SERVER_BATCH_TOKENS
from embedding_server import settings as server_settings
from embedding_server.api.probes import PROBE_PATHS
from embedding_server.cli import load_settings
from embedding_server.device.quantization import refuse_int8
from embedding_server.errors import UnsupportedModelError

from tests.support.operator import render_input


@pytest.mark.parametrize("name", ["Pooling", "Dtype", "ModelBackend", "Quantization"])
def test_enums_agree(name: str) -> None:
    ours = set(typing.get_args(getattr(operator_spec, name)))
    theirs = set(typing.get_args(getattr(server_settings, name)))
    assert ours == theirs


@pytest.mark.parametrize("pooling", typing.get_args(operator_spec.Pooling))
def test_every_pooling_renders_flags_the_server_parses(pooling: str) -> None:
    args = server_args(
        render_input(
            {
                "model": {"name": "hf://BAAI/bge-small-en-v1.5"},
                "embedding": {"pooling": pooling},
                "server": {"dtype": "float32", "maxBatchTokens": 4096},
                "gpu": {"type": "cpu"},
            }
        )
    )
    settings = load_settings(args)
    assert settings.pooling == pooling
    assert settings.dtype == "float32"
    assert settings.max_batch_tokens == 4096


def test_tasks_agree_and_render_flags_the_server_parses() -> None:
    """Every task the CRD admits is one the server serves (it also has auto, which the
    operator never renders: the spec's default is embed)."""
    tasks = typing.get_args(operator_spec.Task)
    assert set(tasks) == set(typing.get_args(server_settings.TaskSetting)) - {"auto"}
    for task in tasks:
        args = server_args(render_input({"model": {"name": "hf://m/reranker"}, "task": task}))
        assert load_settings(args).task == task


def test_autoscaling_defaults_assume_the_servers_batch_budgets() -> None:
    assert SERVER_BATCH_TOKENS == {
        "cpu": server_settings.CPU_BATCH_TOKENS,
        "gpu": server_settings.GPU_BATCH_TOKENS,
    }


def test_request_limits_render_flags_the_server_parses_and_its_default_queue() -> None:
    """The CRD's rule that maxRequestTokens fits the queue assumes the server's default
    queue when maxQueueTokens is unset; the flag reaches the server's setting."""
    default = server_settings.ServerSettings.model_fields["max_queue_tokens"].default
    assert default == operator_spec.SERVER_QUEUE_TOKENS
    args = server_args(
        render_input({"model": {"name": "hf://m/e"}, "server": {"maxRequestTokens": 4096}})
    )
    settings = load_settings(args)
    assert settings.max_request_tokens == 4096
    assert settings.max_queue_tokens == default


def test_the_probes_target_the_probe_port_the_server_is_told_to_open() -> None:
    """The kubelet's probes go to the container port the server opens with --probe-port (a
    port of its own, outside --max-connections), and the client port stays the Service's."""
    from embedding_operator.builders.deployment import build_deployment

    render = render_input({"model": {"name": "hf://m/e"}}, name="minilm")
    (container,) = build_deployment(render)["spec"]["template"]["spec"]["containers"]
    settings = load_settings(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert settings.probe_port is not None and settings.probe_port != settings.port
    assert ports == {"http": settings.port, "probe": settings.probe_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert ports[get["port"]] == settings.probe_port, probe
        assert get["path"] in PROBE_PATHS, probe


def test_grace_period_covers_the_servers_drain() -> None:
    """The pod's grace period is sized from the server's default drain; if the server drained
    longer, the kubelet would SIGKILL it with requests in flight."""
    default = server_settings.ServerSettings.model_fields["shutdown_timeout"].default
    assert default <= SERVER_DRAIN_SECONDS


@pytest.mark.parametrize("auto_truncate", [True, False])
def test_auto_truncate_renders_the_servers_flag(auto_truncate: bool) -> None:
    args = server_args(
        render_input(
            {
                "model": {"name": "hf://BAAI/bge-small-en-v1.5"},
                "embedding": {"autoTruncate": auto_truncate, "maxInputTokens": 512},
                "gpu": {"type": "cpu"},
            }
        )
    )
    settings = load_settings(args)
    assert settings.auto_truncate is auto_truncate
    assert settings.max_model_len == 512


@pytest.mark.parametrize("backend", typing.get_args(operator_spec.ModelBackend))
def test_every_backend_renders_flags_the_server_parses(backend: str) -> None:
    """The CRD's backend reaches the server's --backend (auto by leaving it out: the server's
    default, which the spec's must equal), and trustRemoteCode its --trust-remote-code."""
    default = server_settings.ServerSettings.model_fields["backend"].default
    assert default == operator_spec.Server.model_fields["backend"].default
    args = server_args(
        render_input(
            {
                "model": {
                    "name": "hf://sentence-transformers/gtr-t5-base",
                    "trustRemoteCode": True,
                },
                "server": {"backend": backend},
            }
        )
    )
    settings = load_settings(args)
    assert settings.backend == backend
    assert settings.trust_remote_code is True


def test_tracing_renders_a_flag_and_variables_the_server_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """spec.tracing reaches the server's --otlp-traces-endpoint, and the OTEL_* variables the
    operator sets are ones the server's OpenTelemetry SDK reads: the service, the resource
    attributes (with the pod name the kubelet substitutes) and the sampler."""
    from embedding_operator.builders.deployment import build_deployment
    from embedding_server.request.tracing import service_resource
    from opentelemetry.sdk.trace import TracerProvider

    tracing = {"otlpEndpoint": "http://otel.observability:4318", "samplingRatio": 0.1}
    render = render_input({"model": {"name": "hf://m/e"}, "tracing": tracing}, name="minilm")
    (container,) = build_deployment(render)["spec"]["template"]["spec"]["containers"]
    settings = load_settings(container["args"])
    assert settings.otlp_traces_endpoint == "http://otel.observability:4318"
    values: dict[str, str] = {}
    for var in container["env"]:
        value = var.get("value", "pod-7f9c")  # the downward API's pod name
        for name, known in values.items():  # the kubelet's $(VAR) expansion
            value = value.replace(f"$({name})", known)
        values[var["name"]] = value
        if var["name"].startswith("OTEL_"):
            monkeypatch.setenv(var["name"], value)
    resource = service_resource().attributes
    assert resource["service.name"] == "minilm"
    assert resource["k8s.namespace.name"] == "ns"
    assert resource["k8s.pod.name"] == "pod-7f9c"
    sampler = TracerProvider().sampler.get_description()
    assert sampler.startswith("ParentBased{root:TraceIdRatioBased{0.1}"), sampler


def test_the_operator_recognises_the_servers_model_load_failure() -> None:
    """The server's termination message on a failed load is what the operator matches to
    report ModelLoadFailed and count the restarts by that reason."""
    from embedding_operator.status import SERVER_MODEL_LOAD_FAILED, restart_reason
    from embedding_server.termination import MODEL_LOAD_FAILED

    assert MODEL_LOAD_FAILED.startswith(SERVER_MODEL_LOAD_FAILED)
    assert restart_reason({"reason": "Error", "message": MODEL_LOAD_FAILED}) == "ModelLoadFailed"


def test_the_allowed_hosts_let_in_the_service_names_probes_and_nothing_else() -> None:
    """The names the operator renders are ones the server's Host check accepts, as are the
    Hosts the kubelet's probes and Prometheus send (the pod's IP, v4 or v6, with the port);
    a rebinding page's own name is not."""
    from embedding_server.api.middleware import HostCheck

    args = server_args(render_input({"model": {"name": "hf://m/e"}}, name="emb", namespace="ns"))
    check = HostCheck(load_settings(args).allowed_hosts or [])
    for host in (
        "emb",
        "emb.ns:80",
        "emb.ns.svc",
        "emb.ns.svc.cluster.local:80",
        "localhost:8000",
        "10.244.1.7:8000",
        "[fd00:10:244::7]:8000",
    ):
        assert check.allows(host.encode()), host
    for host in ("attacker.example", "emb.attacker.example", "emb.ns.svc.attacker.example"):
        assert not check.allows(host.encode()), host
    # An explicit --allowed-hosts in extraArgs replaces the rendered list (the last flag wins).
    spec = {"model": {"name": "hf://m/e"}, "server": {"extraArgs": ["--allowed-hosts", "*"]}}
    settings = load_settings(server_args(render_input(spec)))
    assert HostCheck(settings.allowed_hosts or []).allows(b"embed.example.com")


def test_media_renders_flags_the_server_parses() -> None:
    """Every spec.media field reaches the ServerSettings field it names, with the value the
    server then enforces (maxImageBytes as a quantity arrives in bytes)."""
    media = {
        "allowedDomains": ["images.example.com", "*.cdn.example.org"],
        "maxImagesPerRequest": 3,
        "maxImageBytes": "1Mi",
        "maxImagePixels": 1_000_000,
        "fetchTimeoutSeconds": 1.5,
    }
    render = render_input({"model": {"name": "m/clip"}, "media": media})
    settings = load_settings(server_args(render))
    assert settings.allowed_media_domains == ["images.example.com", "*.cdn.example.org"]
    assert settings.max_images_per_request == 3
    assert settings.max_image_bytes == 1024 * 1024
    assert settings.max_image_pixels == 1_000_000
    assert settings.media_fetch_timeout == 1.5


def test_media_limits_default_to_the_servers() -> None:
    """The CRD's descriptions quote the server's defaults for the media limits."""
    from tests.support.operator import CRD_PATH

    crd = CRD_PATH.read_text()
    fields = server_settings.ServerSettings.model_fields
    assert fields["max_images_per_request"].default == 16
    assert fields["max_image_bytes"].default == 8 * 1024 * 1024
    assert fields["max_image_pixels"].default == 25_000_000
    assert fields["media_fetch_timeout"].default == 5.0
    for quoted in ("Server default: 16.", "Server default: 8Mi.", "Server default: 25000000."):
        assert quoted in " ".join(crd.split()), quoted


def test_aliases_render_a_flag_the_server_parses_into_the_names_it_accepts() -> None:
    spec = {"model": {"name": "hf://BAAI/bge-small-en-v1.5"}, "servedModelAliases": ["a", "b.c/d"]}
    settings = load_settings(server_args(render_input(spec)))
    assert settings.served_model_aliases == ["a", "b.c/d"]
    assert settings.served_model_name == "bge-small-en-v1.5"


def _server_refuses(args: list[str], backend: str) -> str | None:
    """Why the server refuses these flags at start, or None: its settings' checks, then the
    loader's (``refuse_int8``, given the backend a model type would be served by)."""
    try:
        settings = load_settings(args)
    except SystemExit as exc:
        return f"its settings refuse them (exit {exc.code})"
    if settings.quantization == "int8":
        try:
            refuse_int8(
                device=torch.device(settings.device),
                dtype=settings.dtype,
                backend=backend,
                tensor_parallel=settings.tensor_parallel_size > 1,
            )
        except UnsupportedModelError as exc:
            return str(exc)
    return None


def test_the_crd_admits_int8_exactly_where_the_server_serves_it() -> None:
    """Every combination of quantization, dtype, backend, tensor parallelism and GPU: the
    spec is refused (as the CRD's CEL rules refuse it) exactly when the server would refuse
    the flags the operator renders for it, so no admitted spec crash-loops and nothing the
    server serves is refused. The backend auto resolves to native for the families int8
    quantizes."""
    checked = 0
    for quantization, dtype, backend, tp, gpu in itertools.product(
        typing.get_args(operator_spec.Quantization),
        typing.get_args(operator_spec.Dtype),
        typing.get_args(operator_spec.ModelBackend),
        (1, 2),
        ("cpu", "l4"),
    ):
        if backend == "transformers" and tp > 1:
            continue  # refused on its own account, int8 or not
        raw = {
            "model": {"name": "hf://BAAI/bge-small-en-v1.5"},
            "server": {"quantization": quantization, "dtype": dtype, "backend": backend},
            "parallelism": {"tensorParallelSize": tp},
            "gpu": {"type": gpu},
        }
        try:
            render = render_input(raw)
        except operator_spec.InvalidSpecError as exc:
            assert quantization == "int8", (raw, exc)
            args = [
                "serve",
                "--quantization",
                "int8",
                "--dtype",
                dtype,
                "--device",
                "cuda" if gpu != "cpu" else "cpu",
                "--tensor-parallel-size",
                str(tp),
            ]
            assert _server_refuses(args, "native" if backend == "auto" else backend), raw
        else:
            served = "native" if backend == "auto" else backend
            assert _server_refuses(server_args(render), served) is None, raw
            assert load_settings(server_args(render)).quantization == quantization
        checked += 1
    assert checked == 2 * 4 * 3 * 2 * 2 - 2 * 4 * 2
