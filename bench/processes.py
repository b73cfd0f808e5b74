"""CPU accounting of a process tree, and the command that starts our server, for the benchmarks
that compare servers or ranks."""

from __future__ import annotations

import contextlib
import sys

import psutil


def _tree(root: psutil.Process | None) -> list[psutil.Process]:
    root = root if root is not None else psutil.Process()
    return [root, *root.children(recursive=True)]


def cpu_seconds(root: psutil.Process | None = None) -> float:
    """User and system CPU seconds of ``root`` (default: this process) and every live process
    under it: a server's engine and front-ends, or the tensor-parallel worker ranks."""
    total = 0.0
    for process in _tree(root):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def main_thread_cpu_seconds(root: psutil.Process | None = None) -> float:
    """The part of :func:`cpu_seconds` spent on the processes' main threads (on Linux, the
    thread whose id is the process's): in an asyncio server, its event loop. The rest is
    its other threads: forward passes, batch preparation, tokenizer and OpenMP threads."""
    total = 0.0
    for process in _tree(root):
        with contextlib.suppress(psutil.NoSuchProcess):
            for thread in process.threads():
                if thread.id == process.pid:
                    total += thread.user_time + thread.system_time
    return total


def serve_command(model: str, port: str, *flags: str) -> list[str]:
    """``python -m embedding_server serve`` on ``model`` with ``flags``, on 127.0.0.1:``port``,
    logging warnings and worse."""
    return [
        *(sys.executable, "-m", "embedding_server", "serve", "--model", model, *flags),
        *("--host", "127.0.0.1", "--port", port, "--log-level", "warning"),
    ]
