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
from e2e.harness.images.refs import LOCKS, ROOT, ImageError, images_cache

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


def ensure_wheels(lock: Path, wheel_dir: Path) -> list[Path]:
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
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary=:all:",
                    "-d",
                    str(wheel_dir),
                    "-r",
                    req_file.name,
                ],
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


def prepare_context(name: str, project_wheel: Path, wheel_dir: Path) -> Path:
    """The build context of images/<name>.Dockerfile: lock, its wheels, our wheel.

    Kept between runs (hard links, so no copy of the wheels) and updated in place, so
    unchanged files keep their identity and BuildKit's cache keys stay the same.
    """
    lock = LOCKS[name]
    wheels = ensure_wheels(lock, wheel_dir)
    context = images_cache() / f"context-{name}"
    (context / "wheels").mkdir(parents=True, exist_ok=True)
    (context / "dist").mkdir(parents=True, exist_ok=True)
    _sync_file(lock, context / "requirements.lock")
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
