"""Static checks of the container build files and of e2e.harness.images (nothing is built).

What can go wrong without anyone noticing until a pod crash-loops in a real cluster: an
ENTRYPOINT naming a console script that pyproject no longer declares, an image that runs as
root, a chart whose default image is not the one the Dockerfile documents, an operator that
renders a container command the server image does not have, a lock that no longer satisfies
pyproject, or the CUDA variant (which cannot be built here) losing its flash-attn stage. Each
test pins one of those; `make images` builds them for real.
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

from e2e.harness import images as image_builder

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


def stages(instructions: list[Instruction]) -> dict[str, list[Instruction]]:
    """Stage name (`AS name`, else its index) -> its instructions, FROM first."""
    named: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for ins in instructions:
        if ins.keyword == "FROM":
            parts = ins.value.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(named))
            current = named.setdefault(name, [])
        if current is not None:
            current.append(ins)
    return named


def bind_mounts(ins: Instruction) -> list[dict[str, str]]:
    """The `--mount=type=bind,...` options of a RUN, as dicts."""
    mounts = []
    for option in re.findall(r"--mount=(\S+)", ins.value):
        fields = dict(item.partition("=")[::2] for item in option.split(","))
        if fields.get("type") == "bind":
            mounts.append(fields)
    return mounts


@pytest.mark.parametrize(
    ("dockerfile", "entries"),
    [
        (SERVER_DOCKERFILE, image_builder.SERVER_CONTEXT_ENTRIES),
        (OPERATOR_DOCKERFILE, image_builder.CONTEXT_ENTRIES),
    ],
)
def test_context_entries_are_what_images_py_stages(
    dockerfile: Path, entries: tuple[str, ...]
) -> None:
    """Every bind-mounted or copied context path is staged by e2e.harness.images and not ignored."""
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text(encoding="utf-8")
    allowed = {line[1:].rstrip("/") for line in ignore.splitlines() if line.startswith("!")}
    assert allowed == set(entries)
    used: set[str] = set()
    for ins in parse_dockerfile(dockerfile):
        if ins.keyword == "COPY" and "--from=" not in ins.value:
            used.update(ins.value.split()[:-1])
        if ins.keyword == "RUN":
            used.update(m["source"] for m in bind_mounts(ins) if "from" not in m)
    assert used, f"{dockerfile.name} takes nothing from its context"
    assert used <= allowed, f"{sorted(used - allowed)} are not staged / are dockerignored"


@pytest.mark.parametrize("dockerfile", [SERVER_DOCKERFILE, OPERATOR_DOCKERFILE])
def test_base_image_is_a_build_arg_defaulting_to_bookworm_slim(dockerfile: Path) -> None:
    """Registry users build as is; e2e.harness.images passes its debootstrapped base instead."""
    text = dockerfile.read_text(encoding="utf-8")
    # A `# syntax=` line makes BuildKit pull a frontend image from a registry.
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE)
    instructions = parse_dockerfile(dockerfile)
    assert instructions[0] == Instruction("ARG", "BASE_IMAGE=debian:bookworm-slim")
    froms = [ins.value.split()[0] for ins in instructions if ins.keyword == "FROM"]
    named = set(stages(instructions))
    # Every stage starts from the base, from a stage of the file (for any VARIANT and
    # TORCH_SOURCE) or from scratch (the empty image, never pulled): no other image is pulled.
    external = {
        ref
        for ref in froms
        for variant in ("cpu", "cuda")
        for source in image_builder.TORCH_SOURCES
        if ref.replace("${VARIANT}", variant).replace("${TORCH_SOURCE}", source) not in named
    }
    assert external - {"scratch"} == {"${BASE_IMAGE}"}, external


@pytest.mark.parametrize("dockerfile", [SERVER_DOCKERFILE, OPERATOR_DOCKERFILE])
def test_dependencies_come_only_from_the_locked_wheels(dockerfile: Path) -> None:
    """pip never reaches an index in the runtime stages, and the lock constrains every step."""
    runtime_stages = [
        s for name, s in stages(parse_dockerfile(dockerfile)).items() if name != "extras-cuda"
    ]
    installs = [
        ins
        for stage in runtime_stages
        for ins in stage
        if ins.keyword == "RUN" and "pip install" in ins.value
    ]
    assert len(installs) >= 2, "a dependency layer, then the package layer"
    for ins in installs:
        assert "--no-index" in ins.value, ins.value
        assert "-r /ctx/requirements.lock" in ins.value or "-c /ctx/requirements.lock" in ins.value
    # The dependency layer comes first and binds only the lock and the wheels (not our wheel),
    # so a code change rebuilds only the package layer. The server's lock comes from the stage
    # its TORCH_SOURCE picks (test_torch_source_is_a_build_arg_that_picks_the_lock).
    lock = (
        ("lock", "/requirements.lock")
        if dockerfile == SERVER_DOCKERFILE
        else (None, "requirements.lock")
    )
    assert {(m.get("from"), m["source"]) for m in bind_mounts(installs[0])} == {
        lock,
        (None, "wheels"),
    }


@pytest.mark.parametrize("image", ["server", "operator"])
def test_lock_pins_every_dependency_of_the_extra(image: str, extras: dict[str, list[str]]) -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    pins = image_builder.read_lock(image_builder.LOCKS[image])
    for line in [*pyproject["project"]["dependencies"], *extras[image]]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"images/{image}.lock does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (line, pins[name])
    if image == "operator":
        assert "torch" not in pins, "the operator image carries no torch"
    else:
        assert "torch" in pins


def test_server_image_contract(scripts: dict[str, str], extras: dict[str, list[str]]) -> None:
    from embedding_operator.builders.common import SERVER_PORT

    instructions = parse_dockerfile(SERVER_DOCKERFILE)
    stage = final_stage(instructions)
    named = stages(instructions)
    assert stage[0].value == "python AS runtime", "the runtime starts from the python stage"
    assert named["python"][0].value == "${BASE_IMAGE} AS python"
    env = env_of(stage)
    assert env["HF_HOME"] == "/models", "the Hugging Face cache must live on /models"
    assert env_of(named["python"])["PATH"].startswith("/opt/venv/bin:")
    runs = " ".join(ins.value for ins in stage if ins.keyword == "RUN")
    assert "chown 1000:1000 /models" in runs, "/models must be writable by the server user"
    cmd = last(stage, "CMD").exec_form()
    assert cmd[0] == "serve"
    # Defaults that make `docker run -p 8000:8000 <image>` reachable.
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert int(cmd[cmd.index("--port") + 1]) == SERVER_PORT
    assert int(last(stage, "EXPOSE").value) == SERVER_PORT
    assert "embedding-operator[${extra}]" in runs and "extra=server," in runs


def test_cuda_variant_builds_flash_attn_in_a_stage_of_its_own(extras: dict[str, list[str]]) -> None:
    """The CUDA path cannot be built here: pin its shape so it does not rot unnoticed."""
    from packaging.requirements import Requirement

    instructions = parse_dockerfile(SERVER_DOCKERFILE)
    named = stages(instructions)
    assert Instruction("ARG", "VARIANT=cpu") in instructions
    assert named["extras"][0].value == "extras-${VARIANT} AS extras"
    assert {"extras-cpu", "extras-cuda"} <= set(named)
    cuda = named["extras-cuda"]
    cuda_runs = " ".join(ins.value for ins in cuda if ins.keyword == "RUN")
    assert "cuda-minimal-build-${CUDA_VERSION}" in cuda_runs, "nvcc comes with this stage only"
    assert "pip wheel --no-build-isolation" in cuda_runs and '"flash-attn==' in cuda_runs
    # The pinned flash-attn satisfies the `gpu` extra that the runtime stage then installs.
    version = next(
        i.value for i in cuda if i.keyword == "ARG" and i.value.startswith("FLASH_ATTN_VERSION=")
    )
    gpu = [Requirement(dep) for dep in extras["gpu"]]
    flash = next(r for r in gpu if r.name.replace("_", "-") == "flash-attn")
    assert flash.specifier.contains(version.partition("=")[2])
    runtime = final_stage(instructions)
    extra_runs = [ins for ins in runtime if ins.keyword == "RUN" and "server,gpu" in ins.value]
    assert extra_runs, "VARIANT=cuda must install the `gpu` extra"
    assert any(m.get("from") == "extras" for m in bind_mounts(extra_runs[0]))
    # The toolchain stage never becomes a layer of the runtime image.
    assert all("extras" not in ins.value for ins in runtime if ins.keyword == "FROM")
    # torch's CUDA release and the nvcc of that stage must agree: torch comes from the lock.
    cuda_arg = next(
        i.value for i in cuda if i.keyword == "ARG" and i.value.startswith("CUDA_VERSION=")
    )
    assert re.fullmatch(r"CUDA_VERSION=\d+-\d+", cuda_arg)
    # flash-attn 2 runs on sm80+ only: the archs compiled in say so, and it is compiled, never
    # fetched prebuilt for some other torch.
    archs = next(
        i.value for i in cuda if i.keyword == "ARG" and i.value.startswith("FLASH_ATTN_CUDA_ARCHS=")
    )
    compiled = [int(a) for a in archs.partition("=")[2].strip('"').split(";")]
    assert compiled and min(compiled) >= 80
    cuda_env = " ".join(i.value for i in cuda if i.keyword == "ENV")
    assert "FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS}" in cuda_env
    assert "FLASH_ATTENTION_FORCE_BUILD=TRUE" in cuda_env
    # A flash-attn that does not load with the image's torch fails the build, not the pod.
    assert "import flash_attn, flash_attn_2_cuda" in extra_runs[0].value


def test_server_image_keeps_its_torch_and_its_gpu_memory_in_shape() -> None:
    """torch's pin outlives the build (so nothing installed later swaps it from under
    flash-attn), and the CUDA allocator grows segments instead of fragmenting."""
    runtime = final_stage(parse_dockerfile(SERVER_DOCKERFILE))
    runs = " ".join(i.value for i in runtime if i.keyword == "RUN")
    env = " ".join(i.value for i in runtime if i.keyword == "ENV")
    assert "grep -E '^torch==' /ctx/requirements.lock > /etc/pip-constraints.txt" in runs
    assert "PIP_CONSTRAINT=/etc/pip-constraints.txt" in env
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env
    lock = (IMAGES / "server.lock").read_text(encoding="utf-8")
    assert re.search(r"^torch==[\d.]+$", lock, re.MULTILINE), "the lock pins torch exactly"


def test_pause_image_is_a_static_program_from_scratch() -> None:
    source = (IMAGES / "pause" / "pause.c").read_text(encoding="utf-8")
    for needle in ("SIGTERM", "SIGINT", "SIGCHLD", "waitpid", "pause();"):
        assert needle in source
    instructions = parse_dockerfile(IMAGES / "pause.Dockerfile")
    assert instructions[0] == Instruction("FROM", "scratch")
    assert last(instructions, "ENTRYPOINT").exec_form() == ["/pause"]
    assert image_builder.PAUSE_IMAGE in documented_tags(IMAGES / "pause.Dockerfile")


def test_images_py_tags_are_the_chart_defaults(
    chart: dict[str, Any], values: dict[str, Any]
) -> None:
    refs = image_builder.image_refs()
    assert refs.server == f"{values['serverImage']['repository']}:{chart['appVersion']}"
    assert refs.operator == f"{values['image']['repository']}:{chart['appVersion']}"
    assert refs.server in documented_tags(SERVER_DOCKERFILE)
    assert refs.operator in documented_tags(OPERATOR_DOCKERFILE)


def test_apt_mirror_is_read_from_the_machines_sources(tmp_path: Path) -> None:
    sources = tmp_path / "sources.list.d"
    sources.mkdir()
    (sources / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian/\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    missing = tmp_path / "sources.list"
    assert image_builder.apt_mirror(sources, missing) == "http://mirror.example/debian"
    legacy = tmp_path / "legacy.list"
    legacy.write_text("deb [arch=amd64 signed-by=/k.gpg] http://old.example/debian bookworm main\n")
    assert image_builder.apt_mirror(tmp_path / "none", legacy) == "http://old.example/debian"
    with pytest.raises(image_builder.ImageError, match="bookworm"):
        image_builder.apt_mirror(tmp_path / "none", missing)


def test_operator_image_contract(values: dict[str, Any]) -> None:
    instructions = parse_dockerfile(OPERATOR_DOCKERFILE)
    assert last(instructions, "FROM").value == "${BASE_IMAGE}"
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


def test_e2e_client_image_is_the_server_image_plus_openai() -> None:
    """The e2e client pods run the official openai client at the version the tests pin, on
    top of the server image, and not as root."""
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    wanted = next(
        Requirement(r)
        for r in pyproject["project"]["optional-dependencies"]["test"]
        if Requirement(r).name == "openai"
    )
    pins = image_builder.read_lock(image_builder.LOCKS["e2e-client"])
    assert wanted.specifier.contains(pins["openai"]), pins["openai"]
    instructions = parse_dockerfile(image_builder.CLIENT_DOCKERFILE)
    assert last(instructions, "FROM").value == "${SERVER_IMAGE}"
    assert last(instructions, "USER").value == "1000:1000"
    refs = image_builder.image_refs()
    assert refs.client.split(":")[-1] == refs.server.split(":")[-1]


def test_image_id_refs_of_replaced_images_are_dropped_and_current_ones_kept() -> None:
    """A rebuilt server image takes its tag over; the CRI's image-ID ref of the old one must
    go, or every code change leaves 6 GB behind in the node's cached store."""
    old, new, pause = ("sha256:" + c * 64 for c in "abc")
    listing = "\n".join(
        [
            "REF TYPE DIGEST SIZE PLATFORMS LABELS",
            f"ghcr.io/embedding-operator/embedding-server:0.1.0 application/tar {new} 6.0 GiB "
            "linux/amd64 -",
            f"registry.k8s.io/pause:3.10 application/tar {pause} 700 KiB linux/amd64 -",
            f"sha256:{'1' * 64} application/tar {old} 6.0 GiB linux/amd64 io.cri=managed",
            f"sha256:{'2' * 64} application/tar {new} 6.0 GiB linux/amd64 io.cri=managed",
            f"sha256:{'3' * 64} application/tar {pause} 700 KiB linux/amd64 io.cri=managed",
        ]
    )
    assert image_builder.stale_refs(listing) == [f"sha256:{'1' * 64}"]


def test_only_complete_unpacked_images_count_as_already_loaded() -> None:
    """An image whose snapshots the store lost must be imported again, not trusted: a pod
    could not start from it (`ctr images check -q` lists it all the same)."""
    server = "ghcr.io/embedding-operator/embedding-server:0.1.0"
    digest = "sha256:" + "d" * 64
    kind = "application/vnd.docker.distribution.manifest.v2+json"
    listing = "\n".join(
        [
            "REF TYPE DIGEST STATUS SIZE UNPACKED",
            f"{server} {kind} {digest} complete (9/9) 6.0 GiB/6.0 GiB true",
            f"ghcr.io/embedding-operator/embedding-operator:0.1.0 {kind} {digest} complete (5/5) "
            "350.1 MiB/350.1 MiB false",
            f"registry.k8s.io/pause:3.10 {kind} {digest} incomplete (1/2) 1.0 KiB/700.0 KiB true",
        ]
    )
    assert image_builder.ready_refs(listing) == {server}


def test_an_image_built_on_another_counts_only_its_own_layers() -> None:
    """The load's disk check must see the e2e client as the server plus one layer: counted
    whole, the pair looks 13 GB large and would evict the node's images for nothing."""
    server = ["sha256:base", "sha256:python", "sha256:torch", "sha256:wheel"]
    images = {
        "server": (server, 6_000),
        "client": ([*server, "sha256:openai"], 6_020),
        "operator": (["sha256:base", "sha256:kopf"], 370),
        "other-server": (["sha256:base", "sha256:python", "sha256:torch2"], 5_900),
    }
    assert image_builder.distinct_sizes(images) == {
        "server": 6_000,
        "client": 20,
        # Sharing the base is not being built on a wanted image: only whole prefixes count.
        "operator": 370,
        "other-server": 5_900,
    }


def test_a_load_short_of_disk_drops_the_build_caches_before_it_gives_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """CI's cache outlives runs: after the server lock changed, the old 6 GB dependency layer
    stayed in the build cache and the next load failed 0.5 GB short. What a later run can
    rebuild (docker's build cache, our Go caches) must go before the load fails, and the
    load must still fail, naming the store, when that is not enough."""
    from e2e.harness.images import store

    gb = 1_000_000_000
    free = {"bytes": 14 * gb}
    calls: list[tuple[str, ...]] = []

    class FakeDocker:
        def run(self, *args: str, timeout: float = 0, what: str | None = None) -> Any:
            calls.append(args)
            if args[:2] == ("image", "inspect"):
                return type("Proc", (), {"stdout": '["sha256:a"] 6400000000'})()
            if args[:2] == ("builder", "prune"):
                free["bytes"] += 4 * gb
            return type("Proc", (), {"stdout": ""})()

    def go_caches() -> None:
        calls.append(("go", "clean"))
        free["bytes"] += reclaimed_by_go

    def disk_usage(path: Path) -> Any:
        return type("Usage", (), {"free": free["bytes"]})()

    monkeypatch.setattr(store, "drop_go_caches", go_caches)
    monkeypatch.setattr(store.shutil, "disk_usage", disk_usage)
    wanted = {"server:1": "sha256:new"}

    reclaimed_by_go = 0
    store._make_room(tmp_path / "sock", tmp_path, wanted, set(), FakeDocker())  # type: ignore[arg-type]
    assert ("builder", "prune", "--all", "--force") in calls
    assert ("go", "clean") in calls

    free["bytes"] = 6 * gb
    with pytest.raises(image_builder.ImageError, match=str(tmp_path)):
        store._make_room(tmp_path / "sock", tmp_path, wanted, set(), FakeDocker())  # type: ignore[arg-type]


# --- the server image's torch source (TORCH_SOURCE: pypi | cpu) ---------------------------------


def test_torch_source_is_a_build_arg_that_picks_the_lock() -> None:
    """TORCH_SOURCE (default pypi, so CI never depends on download.pytorch.org) decides which
    lock every pip step of the server image reads, and a CPU image with CUDA in it, or a CUDA
    variant on the CPU torch, fails the build rather than a pod."""
    instructions = parse_dockerfile(SERVER_DOCKERFILE)
    first_from = next(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    assert Instruction("ARG", "TORCH_SOURCE=pypi") in instructions[:first_from]
    named = stages(instructions)
    assert named["lock"][0].value == "lock-${TORCH_SOURCE} AS lock"
    for source in image_builder.TORCH_SOURCES:
        stage = named[f"lock-{source}"]
        assert stage[0].value == f"scratch AS lock-{source}"
        context_lock = image_builder.SERVER_CONTEXT_LOCKS[source]
        assert Instruction("COPY", f"{context_lock} /requirements.lock") in stage
    assert image_builder.SERVER_LOCKS["pypi"] == image_builder.LOCKS["server"]
    # Every step that reads a lock reads the picked one, never the context's directly.
    for ins in instructions:
        if ins.keyword != "RUN" or "/ctx/requirements.lock" not in ins.value:
            continue
        locks = [m for m in bind_mounts(ins) if m["target"] == "/ctx/requirements.lock"]
        assert locks == [
            {
                "type": "bind",
                "from": "lock",
                "source": "/requirements.lock",
                "target": "/ctx/requirements.lock",
            }
        ], ins.value
    runtime = final_stage(instructions)
    assert Instruction("ARG", "TORCH_SOURCE") in runtime
    dependencies = next(
        i for i in runtime if i.keyword == "RUN" and "-r /ctx/requirements" in i.value
    )
    assert '"${TORCH_SOURCE}" = cpu' in dependencies.value
    assert "assert torch.version.cuda is None and not cuda" in dependencies.value
    cuda = named["extras-cuda"]
    first_run = next(i for i in cuda if i.keyword == "RUN")
    assert '"${TORCH_SOURCE}" != pypi' in first_run.value and "exit 1" in first_run.value
    # The header documents the CPU build.
    assert "--build-arg TORCH_SOURCE=cpu" in SERVER_DOCKERFILE.read_text(encoding="utf-8")


def test_cpu_lock_asks_pip_for_the_same_torch_release_from_the_cpu_index(
    extras: dict[str, list[str]],
) -> None:
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    pins = image_builder.read_lock(image_builder.LOCKS["server"])
    requirements, constraints = image_builder.cpu_requirements(pyproject, pins)
    wanted = {Requirement(r).name: r for r in requirements}
    assert wanted["torch"] == f"torch=={pins['torch']}+cpu"
    others = [*pyproject["project"]["dependencies"], *extras["server"]]
    assert {Requirement(r).name for r in others} == set(wanted)
    assert all(r in requirements for r in others if Requirement(r).name != "torch")
    # Everything else stays at the PyPI lock's versions where it is still needed.
    assert f"numpy=={pins['numpy']}" in constraints
    assert not any(c.startswith("torch==") for c in constraints)


def test_cpu_lock_is_what_pip_reports_and_holds_no_cuda() -> None:
    report = {
        "install": [
            {"metadata": {"name": "torch", "version": "2.15.0+cpu"}},
            {"metadata": {"name": "numpy", "version": "2.4.6"}},
            {"metadata": {"name": "Jinja2", "version": "3.1.6"}},
        ]
    }
    pins = image_builder.pins_from_report(report)
    assert list(pins.items()) == [
        ("Jinja2", "3.1.6"),
        ("numpy", "2.4.6"),
        ("torch", "2.15.0+cpu"),
    ]
    image_builder.check_cpu_lock(pins)
    with pytest.raises(image_builder.ImageError, match="nvidia-cublas"):
        image_builder.check_cpu_lock({**pins, "nvidia-cublas": "13.4.1.3"})
    with pytest.raises(image_builder.ImageError, match="triton"):
        image_builder.check_cpu_lock({**pins, "triton": "3.9.0"})
    with pytest.raises(image_builder.ImageError, match=r"\+cpu torch"):
        image_builder.check_cpu_lock({**pins, "torch": "2.15.0"})


def test_a_cpu_context_holds_the_cpu_lock_and_wheels_from_the_cpu_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staged for TORCH_SOURCE=cpu, the server's context holds requirements.cpu.lock (and not
    a PyPI lock left from an earlier build) and wheels pip downloaded with PyTorch's CPU index
    beside its own; staged for pypi, the reverse, with pip's index alone."""
    from e2e.harness.images import wheels

    cpu_lock = tmp_path / "server.cpu.lock"
    cpu_lock.write_text("# a test lock\ntorch==2.15.0+cpu\nnumpy==2.4.6\n")
    monkeypatch.setitem(image_builder.SERVER_LOCKS, "cpu", cpu_lock)
    monkeypatch.setattr(wheels, "images_cache", lambda: tmp_path / "cache")
    downloads: list[list[str]] = []

    def fake_pip(argv: list[str], *args: Any, **kwargs: Any) -> None:
        downloads.append(list(argv))
        directory = Path(argv[argv.index("-d") + 1])
        for line in Path(argv[argv.index("-r") + 1]).read_text().split():
            name, version = line.split("==")
            wheel = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
            (directory / wheel).write_bytes(b"")

    monkeypatch.setattr(wheels, "run", fake_pip)
    project = tmp_path / "embedding_operator-0.1.0-py3-none-any.whl"
    project.write_bytes(b"wheel")
    context = image_builder.prepare_context(
        "server", project, tmp_path / "wheels", torch_source="cpu"
    )
    assert (context / "requirements.cpu.lock").read_text() == cpu_lock.read_text()
    assert not (context / "requirements.lock").exists()
    assert sorted(p.name for p in (context / "wheels").iterdir()) == [
        "numpy-2.4.6-py3-none-any.whl",
        "torch-2.15.0+cpu-py3-none-any.whl",
    ]
    (argv,) = downloads
    assert argv[argv.index("--extra-index-url") + 1] == image_builder.CPU_TORCH_INDEX
    # Back to PyPI's torch: its lock replaces the CPU one, and pip uses its own index only.
    context = image_builder.prepare_context("server", project, tmp_path / "wheels")
    assert (context / "requirements.lock").read_text() == image_builder.LOCKS["server"].read_text()
    assert not (context / "requirements.cpu.lock").exists()
    assert "--extra-index-url" not in downloads[-1]


def test_a_missing_cpu_lock_says_how_to_write_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(image_builder.SERVER_LOCKS, "cpu", tmp_path / "server.cpu.lock")
    with pytest.raises(image_builder.ImageError, match="lock --torch-source cpu") as missing:
        image_builder.server_lock("cpu")
    assert image_builder.CPU_TORCH_INDEX in str(missing.value)
    lock, index = image_builder.server_lock("pypi")
    assert lock == image_builder.LOCKS["server"] and index is None


def test_a_committed_cpu_lock_serves_the_extra_without_cuda(extras: dict[str, list[str]]) -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    path = image_builder.SERVER_LOCKS["cpu"]
    if not path.is_file():
        pytest.skip(
            f"{path.name} is not committed: download.pytorch.org was unreachable where the "
            "CPU variant was added (`python -m e2e.harness.images lock --torch-source cpu`)"
        )
    pins = image_builder.read_lock(path)
    image_builder.check_cpu_lock(pins)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for line in [*pyproject["project"]["dependencies"], *extras["server"]]:
        req = Requirement(line)
        assert canonicalize_name(req.name) in pins, f"{path.name} does not pin {req.name}"


def test_the_operator_image_holds_every_package_the_operator_imports() -> None:
    """The operator image installs only its lock: a module imported from a distribution the
    lock does not pin (prometheus_client, once) passes every test run from the dev venv and
    crash-loops the chart's operator pod with ModuleNotFoundError."""
    import ast
    import importlib.metadata
    import sys

    from packaging.utils import canonicalize_name

    pins = image_builder.read_lock(image_builder.LOCKS["operator"])
    distributions = importlib.metadata.packages_distributions()
    missing: dict[str, str] = {}
    for path in sorted((ROOT / "operator" / "embedding_operator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "embedding_operator":
                    continue
                owners = {canonicalize_name(d) for d in distributions.get(top, [])}
                if not owners & pins.keys():
                    missing[top] = str(path.relative_to(ROOT))
    assert not missing, f"imported by the operator, not in images/operator.lock: {missing}"


def test_a_dockerd_slow_to_answer_its_first_probe_is_waited_for_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dockerd opens its socket before it can answer; a probe that times out is "not yet".

    CI once failed every e2e test because the first `docker version` waited past 10 s."""
    from e2e.harness.images import dockerd

    marker = tmp_path / "answered-once"
    client = tmp_path / "docker"
    client.write_text(
        "#!/bin/sh\n"
        f'if [ ! -e "{marker}" ]; then touch "{marker}"; sleep 5; exit 1; fi\n'
        "echo 27.5.1\n"
    )
    client.chmod(0o755)
    monkeypatch.setattr(dockerd, "DOCKERD_PROBE_TIMEOUT_S", 0.5)
    docker = dockerd.Docker(str(client), tmp_path / "docker.sock")
    assert dockerd._server_version(docker) is None
    assert dockerd._server_version(docker) == "27.5.1"
