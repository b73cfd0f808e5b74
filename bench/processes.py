"""CPU accounting of a process tree, for the benchmarks that compare servers or ranks."""

from __future__ import annotations

import contextlib

import psutil


def cpu_seconds(root: psutil.Process | None = None) -> float:
    """User and system CPU seconds of ``root`` (default: this process) and every live process
    under it: a server's engine and front-ends, or the tensor-parallel worker ranks."""
    root = root if root is not None else psutil.Process()
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total
