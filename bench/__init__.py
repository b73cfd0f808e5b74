"""Benchmarks (not tests): each module prints figures and ratios. Run them from the repository
root as modules, e.g. ``python -m bench.offline --texts 200`` (``make bench`` runs them all).

Figures and charts go to ``bench/out/``, or to the folder ``$BENCH_OUT`` names: the smoke run
of every script in the e2e tier (``e2e/test_bench.py``) writes there, so that it never
overwrites a real run's figures. Each script's ``<bench>.json`` opens with what makes its
figures comparable (:func:`write_results`): the date, the commit, the command and the machine.

The figures the docs quote are committed under ``bench/results/``, and ``bench.render``
writes the docs' tables from them."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OUT_ENV = "BENCH_OUT"
REPO = Path(__file__).resolve().parents[1]

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
"""The CPU flags that decide which paths run: native bfloat16 (``avx512_bf16``, AMX) makes
``--dtype auto`` pick bfloat16, and int8 takes AMX tiles or VNNI where they exist."""

RUN_KEYS = ("bench", "date", "time", "commit", "dirty", "command", "machine")
"""The keys :func:`run_info` puts at the top of every ``<bench>.json``."""


def out_dir() -> Path:
    """Where a benchmark writes its figures: ``$BENCH_OUT``, else ``bench/out``."""
    chosen = os.environ.get(OUT_ENV)
    return Path(chosen) if chosen else REPO / "bench" / "out"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where it does not exist)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpus() -> list[str]:
    """The GPUs' names, as nvidia-smi lists them (none without nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listing.splitlines() if line.strip()]


def machine_kind(isa: list[str]) -> str:
    """The kind of machine the docs group figures by: what its CPU multiplies bfloat16 with."""
    if "amx_bf16" in isa:
        return "amx"
    if "avx512_bf16" in isa:
        return "avx512_bf16"
    if "avx2" in isa:
        return "avx2"
    return platform.machine() or "unknown"


def machine() -> dict[str, Any]:
    """This machine as a results file records it: its kind, CPU model, cores, the ISA flags of
    :data:`ISA_FLAGS` it has, memory and GPUs."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    isa = [flag for flag in ISA_FLAGS if flag in flags]
    return {
        "kind": machine_kind(isa),
        "cpu": info.get("model name") or platform.processor() or None,
        "cores": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": isa,
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
    }


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> tuple[str | None, bool | None]:
    """The commit the benchmark ran (None outside a git checkout), and whether tracked files
    differed from it."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head, None if status is None else bool(status)


def run_info(bench: str) -> dict[str, Any]:
    """What makes a run's figures comparable: :data:`RUN_KEYS`, the date and time in UTC."""
    head, dirty = commit()
    now = time.gmtime()
    return {
        "bench": bench,
        "date": time.strftime("%Y-%m-%d", now),
        "time": time.strftime("%H:%M:%SZ", now),
        "commit": head,
        "dirty": dirty,
        "command": shlex.join(["python", "-m", f"bench.{bench}", *sys.argv[1:]]),
        "machine": machine(),
    }


def write_results(bench: str, figures: dict[str, Any], path: Path | None = None) -> Path:
    """``figures`` as ``<bench>.json`` in :func:`out_dir` (or at ``path``), after
    :func:`run_info`'s keys, which the figures must not use."""
    clash = set(RUN_KEYS) & set(figures)
    if clash:
        raise ValueError(f"figures may not use the run's keys: {sorted(clash)}")
    target = path if path is not None else out_dir() / f"{bench}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({**run_info(bench), **figures}, indent=2) + "\n")
    return target
