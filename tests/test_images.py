"""Static checks of the container build files (no Docker engine here, so nothing is built).

What can go wrong without anyone noticing until a pod crash-loops in a real cluster: an
ENTRYPOINT naming a console script that pyproject no longer declares, an image that runs as
root, a chart whose default image is not the one the Dockerfile documents, or an operator that
renders a container command the server image does not have. Each test pins one of those.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
CHART = ROOT / "charts" / "embedding-operator"
SERVER_DOCKERFILE = IMAGES / "server.Dockerfile"
OPERATOR_DOCKERFILE = IMAGES / "operator.Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str

    def exec_form(self) -> list[str]:
        """ENTRYPOINT/CMD in JSON (exec) form; shell form would wrap the process in sh -c."""
        parsed = json.loads(self.value)
        assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed), self
        return parsed


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions in order, continuation lines joined, comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued RUN
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, value = full.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    starts = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    return instructions[starts[-1] :]


def last(instructions: list[Instruction], keyword: str) -> Instruction:
    matches = [ins for ins in instructions if ins.keyword == keyword]
    assert matches, f"no {keyword} instruction"
    return matches[-1]


def env_of(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            for token in shlex.split(ins.value):
                key, sep, value = token.partition("=")
                assert sep, f"use ENV KEY=VALUE form: {ins.value}"
                env[key] = value
    return env


def documented_tags(path: Path) -> list[str]:
    """The image references in the `docker build ... -t <image>` lines of the header."""
    return re.findall(r"docker build [^\n]*?-t (\S+)", path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(pyproject["project"]["scripts"])


@pytest.fixture(scope="module")
def extras() -> dict[str, list[str]]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(pyproject["project"]["optional-dependencies"])


@pytest.fixture(scope="module")
def chart() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8")))


@pytest.mark.parametrize(
    ("dockerfile", "script"),
    [(SERVER_DOCKERFILE, "embedding-server"), (OPERATOR_DOCKERFILE, "embedding-operator")],
)
def test_entrypoint_is_a_declared_console_script(
    dockerfile: Path, script: str, scripts: dict[str, str]
) -> None:
    stage = final_stage(parse_dockerfile(dockerfile))
    assert last(stage, "ENTRYPOINT").exec_form() == [script]
    assert script in scripts, f"pyproject declares no console script {script!r}"


@pytest.mark.parametrize("dockerfile", [SERVER_DOCKERFILE, OPERATOR_DOCKERFILE])
def test_runs_as_non_root_uid_1000(dockerfile: Path) -> None:
    stage = final_stage(parse_dockerfile(dockerfile))
    user = last(stage, "USER").value
    assert user.split(":")[0] == "1000", f"{dockerfile.name}: USER {user}"
    # The uid exists in the image (a numeric USER without an account breaks `getpass`, HOME).
    runs = " ".join(ins.value for ins in stage if ins.keyword == "RUN")
    assert re.search(r"useradd [^;&]*--uid 1000", runs), "no account with uid 1000 is created"


@pytest.mark.parametrize("dockerfile", [SERVER_DOCKERFILE, OPERATOR_DOCKERFILE])
def test_copied_sources_exist_and_are_not_dockerignored(dockerfile: Path) -> None:
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text(encoding="utf-8")
    allowed = {line[1:].rstrip("/") for line in ignore.splitlines() if line.startswith("!")}
    for ins in parse_dockerfile(dockerfile):
        if ins.keyword != "COPY" or "--from=" in ins.value:
            continue
        *sources, _dest = ins.value.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
            assert source.rstrip("/") in allowed, f"{source} is excluded by the .dockerignore"


def test_server_image_contract(scripts: dict[str, str], extras: dict[str, list[str]]) -> None:
    from embedding_operator.builders.common import SERVER_PORT

    instructions = parse_dockerfile(SERVER_DOCKERFILE)
    stage = final_stage(instructions)
    assert last(instructions, "FROM").value.startswith("nvidia/cuda:")
    assert "-runtime-" in last(instructions, "FROM").value, "the final stage: the slim runtime"
    env = env_of(stage)
    assert env["HF_HOME"] == "/models", "the Hugging Face cache must live on /models"
    runs = " ".join(ins.value for ins in stage if ins.keyword == "RUN")
    assert "chown 1000:1000 /models" in runs, "/models must be writable by the server user"
    cmd = last(stage, "CMD").exec_form()
    assert cmd[0] == "serve"
    # Defaults that make `docker run -p 8000:8000 <image>` reachable.
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert int(cmd[cmd.index("--port") + 1]) == SERVER_PORT
    assert int(last(stage, "EXPOSE").value) == SERVER_PORT
    # The optional flash-attn build installs the extra that pyproject declares for it.
    assert any(ins.keyword == "ARG" and ins.value.startswith("FLASH_ATTN=") for ins in instructions)
    assert any("flash-attn" in dep or "flash_attn" in dep for dep in extras["gpu"])
    assert any('".[gpu]"' in ins.value for ins in instructions if ins.keyword == "RUN")


def test_operator_image_contract(values: dict[str, Any]) -> None:
    instructions = parse_dockerfile(OPERATOR_DOCKERFILE)
    assert instructions[0].value == "python:3.11-slim"
    assert last(instructions, "CMD").exec_form() == ["run"]
    assert int(last(instructions, "EXPOSE").value) == values["operator"]["healthPort"]


def test_operator_renders_the_server_images_entrypoint() -> None:
    """The Deployment the operator builds must start the program the server image has."""
    from embedding_operator.builders.common import Owner, RenderInput
    from embedding_operator.builders.deployment import build_deployment
    from embedding_operator.profiles import GpuProfiles
    from embedding_operator.spec import parse_spec

    render = RenderInput(
        owner=Owner(name="probe", namespace="default", uid="u"),
        spec=parse_spec({"model": {"name": "BAAI/bge-small-en-v1.5"}}),
        profile=GpuProfiles.builtin().resolve("cpu"),
    )
    container = build_deployment(render)["spec"]["template"]["spec"]["containers"][0]
    entrypoint = last(final_stage(parse_dockerfile(SERVER_DOCKERFILE)), "ENTRYPOINT")
    assert container["command"] == entrypoint.exec_form()
    assert container["args"][0] == "serve"
    # The operator runs the pod as uid 1000, the user the image creates and owns /models for.
    pod = build_deployment(render)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 1000


def test_chart_default_images_are_the_documented_builds(
    chart: dict[str, Any], values: dict[str, Any]
) -> None:
    from embedding_operator.builders.common import DEFAULT_IMAGE

    tag = values["image"]["tag"] or chart["appVersion"]
    operator_image = f"{values['image']['repository']}:{tag}"
    server_tag = values["serverImage"]["tag"] or chart["appVersion"]
    server_image = f"{values['serverImage']['repository']}:{server_tag}"
    assert operator_image in documented_tags(OPERATOR_DOCKERFILE)
    assert server_image in documented_tags(SERVER_DOCKERFILE)
    # Without the chart (`embedding-operator run` on a laptop) the operator's own default is
    # the same server image.
    assert server_image == DEFAULT_IMAGE


def test_chart_starts_the_operator_images_command(values: dict[str, Any]) -> None:
    template = (CHART / "templates" / "deployment.yaml").read_text(encoding="utf-8")
    assert 'args: ["run"]' in template
    assert "command:" not in template, "the chart must use the image's ENTRYPOINT"
    assert last(parse_dockerfile(OPERATOR_DOCKERFILE), "CMD").exec_form() == ["run"]
