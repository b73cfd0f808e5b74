"""Build, or reuse from the cache, the binaries of the e2e control plane.

Why build from source: the machines that run e2e have no Docker and may reach only package
registries, so release tarballs and container images are out. Every binary comes from a small
Go wrapper module under ``e2e/tools/<component>/`` whose ``go.mod`` + ``go.sum`` are committed
and whose ``tool`` directives name the commands to build; ``go build -o DIR/ tool`` builds
them with the local toolchain (``GOTOOLCHAIN=local``) through the Go module proxy, verified
against the committed checksums.

``e2e/versions.env`` is the one place that pins versions. Before building, each go.mod is
checked against it, so a bump that forgot a go.mod (or the reverse) fails loudly.

Output is cached at ``~/.cache/embedding-operator/<component>-<version>/`` (honours
``XDG_CACHE_HOME``; ``EMBEDDING_OPERATOR_CACHE`` overrides the root) with a ``.stamp`` file
written last. A component is rebuilt only when its stamp is missing or its build inputs
(go.mod, go.sum, ldflags) changed. A failed build raises ``BuildError``; callers must treat
that as a failure, never as a reason to skip.

CLI: ``python -m e2e.harness.binaries`` builds whatever is missing and prints progress;
``python -m e2e.harness.binaries keda`` only KEDA, and ``--except keda`` all the others (``make
test`` builds KEDA, the longest build, in a second process beside the rest). A build of a
component another process is building waits for it, and then finds it cached.

Every component builds in one Go build cache, so what they share (the standard library, and
the modules they pin at the same version) is compiled once. Builds in several processes may
share it; each holds ``building()`` for the whole of its ``go build``, and the cache is emptied
(``trim_build_cache``, ``drop_go_caches``) only while no build holds it: the last builder to
finish empties it, and so does ``ensure_binaries`` once every binary is there, so ``make
binaries`` returns with the cache empty however the builds were spread.

The module needs only the standard library, so ``make test`` runs it with the system Python
while the virtualenv installs.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("e2e.build")

E2E_DIR = Path(__file__).resolve().parents[1]
VERSIONS_FILE = E2E_DIR / "versions.env"
TOOLS_DIR = E2E_DIR / "tools"
STAMP_NAME = ".stamp"
# A cold build of the four Kubernetes commands takes ~20 min on 2 cores; nothing takes longer.
BUILD_TIMEOUT_S = 60 * 60
VERSION_CHECK_TIMEOUT_S = 30


class BuildError(RuntimeError):
    """A binary could not be built, or the pins disagree with the wrapper modules."""


def _k8s_ldflags(version: str) -> list[str]:
    # Variable names from kubernetes hack/lib/version.sh; without them /version says v0.0.0.
    major, minor = version.removeprefix("v").split(".")[:2]
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
        ]
    return flags


def _helm_ldflags(version: str) -> list[str]:
    # As helm's Makefile does: the release version, and the Kubernetes version that
    # `helm template`/`helm lint` assume (.Capabilities.KubeVersion) when no cluster is asked.
    k8s_major, k8s_minor = read_versions()["KUBERNETES_VERSION"].removeprefix("v").split(".")[:2]
    flags = ["-s", "-w", f"-X helm.sh/helm/v3/internal/version.version={version}"]
    for pkg in ("helm.sh/helm/v3/pkg/chartutil", "helm.sh/helm/v3/pkg/lint/rules"):
        flags += [f"-X {pkg}.k8sVersionMajor={k8s_major}", f"-X {pkg}.k8sVersionMinor={k8s_minor}"]
    return flags


def _plain_ldflags(version: str) -> list[str]:
    del version  # etcd, kwok and CoreDNS carry their version in source
    return ["-s", "-w"]


def _cni_ldflags(version: str) -> list[str]:
    # As the plugins' build script does; without it the plugins report no version.
    return ["-s", "-w", f"-X {CNI_MODULE}/pkg/utils/buildversion.BuildVersion={version}"]


def _prometheus_ldflags(version: str) -> list[str]:
    # The Go module's v0.X.Y is Prometheus 2.X.Y (3.(X-300).Y from v0.300.0 on), as its
    # release process tags both.
    minor, patch = (int(part) for part in version.removeprefix("v0.").split(".")[:2])
    release = f"3.{minor - 300}.{patch}" if minor >= 300 else f"2.{minor}.{patch}"
    return ["-s", "-w", f"-X github.com/prometheus/common/version.Version={release}"]


def _keda_ldflags(version: str) -> list[str]:
    # As KEDA's Makefile does: without it both commands log version "main".
    return [
        "-s",
        "-w",
        f"-X github.com/kedacore/keda/v2/version.Version={version.removeprefix('v')}",
    ]


def _versitygw_ldflags(version: str) -> list[str]:
    # As versitygw's Makefile does: without it `--version` says "git".
    return ["-s", "-w", f"-X main.Version={version}"]


def _adapter_ldflags(version: str) -> list[str]:
    # prometheus-adapter reports component-base's version, like the Kubernetes commands.
    return ["-s", "-w", f"-X k8s.io/component-base/version.gitVersion={version}"]


CNI_MODULE = "github.com/containernetworking/plugins"
# In place of a version argv: check the module version recorded in the binary's build info.
BUILD_INFO: tuple[str, ...] = ("<go version -m>",)


@dataclass(frozen=True)
class Component:
    """One wrapper module under e2e/tools and what it produces."""

    name: str
    version_key: str
    module: str
    # output binary name -> name `go build -o DIR/ tool` gives it (last import path element,
    # major-version suffix dropped), plus the argv that prints its version.
    binaries: dict[str, tuple[str, tuple[str, ...]]]
    ldflags: Callable[[str], list[str]]
    staging_replaces: bool = False
    # output directory name -> a directory of the module copied beside the binaries (KEDA's
    # CRDs), so what the cluster applies is the pinned version's, cached with its binaries.
    module_dirs: dict[str, str] = field(default_factory=dict)

    @property
    def tools_dir(self) -> Path:
        return TOOLS_DIR / self.name


COMPONENTS: tuple[Component, ...] = (
    # Built first: the unit tier runs these two (the chart's `helm template` and `helm lint`,
    # `promtool check rules`), and `make test` starts it while the others build.
    Component(
        name="helm",
        version_key="HELM_VERSION",
        module="helm.sh/helm/v3",
        binaries={"helm": ("helm", ("version", "--short"))},
        ldflags=_helm_ldflags,
    ),
    # promtool checks the chart's alert and recording rules (`promtool check rules`): the
    # same module and pin as prometheus, in a wrapper of its own, so adding it changed no
    # build input of the prometheus binary (worktrees sharing the cache do not rebuild it).
    Component(
        name="promtool",
        version_key="PROMETHEUS_VERSION",
        module="github.com/prometheus/prometheus",
        binaries={"promtool": ("promtool", BUILD_INFO)},
        ldflags=_prometheus_ldflags,
    ),
    Component(
        name="etcd",
        version_key="ETCD_VERSION",
        module="go.etcd.io/etcd/server/v3",
        binaries={"etcd": ("server", ("--version",))},
        ldflags=_plain_ldflags,
    ),
    Component(
        name="kwok",
        version_key="KWOK_VERSION",
        module="sigs.k8s.io/kwok",
        binaries={"kwok": ("kwok", ("--version",))},
        ldflags=_plain_ldflags,
    ),
    Component(
        name="k8s",
        version_key="KUBERNETES_VERSION",
        module="k8s.io/kubernetes",
        binaries={
            name: (name, ("--version",))
            for name in (
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler",
                "kubelet",
                "kube-proxy",
            )
        }
        | {"kubectl": ("kubectl", ("version", "--client"))},
        ldflags=_k8s_ldflags,
        staging_replaces=True,
    ),
    # The real node: CNI plugins for containerd, CoreDNS for Service names, and the adapter
    # that serves custom.metrics.k8s.io from Prometheus to the HPA.
    Component(
        name="cni",
        version_key="CNI_PLUGINS_VERSION",
        module=CNI_MODULE,
        binaries={name: (name, ()) for name in ("bridge", "host-local", "loopback", "portmap")},
        ldflags=_cni_ldflags,
    ),
    Component(
        name="coredns",
        version_key="COREDNS_VERSION",
        module="github.com/coredns/coredns",
        binaries={"coredns": ("coredns", ("-version",))},
        ldflags=_plain_ldflags,
    ),
    # Debian's prometheus package is built without Kubernetes service discovery.
    Component(
        name="prometheus",
        version_key="PROMETHEUS_VERSION",
        module="github.com/prometheus/prometheus",
        binaries={"prometheus": ("prometheus", BUILD_INFO)},
        ldflags=_prometheus_ldflags,
    ),
    Component(
        name="prometheus-adapter",
        version_key="PROMETHEUS_ADAPTER_VERSION",
        module="sigs.k8s.io/prometheus-adapter",
        # It has no --version flag: its build info names the module version instead.
        binaries={"prometheus-adapter": ("adapter", BUILD_INFO)},
        ldflags=_adapter_ldflags,
    ),
    # An S3-compatible object store on the host (Apache-2.0) for the EmbeddingJob tests:
    # their corpora and outputs. Light (about 220 s of CPU cold), so it builds in the same
    # background process as the others, which finishes well before KEDA's.
    Component(
        name="versitygw",
        version_key="VERSITYGW_VERSION",
        module="github.com/versity/versitygw",
        binaries={"versitygw": ("versitygw", ("--version",))},
        ldflags=_versitygw_ldflags,
    ),
    # ScaledObjects (`autoscaler: keda`) and external.metrics.k8s.io, with scale to zero.
    Component(
        name="keda",
        version_key="KEDA_VERSION",
        module="github.com/kedacore/keda/v2",
        binaries={
            "keda-operator": ("operator", BUILD_INFO),
            "keda-adapter": ("adapter", BUILD_INFO),
        },
        ldflags=_keda_ldflags,
        module_dirs={"keda-crds": "config/crd/bases"},
    ),
)


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every control-plane binary."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    helm: Path
    kubelet: Path
    kube_proxy: Path
    coredns: Path
    prometheus: Path
    promtool: Path
    prometheus_adapter: Path
    versitygw: Path
    keda_operator: Path
    keda_adapter: Path
    keda_crds: Path
    cni_bin_dir: Path

    def bin_dirs(self) -> list[Path]:
        """Directories to prepend to PATH so `kubectl` and `helm` are ours, deduplicated."""
        dirs: list[Path] = []
        for path in (self.kubectl, self.helm, self.kwok, self.etcd):
            if path.parent not in dirs:
                dirs.append(path.parent)
        return dirs


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse the KEY=VALUE pin file (comments and blank lines ignored)."""
    versions: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise BuildError(f"{path}:{lineno}: expected KEY=VALUE, got {raw!r}")
        versions[key.strip()] = value.strip()
    return versions


def cache_root() -> Path:
    override = os.environ.get("EMBEDDING_OPERATOR_CACHE")
    if override:
        return Path(override).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "embedding-operator"


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env["GOTOOLCHAIN"] = "local"  # never download another toolchain behind our back
    env["CGO_ENABLED"] = "0"  # static binaries, no C toolchain needed
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -mod=readonly").strip()
    # Module and build caches live beside the binaries, so one directory holds everything a
    # warm run reuses (and `rm -rf ~/.cache/embedding-operator` is a true cold start).
    env.setdefault("GOMODCACHE", str(cache_root() / "go" / "mod"))
    env.setdefault("GOCACHE", str(cache_root() / "go" / "build"))
    return env


def _go(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    go = shutil.which("go")
    if go is None:
        raise BuildError("`go` is not on PATH; the e2e control plane is built from Go modules")
    try:
        return subprocess.run(
            [go, *args],
            cwd=cwd,
            env=_go_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"`go {' '.join(args)}` in {cwd} timed out after {timeout:.0f}s") from exc


def check_go_mod(component: Component, version: str) -> None:
    """Raise BuildError unless the wrapper go.mod requires exactly the pinned version."""
    proc = _go(["mod", "edit", "-json"], component.tools_dir, timeout=60)
    if proc.returncode != 0:
        raise BuildError(f"cannot read {component.tools_dir}/go.mod: {proc.stderr.strip()}")
    mod = json.loads(proc.stdout)
    if not mod.get("Tool"):
        raise BuildError(f"{component.tools_dir}/go.mod has no `tool` directives")
    required = {r["Path"]: r["Version"] for r in mod.get("Require") or []}
    if required.get(component.module) != version:
        raise BuildError(
            f"{component.tools_dir}/go.mod requires {component.module} "
            f"{required.get(component.module)}, but {VERSIONS_FILE.name} pins "
            f"{component.version_key}={version}"
        )
    if component.staging_replaces:
        # k8s.io/kubernetes vX.Y.Z needs its staging modules at v0.Y.Z.
        staging = "v0." + version.removeprefix("v").split(".", 1)[1]
        wrong = [
            f"{r['Old']['Path']} => {r['New'].get('Version')}"
            for r in mod.get("Replace") or []
            if r["Old"]["Path"].startswith("k8s.io/") and r["New"].get("Version") != staging
        ]
        if wrong:
            raise BuildError(
                f"{component.tools_dir}/go.mod: staging replaces must be {staging}: {wrong}"
            )


def _inputs_digest(component: Component, version: str) -> str:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        digest.update((component.tools_dir / name).read_bytes())
    digest.update("\0".join(component.ldflags(version)).encode())
    digest.update("\0".join(sorted(component.binaries)).encode())
    digest.update("\0".join(f"{k}={v}" for k, v in sorted(component.module_dirs.items())).encode())
    return digest.hexdigest()


def component_dir(component: Component, version: str) -> Path:
    return cache_root() / f"{component.name}-{version}"


def _cached(out_dir: Path, component: Component, digest: str) -> bool:
    stamp = out_dir / STAMP_NAME
    if not stamp.is_file():
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    if recorded.get("inputs_sha256") != digest:
        return False
    return all(os.access(out_dir / name, os.X_OK) for name in component.binaries) and all(
        (out_dir / name).is_dir() for name in component.module_dirs
    )


def _lock_held(path: Path) -> bool:
    """Whether another process holds ``locked(path)`` right now."""
    if not path.exists():
        return False
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def _build_lock() -> Path:
    return cache_root() / "go" / "build.lock"


def _empty_lock() -> Path:
    return cache_root() / "go" / "empty.lock"


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Held, shared, for the whole of a build: any number of builds, in any processes, may
    use the Go caches at once, and none of them is emptied under them (``_unless_building``)."""
    path = _build_lock()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _unless_building() -> Iterator[bool]:
    """Hold the Go caches alone if no build holds ``building()``; yields whether it does.

    Waits for another process emptying them (so the caller returns with them empty), never
    for a build: a builder still running empties them itself when it is done."""
    with locked(_empty_lock()), _build_lock().open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock file: one builder of a thing at a time (parallel pytest sessions, CI
    jobs on one host, a Go build beside an image build)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_build_info(binary: Path, module: str, version: str) -> str:
    proc = _go(["version", "-m", str(binary)], binary.parent, timeout=VERSION_CHECK_TIMEOUT_S)
    wanted = f"{module}\t{version}"
    if proc.returncode != 0 or wanted not in proc.stdout:
        raise BuildError(f"{binary.name}'s build info does not name {module} {version}")
    return f"{module} {version} (build info)"


def _check_version(binary: Path, argv: tuple[str, ...], version: str) -> str:
    try:
        proc = subprocess.run(
            [str(binary), *argv],
            capture_output=True,
            text=True,
            timeout=VERSION_CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{binary} does not run: {exc}") from exc
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 or version.removeprefix("v") not in output:
        raise BuildError(
            f"`{binary.name} {' '.join(argv)}` should report {version}, got "
            f"rc={proc.returncode}: {output[:500]}"
        )
    return output.splitlines()[0]


def _check_outputs(component: Component, version: str, staging: Path) -> None:
    """Every binary is there, renamed to its output name, and reports the pinned version."""
    for out_name, (built_name, version_argv) in component.binaries.items():
        built = staging / built_name
        if not built.is_file():
            raise BuildError(f"go build of {component.name} produced no {built_name}")
        if built_name != out_name:
            built.rename(staging / out_name)
        if version_argv == BUILD_INFO:
            reported = _check_build_info(staging / out_name, component.module, version)
        else:
            reported = _check_version(staging / out_name, version_argv, version)
        log.info("[build]   %s: %s", out_name, reported)


def _copy_module_dirs(component: Component, version: str, staging: Path) -> None:
    """Copy each of ``module_dirs`` from the module as the build downloaded it."""
    if not component.module_dirs:
        return
    proc = _go(["list", "-m", "-f", "{{.Dir}}", component.module], component.tools_dir, timeout=60)
    module_dir = Path(proc.stdout.strip())
    if proc.returncode != 0 or not module_dir.is_dir():
        raise BuildError(f"cannot find {component.module} {version}'s files: {proc.stderr.strip()}")
    for out_name, source in component.module_dirs.items():
        if not (module_dir / source).is_dir():
            raise BuildError(f"{component.module} {version} has no {source}/")
        # File by file: the module cache is read-only, and its modes would follow a copytree.
        (staging / out_name).mkdir()
        for item in sorted((module_dir / source).iterdir()):
            if item.is_file():
                shutil.copyfile(item, staging / out_name / item.name)
        log.info("[build]   %s: %s/%s", out_name, component.module, source)


def _build(component: Component, version: str, out_dir: Path, digest: str) -> None:
    with building():
        staging, seconds = _build_into(component, version, out_dir, digest)
    # Published only once this build lets go of the caches: whoever finds it cached then may
    # empty them at once (make test's `make binaries` does, before the e2e tier).
    _publish(staging, out_dir)
    log.info("[build] %s %s: built in %.0fs -> %s", component.name, version, seconds, out_dir)


def _publish(staging: Path, out_dir: Path) -> None:
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)


def _build_into(
    component: Component, version: str, out_dir: Path, digest: str
) -> tuple[Path, float]:
    """Build into a staging directory beside ``out_dir``; it and the build's seconds."""
    staging = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    log.info(
        "[build] %s %s: go build in %s (cold: minutes)",
        component.name,
        version,
        component.tools_dir,
    )
    started = time.monotonic()
    proc = _go(
        [
            "build",
            "-trimpath",
            "-ldflags",
            " ".join(component.ldflags(version)),
            "-o",
            f"{staging}/",
            "tool",
        ],
        component.tools_dir,
        timeout=BUILD_TIMEOUT_S,
    )
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise BuildError(
            f"go build of {component.name} {version} failed after {seconds:.0f}s:\n"
            f"{proc.stderr[-4000:]}"
        )
    try:
        _check_outputs(component, version, staging)
        _copy_module_dirs(component, version, staging)
    except BuildError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (staging / STAMP_NAME).write_text(
        json.dumps(
            {
                "component": component.name,
                "version": version,
                "inputs_sha256": digest,
                "go": _go(["version"], component.tools_dir, timeout=60).stdout.strip(),
                "build_seconds": round(seconds, 1),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            indent=2,
        )
        + "\n"
    )
    return staging, seconds


def ensure_component(component: Component, versions: dict[str, str] | None = None) -> Path:
    """Return the cache directory holding the component's binaries, building it if needed."""
    return _ensure(component, versions)[0]


def _ensure(component: Component, versions: dict[str, str] | None) -> tuple[Path, bool]:
    """The component's cache directory, and whether this call built it."""
    versions = versions if versions is not None else read_versions()
    try:
        version = versions[component.version_key]
    except KeyError as exc:
        raise BuildError(f"{VERSIONS_FILE} has no {component.version_key}") from exc
    check_go_mod(component, version)
    out_dir = component_dir(component, version)
    digest = _inputs_digest(component, version)
    if _cached(out_dir, component, digest):
        log.info("[build] %s %s: cached in %s", component.name, version, out_dir)
        return out_dir, False
    lock = out_dir.with_name(f"{out_dir.name}.lock")
    if _lock_held(lock):
        log.info("[build] %s %s: another process is building it; waiting", component.name, version)
    with locked(lock):
        if _cached(out_dir, component, digest):  # another process built it while we waited
            return out_dir, False
        _build(component, version, out_dir, digest)
    return out_dir, True


def ensure_binaries(components: tuple[Component, ...] = COMPONENTS) -> Binaries:
    """Build what is missing, one component at a time (builds saturate every core), then
    empty the Go build cache, even when other processes built them all (``make test``'s
    background builds): with every binary there, no build of ours needs it any more."""
    versions = read_versions()
    paths: dict[str, Path] = {}
    for component in components:
        out_dir, _ = _ensure(component, versions)
        if component.name == "cni":
            paths["cni_bin_dir"] = out_dir
            continue
        for name in [*component.binaries, *component.module_dirs]:
            paths[name.replace("-", "_")] = out_dir / name
    trim_build_cache()
    return Binaries(**paths)


def trim_build_cache() -> None:
    """Empty our Go build cache once every binary is built (7 GB for this set), unless a
    build in another process still uses it (that one empties it when it is done); one that
    another process is emptying is waited for.

    The binaries themselves are cached by version, so the build cache only speeds up a
    rebuild after a version bump, and the images and the node's store need the disk more.
    The module cache stays: it is what a rebuild would otherwise download. A GOCACHE the
    caller set is theirs, and left alone."""
    ours = cache_root() / "go" / "build"
    if Path(_go_env()["GOCACHE"]) != ours or not ours.is_dir():
        return
    with _unless_building() as alone:
        if not alone:
            log.info("[build] a build still uses the Go build cache %s: it empties it", ours)
            return
        proc = _go(["clean", "-cache"], cache_root(), timeout=600)
    if proc.returncode != 0:
        log.warning("[build] go clean -cache failed: %s", proc.stderr.strip()[-500:])
    else:
        log.info("[build] emptied the Go build cache %s", ours)


def drop_go_caches() -> None:
    """Empty our Go build and module caches (6 to 10 GB), for when the disk is needed more.

    Every binary is cached by version beside them, so they only speed up a rebuild after a
    version bump, which then downloads its modules again. GOCACHE or GOMODCACHE set by the
    caller are theirs, and left alone."""
    env = _go_env()
    flags = [
        flag
        for flag, key, ours in (
            ("-cache", "GOCACHE", cache_root() / "go" / "build"),
            ("-modcache", "GOMODCACHE", cache_root() / "go" / "mod"),
        )
        if Path(env[key]) == ours and ours.is_dir()
    ]
    if not flags or shutil.which("go") is None:
        return
    with _unless_building() as alone:
        if not alone:
            log.info("[build] a Go build is running: our Go caches stay (%s)", " ".join(flags))
            return
        proc = _go(["clean", *flags], cache_root(), timeout=600)
    if proc.returncode != 0:
        log.warning("[build] go clean %s failed: %s", " ".join(flags), proc.stderr.strip()[-500:])
    else:
        log.info("[build] emptied our Go caches (%s) to make room", " ".join(flags))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [c.name for c in COMPONENTS]
    parser.add_argument(
        "components",
        nargs="*",
        metavar="COMPONENT",
        help=f"only these components, of {', '.join(names)} (default: all)",
    )
    parser.add_argument(
        "--except",
        dest="excluded",
        action="append",
        default=[],
        metavar="COMPONENT",
        help="every component but these (make test builds keda in the background)",
    )
    args = parser.parse_args(argv)
    unknown = sorted((set(args.components) | set(args.excluded)) - set(names))
    if unknown:
        parser.error(f"unknown component(s) {unknown}; choose from {names}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    wanted = tuple(
        c
        for c in COMPONENTS
        if (not args.components or c.name in args.components) and c.name not in args.excluded
    )
    try:
        if len(wanted) == len(COMPONENTS):
            binaries = ensure_binaries()
            for field, path in vars(binaries).items():
                print(f"{field}={path}")
        else:
            built = False
            for component in wanted:
                built |= _ensure(component, None)[1]
            if built:
                trim_build_cache()
    except BuildError as exc:
        print(f"[build] FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
