"""The CLI: render prints the same children the operator applies; flags come from settings."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import yaml
from embedding_operator.cli import build_parser, main, settings_from_args

from tests.support.operator import EXAMPLES


def _render(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> list[dict]:
    assert main(["render", "-f", str(path), *extra]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_render_examples(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = _render(path, capsys, "--namespace", "demo")
    kinds = [d["kind"] for d in docs]
    assert "Deployment" in kinds and "Service" in kinds
    for doc in docs:
        assert doc["metadata"]["namespace"] == "demo"
        assert "ownerReferences" not in doc["metadata"]  # applyable on its own


def test_render_hybrid_search_example_serves_the_reranker_with_task_score(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The Qwen3-Reranker of examples/hybrid-search-l4.yaml starts with --task score (under
    the default, auto, the server refuses a *ForCausalLM reranker); bge-m3 with task embed."""
    root = EXAMPLES[0].parent
    docs = _render(root / "hybrid-search-l4.yaml", capsys)
    tasks = {}
    for doc in docs:
        if doc["kind"] == "Deployment":
            args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
            tasks[doc["metadata"]["name"]] = args[args.index("--task") + 1]
    assert tasks == {"bge-m3": "embed", "qwen3-reranker": "score"}


def test_render_autoscaled_example_has_hpa(capsys: pytest.CaptureFixture[str]) -> None:
    root = EXAMPLES[0].parent
    docs = {d["kind"]: d for d in _render(root / "bge-h100.yaml", capsys)}
    assert (
        docs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
        == "embedding_server_queue_tokens"
    )
    assert "replicas" not in docs["Deployment"]["spec"]


def test_render_reports_bad_specs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: embedding-operator.dev/v1alpha1\nkind: EmbeddingService\n"
        "metadata: {name: x}\nspec: {model: {name: m}, gpu: {type: tpu}}\n"
    )
    assert main(["render", "-f", str(bad)]) == 2
    assert "spec.gpu.type" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO(bad.read_text().replace("tpu", "l4")))
    assert main(["render", "-f", "-", "--default-image", "me/img:2"]) == 0
    out = capsys.readouterr().out
    assert "me/img:2" in out and "NVIDIA-L4" in out


def test_render_prints_tensor_parallelism_on_the_bundled_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "tp.yaml"
    manifest.write_text(
        "apiVersion: embedding-operator.dev/v1alpha1\nkind: EmbeddingService\n"
        "metadata: {name: tp}\n"
        "spec: {model: {name: m}, gpu: {type: h100}, parallelism: {tensorParallelSize: 2}}\n"
    )
    docs = {d["kind"]: d for d in _render(manifest, capsys)}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "2"


def test_render_applies_the_allowlist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "img.yaml"
    manifest.write_text(
        "apiVersion: embedding-operator.dev/v1alpha1\nkind: EmbeddingService\n"
        "metadata: {name: own}\nspec: {model: {name: m}, server: {image: me/srv:1}}\n"
    )
    assert main(["render", "-f", str(manifest), "--allowed-images", "corp/*, x:1"]) == 2
    assert "own: spec.server.image: 'me/srv:1' is not in" in capsys.readouterr().err
    assert main(["render", "-f", str(manifest), "--allowed-images", "corp/*,me/*"]) == 0


def test_run_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDDING_OPERATOR_NAMESPACES", "from-env")
    monkeypatch.setenv("EMBEDDING_OPERATOR_LOG_FORMAT", "json")
    monkeypatch.setenv("EMBEDDING_OPERATOR_ALLOWED_PRIORITY_CLASSES", "low, high")
    args = build_parser().parse_args(
        ["run", "--namespaces", "a,b", "--leader-elect", "--resync-seconds", "5"]
    )
    config = settings_from_args(args)
    assert config.policy.allowed_priority_classes == ("low", "high")
    assert config.policy.allowed_images == ()
    assert config.namespaces == ["a", "b"]
    assert config.log_format == "json"
    assert config.leader_elect and config.resync_seconds == 5


def test_run_rejects_bad_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--gpu-profiles", str(tmp_path / "missing.yaml")]) == 2
    assert "invalid configuration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--log-format", "xml"])


def test_render_passes_aliases_as_the_operator_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``render`` plans with the object's annotations too, so its Deployment is the one the
    operator applies: the field's aliases, then the deprecated annotation's."""
    manifest = tmp_path / "aliased.yaml"
    manifest.write_text(
        "apiVersion: embedding-operator.dev/v1alpha1\nkind: EmbeddingService\n"
        "metadata: {name: x, annotations: {embedding-operator.dev/aliases: 'legacy'}}\n"
        "spec: {model: {name: BAAI/bge-small-en-v1.5}, servedModelAliases: [bge]}\n"
    )
    (deployment,) = [d for d in _render(manifest, capsys) if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--served-model-aliases") + 1] == "bge,legacy"
