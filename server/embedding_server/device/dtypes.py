"""Device, dtype and CPU-thread resolution (``device=auto``, ``dtype=auto``).

Why a module of its own: the choice is hardware-dependent and easy to get subtly wrong. On a
CPU without native bfloat16 instructions (avx512_bf16 or AMX) torch emulates bf16 matmuls and
they run several times slower than float32, so ``auto`` must not pick bf16 there even though
it "works". On CUDA, bf16 is the default where the target GPU runs it natively (compute
capability 8.0, Ampere, or newer), else fp16: ``torch.cuda.is_bf16_supported()`` counts
emulation by default, and asks about the *current* device, so it is not used. Models whose
activations overflow fp16 (Gemma 3) never get it from ``auto``, and refuse it when asked.

A device asked for by name must be usable: a GPU pod whose CUDA is broken fails at start
instead of silently serving on its CPU with CPU batch sizes.

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

from embedding_server.errors import InvalidRequestError
from embedding_server.settings import Dtype

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # read before anything changes it


def resolve_device(setting: str) -> torch.device:
    """``auto`` is the first CUDA device when one is usable, else the CPU. A CUDA device asked
    for by name must be usable, or this raises saying why."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting)
    except RuntimeError as error:
        message = f"device={setting!r} is not a device: {error}"
        raise InvalidRequestError(message, param="device") from None
    reason = cuda_unusable(device) if device.type == "cuda" else None
    if reason is not None:
        raise InvalidRequestError(f"device={setting} was asked for, but {reason}", param="device")
    return device


def cuda_unusable(device: torch.device) -> str | None:
    """Why ``device`` (a CUDA device) cannot be used by this process, or None."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return (
            "CUDA is not usable: no GPU is visible to this process (check the pod's "
            "nvidia.com/gpu request, the NVIDIA device plugin and CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"only {count} GPU(s) are visible to this process"
    return None


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of ``device`` itself (not of the current device)."""
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


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


def resolve_dtype(
    setting: Dtype,
    device: torch.device,
    *,
    capability: tuple[int, int] | None = None,
    fp16_overflows: str | None = None,
) -> torch.dtype:
    """The compute dtype for weights and activations (outputs are always float32).

    ``capability``: the CUDA device's compute capability (read from the device when None).
    ``fp16_overflows``: the model family's name when its activations overflow float16; such a
    model refuses ``float16`` and gets float32 where ``auto`` would have picked float16.
    """
    if setting != "auto":
        if setting == "float16" and fp16_overflows:
            raise InvalidRequestError(
                f"dtype=float16: {fp16_overflows} activations overflow float16 (inf/NaN "
                "vectors); use bfloat16 (Ampere or newer GPUs, or CPUs with avx512_bf16/AMX) "
                "or float32",
                param="dtype",
            )
        if setting == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
            logger.warning(
                "bfloat16 on a CPU without avx512_bf16/AMX is emulated and several "
                "times slower than float32; dtype=auto would pick float32 here"
            )
        if setting == "bfloat16" and device.type == "cuda":
            major, minor = capability or cuda_capability(device)
            if (major, minor) < (8, 0):
                logger.warning(
                    "bfloat16 on a GPU of compute capability %d.%d is emulated (native from "
                    "8.0, Ampere): expect it to be much slower than float16",
                    major,
                    minor,
                )
        return _DTYPES[setting]
    if device.type == "cuda":
        if (capability or cuda_capability(device)) >= (8, 0):
            return torch.bfloat16
        if fp16_overflows:
            logger.warning(
                "dtype=auto: float32, since %s activations overflow float16 and this GPU has "
                "no native bfloat16",
                fp16_overflows,
            )
            return torch.float32
        return torch.float16
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


# What torch's CUDA, cuBLAS, cuDNN and NCCL errors say. After any of these the CUDA context is
# unusable (a device-side assert, an illegal memory access) or in doubt, and every later batch
# would fail too; out-of-memory is not among them: the next, smaller batch may well fit.
_FATAL_DEVICE_MARKERS = (
    "CUDA error",
    "CUBLAS_STATUS_",
    "CUDNN_STATUS_",
    "cuDNN error",
    "NCCL error",
    "device-side assert",
    "illegal memory access",
)


def fatal_device_error(error: BaseException) -> bool:
    """Whether ``error`` leaves the accelerator unusable for the rest of the process."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and any(m in message for m in _FATAL_DEVICE_MARKERS)
