"""The Python wheels an image installs, and the build context that carries them.

``pip`` inside ``docker build`` cannot reach PyPI on CI machines (TLS interception), so the
wheels the lock files pin (``images/*.lock``) are downloaded on the host into the cache and
bind-mounted into the build together with our own wheel (``pip wheel --no-deps .``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from e2e.harness.images.host import run
from e2e.harness.images.refs import (
    CPU_TORCH_INDEX,
    LOCKS,
    ROOT,
    SERVER_CONTEXT_LOCKS,
    SERVER_LOCKS,
    TORCH_SOURCES,
    ImageError,
    images_cache,
)

log = logging.getLogger("e2e.images")

# The CPython the base's python3 is (bookworm: 3.11); host-downloaded wheels must match it.
IMAGE_PYTHON = (3, 11)
PIP_TIMEOUT_S = 30 * 60
WHEEL_EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can carry


def read_lock(path: Path) -> dict[str, str]:
    """canonical name -> pinned version of a `name==version` requirements file."""
    pins: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==":
            raise ImageError(f"{path}:{lineno}: pin with ==, got {raw!r}")
        pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def _wheel_index(directory: Path) -> dict[tuple[str, str], Path]:
    index: dict[tuple[str, str], Path] = {}
    for wheel in directory.glob("*.whl"):
        try:
            name, version, _build, _tags = parse_wheel_filename(wheel.name)
        except ValueError:
            continue
        index[(str(name), str(version))] = wheel
    return index


def download_command(requirements: Path, wheel_dir: Path, extra_index: str | None) -> list[str]:
    """`pip download` of exactly the pinned wheels in ``requirements``; ``extra_index``: one
    more index beside pip's own (PyTorch's CPU index for a ``+cpu`` torch, which PyPI lacks)."""
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(wheel_dir),
        "-r",
        str(requirements),
    ]
    return [*argv, "--extra-index-url", extra_index] if extra_index else argv


def ensure_wheels(lock: Path, wheel_dir: Path, *, extra_index: str | None = None) -> list[Path]:
    """The wheels the lock pins, downloading into the shared wheel dir only what is missing."""
    if sys.version_info[:2] != IMAGE_PYTHON:
        raise ImageError(
            f"wheels are downloaded for this interpreter (Python {sys.version_info[0]}."
            f"{sys.version_info[1]}), but the image's python3 is "
            f"{IMAGE_PYTHON[0]}.{IMAGE_PYTHON[1]}: run e2e.harness.images with a 3.11 venv"
        )
    pins = read_lock(lock)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    index = _wheel_index(wheel_dir)
    missing = [f"{n}=={v}" for n, v in pins.items() if (n, v) not in index]
    if missing:
        log.info("[images] downloading %d wheels for %s", len(missing), lock.name)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req_file:
            req_file.write("\n".join(missing) + "\n")
        try:
            run(
                download_command(Path(req_file.name), wheel_dir, extra_index),
                PIP_TIMEOUT_S,
                what=f"pip download for {lock.name}",
            )
        finally:
            os.unlink(req_file.name)
        index = _wheel_index(wheel_dir)
    absent = [f"{n}=={v}" for n, v in pins.items() if (n, v) not in index]
    if absent:
        raise ImageError(f"no wheel for {absent} in {wheel_dir} after pip download")
    return sorted(index[(n, v)] for n, v in pins.items())


def build_project_wheel(out_dir: Path) -> Path:
    """`pip wheel --no-deps .` of this repository into an emptied `out_dir`."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out_dir),
            str(ROOT),
        ],
        PIP_TIMEOUT_S,
        # Fixed zip timestamps: the same sources give the same wheel bytes, so BuildKit keeps
        # the package layer cached when nothing changed.
        env=dict(os.environ, SOURCE_DATE_EPOCH=WHEEL_EPOCH),
        what="pip wheel of embedding-operator",
    )
    wheels = list(out_dir.glob("embedding_operator-*.whl"))
    if len(wheels) != 1:
        raise ImageError(f"pip wheel left {wheels} in {out_dir}, expected one wheel")
    return wheels[0]


def _sync_file(source: Path, target: Path) -> None:
    """Hard-link (or copy) `source` to `target` unless an identical file is already there."""
    if target.exists():
        if target.samefile(source):
            return
        if target.stat().st_size == source.stat().st_size and _digest(target) == _digest(source):
            return
        target.unlink()
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def server_lock(torch_source: str) -> tuple[Path, str | None]:
    """The server image's lock for ``torch_source`` and the index its torch comes from
    (``None``: pip's own, PyPI)."""
    if torch_source not in SERVER_LOCKS:
        raise ImageError(f"torch source must be one of {', '.join(TORCH_SOURCES)}")
    lock = SERVER_LOCKS[torch_source]
    if not lock.is_file():
        raise ImageError(
            f"images/{lock.name} does not exist: write it with `python -m "
            f"e2e.harness.images lock --torch-source {torch_source}` on a machine that reaches "
            f"{CPU_TORCH_INDEX}, and commit it"
        )
    return lock, CPU_TORCH_INDEX if torch_source == "cpu" else None


def prepare_context(
    name: str, project_wheel: Path, wheel_dir: Path, *, torch_source: str = "pypi"
) -> Path:
    """The build context of images/<name>.Dockerfile: lock, its wheels, our wheel. The
    server's holds the lock of ``torch_source`` under the name its Dockerfile's ``lock-*``
    stage copies, and no other lock.

    Kept between runs (hard links, so no copy of the wheels) and updated in place, so
    unchanged files keep their identity and BuildKit's cache keys stay the same.
    """
    if name == "server":
        lock, extra_index = server_lock(torch_source)
        lock_name = SERVER_CONTEXT_LOCKS[torch_source]
    else:
        lock, extra_index, lock_name = LOCKS[name], None, "requirements.lock"
    wheels = ensure_wheels(lock, wheel_dir, extra_index=extra_index)
    context = images_cache() / f"context-{name}"
    (context / "wheels").mkdir(parents=True, exist_ok=True)
    (context / "dist").mkdir(parents=True, exist_ok=True)
    for other in set(SERVER_CONTEXT_LOCKS.values()) - {lock_name}:
        (context / other).unlink(missing_ok=True)  # a lock of the other source
    _sync_file(lock, context / lock_name)
    wanted = {wheel.name for wheel in wheels}
    for stale in (context / "wheels").iterdir():
        if stale.name not in wanted:
            stale.unlink()
    for wheel in wheels:
        _sync_file(wheel, context / "wheels" / wheel.name)
    for stale in (context / "dist").iterdir():
        if stale.name != project_wheel.name:
            stale.unlink()
    _sync_file(project_wheel, context / "dist" / project_wheel.name)
    return context
