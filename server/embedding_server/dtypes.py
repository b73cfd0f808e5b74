"""Device, dtype and CPU-thread resolution (``device=auto``, ``dtype=auto``).

Why a module of its own: the choice is hardware-dependent and easy to get subtly wrong. On a
CPU without native bfloat16 instructions (avx512_bf16 or AMX) torch emulates bf16 matmuls and
they run several times slower than float32, so ``auto`` must not pick bf16 there even though
it "works". On CUDA, bf16 is the default unless the GPU lacks it (pre-Ampere), then fp16.

Threads: torch sizes its CPU pool from the host's core count, but a container's CPU quota
(cgroup ``cpu.max``) is often far smaller; more OpenMP threads than CPUs we may use makes every
parallel region wait for descheduled threads, which is catastrophic for latency.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path

import torch

from .settings import Dtype

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # read before anything changes it


def resolve_device(setting: str) -> torch.device:
    """``auto`` is the first CUDA device when one is usable, else the CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The processor's feature flags from /proc/cpuinfo (empty where it does not exist)."""
    path = Path("/proc/cpuinfo")
    try:
        text = path.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when bf16 matmuls run natively (avx512_bf16 / AMX), so bf16 beats float32."""
    if cpu_flags() & _BF16_CPU_FLAGS:
        return True
    capability = str(torch.backends.cpu.get_cpu_capability()).upper()
    return "AMX" in capability


def resolve_dtype(setting: Dtype, device: torch.device) -> torch.dtype:
    """The compute dtype for weights and activations (outputs are always float32)."""
    if setting != "auto":
        if setting == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
            logger.warning(
                "bfloat16 on a CPU without avx512_bf16/AMX is emulated and several "
                "times slower than float32; dtype=auto would pick float32 here"
            )
        return _DTYPES[setting]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    count = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota visible: the affinity mask is the limit
    return max(1, count)


def cpu_thread_budget() -> int:
    """Threads for CPU forward passes: ``OMP_NUM_THREADS`` if set, else torch's default
    (physical cores) capped by the CPUs we may use."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(_TORCH_DEFAULT_THREADS, available_cpus()))
