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
from e2e.harness.proc import run_command

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
    """Run to completion (``proc.run_command``); ImageError with the output's tail on failure
    or timeout, naming ``what`` (default: the command's first three words)."""
    return run_command(
        argv,
        timeout=timeout,
        env=env,
        cwd=cwd,
        what=what or " ".join(argv[:3]),
        error=ImageError,
    )


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
