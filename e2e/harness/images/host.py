"""The host commands the image tooling runs, with deadlines and errors that say what failed."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from e2e.harness.images.refs import ImageError

log = logging.getLogger("e2e.images")

SHORT_TIMEOUT_S = 60.0


def run(
    argv: Sequence[str],
    timeout: float,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    what: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run to completion; ImageError with the output's tail on failure or timeout."""
    label = what or " ".join(argv[:3])
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"{label} timed out after {timeout:.0f}s") from exc
    except FileNotFoundError as exc:
        raise ImageError(f"{label}: {argv[0]} not found") from exc
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-4000:]
        raise ImageError(f"{label} failed (rc={proc.returncode}):\n{output}")
    return proc


def first_executable(candidates: Sequence[str], name: str) -> str:
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found is None:
        raise ImageError(f"{name} not found (tried {', '.join(candidates)} and PATH)")
    return found


@contextlib.contextmanager
def timed(timings: dict[str, float], step: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    timings[step] = round(time.monotonic() - started, 1)
    log.info("[images] %s: %.1fs", step, timings[step])
