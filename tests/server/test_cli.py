"""The ``embedding-server`` command line: flags from the settings model, env vars, and clear
one-line failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from embedding_server.cli import (
    EXIT_BAD_SETTINGS,
    apply_process_env_defaults,
    build_parser,
    load_settings,
)
from embedding_server.engine import Engine
from embedding_server.settings import ServerSettings

from e2e.harness.proc import free_port
from tests.support.models import rewrite_checkpoint

SCRIPT = os.path.join(os.path.dirname(sys.executable), "embedding-server")


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDDING_SERVER_")}
    full_env.update(env or {})
    return subprocess.run(
        [SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=full_env, check=False
    )


def serve_help() -> str:
    sub = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return " ".join(sub.format_help().split())


def test_top_level_help_names_the_serve_and_inspect_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "serve" in result.stdout and "EMBEDDING_SERVER_" in result.stdout
    assert "inspect" in result.stdout


def test_every_setting_is_a_flag_with_its_description_as_help() -> None:
    text = serve_help()
    for name, field in ServerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        assert f"EMBEDDING_SERVER_{name.upper()}" in text
        first_words = " ".join((field.description or "").split()[:4])
        assert first_words in text, (flag, first_words)
    for flag in (
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--dtype",
        "--pooling",
        "--normalize",
        "--no-normalize",
        "--dimensions",
        "--max-model-len",
        "--max-batch-tokens",
        "--max-batch-size",
        "--max-queue-tokens",
        "--api-key",
        "--tensor-parallel-size",
        "--log-level",
        "--log-format",
    ):
        assert flag in text
    assert "--pooling {auto,cls,mean,last,max,weightedmean,mean_sqrt_len}" in text


def test_flags_parse_into_settings_and_win_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDDING_SERVER_PORT", "9001")
    monkeypatch.setenv("EMBEDDING_SERVER_MAX_BATCH_SIZE", "7")
    settings = load_settings(
        [
            "serve",
            "--port",
            "9002",
            "--no-normalize",
            "--matryoshka-dimensions",
            "128, 256",
            "--model",
            "fake",
            "--log-format",
            "json",
            "--pooling",
            "mean_sqrt_len",
        ]
    )
    assert settings.port == 9002  # flag beats env
    assert settings.max_batch_size == 7  # env applies where no flag was given
    assert settings.normalize is False
    assert settings.matryoshka_dimensions == [128, 256]
    assert settings.log_format == "json"
    assert settings.pooling == "mean_sqrt_len"
    assert load_settings(["serve", "--normalize"]).normalize is True
    assert load_settings(["serve"]).normalize is None


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--tensor-parallel-size", "0"], {}, "--tensor-parallel-size"),
        (["--port", "70000"], {}, "--port"),
        (["--dtype", "int4"], {}, "--dtype"),
        ([], {"EMBEDDING_SERVER_MAX_BATCH_TOKENS": "lots"}, "EMBEDDING_SERVER_MAX_BATCH_TOKENS"),
        (["--model", "/no/such/model/dir"], {}, "--model"),
    ],
)
def test_invalid_settings_fail_with_one_line_naming_the_setting(
    args: list[str], env: dict[str, str], named: str
) -> None:
    result = run_cli("serve", *args, env=env)
    assert result.returncode == EXIT_BAD_SETTINGS
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert named in lines[0]
    assert "Traceback" not in result.stderr


def test_failures_do_not_repeat_setting_values_nor_print_the_api_key(tmp_path: Path) -> None:
    # Settings are often fed from Secrets, and these lines land in the pod's log.
    bad = run_cli("serve", env={"EMBEDDING_SERVER_MAX_BATCH_TOKENS": "s3cr3t-value"})
    assert bad.returncode == EXIT_BAD_SETTINGS
    assert "EMBEDDING_SERVER_MAX_BATCH_TOKENS" in bad.stderr and "s3cr3t" not in bad.stderr
    model_dir = tmp_path / "a-model-dir"
    model_dir.mkdir()  # exists, but holds no model
    port = free_port()
    failed = run_cli(
        "serve",
        "--model", str(model_dir),
        "--port", str(port),
        "--log-level", "debug",
        env={"EMBEDDING_SERVER_API_KEY": "s3cr3t-key"},
        timeout=120,
    )  # fmt: skip
    assert failed.returncode == 1
    errors = [line for line in failed.stderr.splitlines() if "cannot serve" in line]
    assert len(errors) == 1 and "config.json" in errors[0], failed.stderr
    # The model is no secret: the line names it. The API key is, and is never printed.
    assert str(model_dir) in errors[0]
    assert "s3cr3t" not in failed.stderr
    settings = load_settings(["serve", "--api-key", "s3cr3t-key"])
    assert "s3cr3t" not in repr(settings) and "s3cr3t" not in str(settings.model_dump())


def test_a_failure_quoting_text_equal_to_a_setting_is_left_as_it_is(tmp_path: Path) -> None:
    # A BLIP checkpoint (no native family) served as "blip": the refusal names its model_type
    # as it is, not as the setting whose value it happens to equal.
    model_dir = tmp_path / "blip"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "blip", "architectures": ["BlipModel"]}')
    port = free_port()
    failed = run_cli(
        "serve",
        "--model", str(model_dir),
        "--served-model-name", "blip",
        "--backend", "native",
        "--port", str(port),
        timeout=120,
    )  # fmt: skip
    assert failed.returncode == 1
    errors = [line for line in failed.stderr.splitlines() if "cannot serve" in line]
    assert len(errors) == 1, failed.stderr
    assert "model_type 'blip'" in errors[0] and "<--" not in errors[0]


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_exits_1_naming_them() -> None:
    port = free_port()
    result = run_cli("serve", "--tensor-parallel-size", "5", "--port", str(port), timeout=120)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "cannot serve" in line]
    assert len(errors) == 1, result.stderr
    assert "tensor_parallel_size 5 does not divide bert num_attention_heads 12" in errors[0]


def test_a_model_that_cannot_load_exits_1_with_one_clear_line() -> None:
    port = free_port()
    result = run_cli("serve", "--model", "fake?bogus=1", "--port", str(port), timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "cannot serve" in line]
    assert len(errors) == 1 and "bogus" in errors[0]


def test_python_dash_m_is_the_same_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "embedding_server", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == EXIT_BAD_SETTINGS
    assert "--port" in result.stderr


def test_openmp_waits_passively_unless_the_user_chose_otherwise() -> None:
    environ: dict[str, str] = {}
    assert apply_process_env_defaults(environ) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert apply_process_env_defaults(chosen) == {}
    assert chosen == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_cli_reaches_serve_without_importing_torch() -> None:
    # OpenMP reads OMP_WAIT_POLICY once, when torch is imported: serve() can only set the
    # default if nothing before it (the CLI module, settings parsing) imported torch.
    code = (
        "import sys; from embedding_server.cli import load_settings; "
        "load_settings(['serve', '--model', 'fake']); print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False", result.stderr


# -- embedding-server inspect ----------------------------------------------------------------


def _field(stdout: str, name: str) -> str:
    """The value of one ``name  value`` line of inspect's text output."""
    for line in stdout.splitlines():
        if line.startswith(name + "  "):
            return line[len(name) :].strip()
    raise AssertionError(f"no {name!r} line in:\n{stdout}")


def test_inspect_prints_what_the_packaged_model_would_be_served_as() -> None:
    result = run_cli("inspect", "--dtype", "float32", "--device", "cpu", timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert _field(out, "architecture") == "BertModel (model_type bert)"
    assert _field(out, "backend") == "native"
    assert _field(out, "task") == "embed"
    assert _field(out, "pooling") == "mean"
    assert _field(out, "normalize") == "yes"
    assert _field(out, "dimensions") == "384"
    assert _field(out, "max input tokens") == "256"
    assert _field(out, "dtype") == "float32"
    assert _field(out, "attention") == "bidirectional; sdpa_bucketed on cpu"
    assert _field(out, "tensors") == "101 read, 3 ignored"
    ignored = [line.strip() for line in out.splitlines() if line.strip().startswith("ignored ")]
    assert any(
        line.startswith("ignored pooler.dense.bias, pooler.dense.weight: ") for line in ignored
    )
    assert any(line.startswith("ignored embeddings.position_ids: ") for line in ignored)
    # What serving the same settings would fingerprint, known before serving.
    with Engine.from_pretrained(dtype="float32", device="cpu") as served:
        assert _field(out, "fingerprint") == served.info().fingerprint


def test_inspect_json_follows_the_settings_given() -> None:
    result = run_cli(
        "inspect",
        "--json",
        "--dtype",
        "float32",
        "--dimensions",
        "128",
        "--max-model-len",
        "64",
        env={"EMBEDDING_SERVER_POOLING": "cls"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert (info["model_type"], info["backend"], info["task"]) == ("bert", "native", "embed")
    assert (info["pooling"], info["dimensions"], info["full_dimensions"]) == ("cls", 128, 384)
    assert info["max_input_tokens"] == 64 and info["attention"] == "sdpa_bucketed"
    assert info["custom_code"] is None and info["causal"] is False
    assert {t["name"] for t in info["tensors_ignored"]} == {
        "embeddings.position_ids",
        "pooler.dense.weight",
        "pooler.dense.bias",
    }
    assert all(t["reason"] for t in info["tensors_ignored"])


def test_inspect_exits_1_with_the_refusal_for_a_model_that_would_not_serve(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    path = rewrite_checkpoint(
        tiny_model("bert"),
        tmp_path / "made-up",
        config={"model_type": "made_up", "architectures": ["MadeUpModel"]},
    )
    result = run_cli("inspect", "--model", str(path), timeout=120)
    assert result.returncode == 1
    assert result.stdout == "" and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "cannot serve" in line]
    assert str(path) in line and "model_type 'made_up' (MadeUpModel)" in line
    assert "transformers" in line and "does not know it" in line
    # A config transformers itself rejects (a BERT checkpoint relabelled t5) is a refusal
    # naming what is wrong, not a traceback.
    relabelled = rewrite_checkpoint(
        tiny_model("bert"),
        tmp_path / "t5",
        config={"model_type": "t5", "architectures": ["T5EncoderModel"]},
    )
    result = run_cli("inspect", "--model", str(relabelled), timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "classifier_dropout" in result.stderr
    bad = run_cli("inspect", "--max-batch-size", "0")
    assert bad.returncode == EXIT_BAD_SETTINGS and "--max-batch-size" in bad.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ([], "--discovery static needs --routes or --routes-file"),
        (
            ["--routes", "m=http://a:1", "--poll-interval", "0"],
            "--poll-interval / EMBEDDING_GATEWAY_POLL_INTERVAL",
        ),
        (["--routes", "m=not-a-url"], "--routes: 'not-a-url' is not an http(s) URL"),
        (
            ["--routes", "m=http://a:1", "--hold-timeout", "-1"],
            "--hold-timeout / EMBEDDING_GATEWAY_HOLD_TIMEOUT: Input should be greater than or "
            "equal to 0",
        ),
        # Milliseconds given for seconds, and a hold that never ends, are refused.
        (
            ["--routes", "m=http://a:1", "--hold-timeout", "300000"],
            "--hold-timeout / EMBEDDING_GATEWAY_HOLD_TIMEOUT: Input should be less than or "
            "equal to 3600",
        ),
        (
            ["--routes", "m=http://a:1", "--hold-timeout", "inf"],
            "--hold-timeout / EMBEDDING_GATEWAY_HOLD_TIMEOUT: Input should be less than or "
            "equal to 3600",
        ),
        (
            ["--routes", "m=http://a:1", "--request-timeout", "0"],
            "--request-timeout / EMBEDDING_GATEWAY_REQUEST_TIMEOUT: Input should be greater than 0",
        ),
    ],
)
def test_the_gateway_refuses_bad_settings_with_one_line(args: list[str], named: str) -> None:
    result = run_cli("gateway", *args)
    assert result.returncode == EXIT_BAD_SETTINGS, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_the_gateway_starts_without_importing_torch() -> None:
    # The gateway image-less mode: its whole import graph, discovery and proxy included.
    code = (
        "import sys, embedding_server.cli, embedding_server.gateway.server, "
        "embedding_server.gateway.kubernetes; print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"


def test_list_settings_read_comma_separated_environment_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every list setting's variable is comma-separated, as its flag and help say (not a
    JSON list): the operator and users set them as env as often as flags."""
    from embedding_server.gateway.settings import GatewaySettings

    monkeypatch.setenv(
        "EMBEDDING_SERVER_ALLOWED_MEDIA_DOMAINS", "images.example.com, *.cdn.example"
    )
    monkeypatch.setenv("EMBEDDING_SERVER_ALLOWED_HOSTS", "localhost,embed.example")
    monkeypatch.setenv("EMBEDDING_SERVER_BULK_ROUTES", "/v1/embeddings")
    settings = load_settings(["serve"])
    assert settings.allowed_media_domains == ["images.example.com", "*.cdn.example"]
    assert settings.allowed_hosts == ["localhost", "embed.example"]
    assert settings.bulk_routes == ["/v1/embeddings"]
    monkeypatch.setenv("EMBEDDING_GATEWAY_ROUTES", "a=http://10.0.0.1:8000,a=http://10.0.0.2:8000")
    monkeypatch.setenv("EMBEDDING_GATEWAY_BULK_ROUTES", "/v1/embeddings,/rerank")
    gateway = GatewaySettings()
    assert gateway.routes == ["a=http://10.0.0.1:8000", "a=http://10.0.0.2:8000"]
    assert gateway.bulk_routes == ["/v1/embeddings", "/rerank"]
