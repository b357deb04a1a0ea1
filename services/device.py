"""Which device the models run on, and the dtype that goes with it by default.

    resolve_device("cuda:1") -> "cuda:1"      resolve_device(None) -> AERIE_DEVICE, else "cuda" when
                                               a GPU is visible, else "cpu"
    default_dtype("cuda") -> "bf16"            default_dtype("cpu") -> "fp32"
    check_dtype("fp16", "cpu") -> InvalidRequest   (float16 runs on CUDA only)

A leaf module: torch is imported only to ask whether CUDA is available, so flag parsing stays light.
Names are validated here once (`cpu`, `cuda`, `cuda:N`); everything downstream takes the string.
"""

from __future__ import annotations

import os
import re

from services.errors import InvalidRequest

DEVICE_ENV = "AERIE_DEVICE"
_NAME = re.compile(r"^(cpu|cuda(:\d+)?)$")
DEVICE_HELP = ("cpu, cuda or cuda:N (AERIE_DEVICE; default: cuda when a GPU is visible, else cpu). "
               "on CUDA: paged KV, CUDA graphs, fused stages; tested on an H100 (docs/gpu.md)")


def check_device(name: str) -> str:
    """Validate a device name without touching any GPU."""
    value = name.strip().lower()
    if not _NAME.match(value):
        raise InvalidRequest(f"device must be cpu, cuda or cuda:N; got {name!r}")
    return value


def resolve_device(name: str | None = None) -> str:
    """The device to run on: `name`, else AERIE_DEVICE, else cuda when available, else cpu.
    A cuda device that is not there is a clear error, not a crash in the first forward."""
    if name is None or name == "":
        name = os.environ.get(DEVICE_ENV) or None
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    value = check_device(name)
    if value.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InvalidRequest(f"device {value!r} asked for, but torch sees no CUDA GPU "
                                 f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
        index = int(value.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise InvalidRequest(f"device {value!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
    return value


def is_gpu(device: str) -> bool:
    return device.startswith("cuda")


def default_dtype(device: str) -> str:
    """bf16 on a GPU (its tensor cores' native format), fp32 on the CPU (token-exact against
    transformers, and bf16 is no faster on this CPU: docs/design.md "Cheaper rounds")."""
    return "bf16" if is_gpu(device) else "fp32"


def check_dtype(dtype: str | None, device: str) -> None:
    """fp16 (--dtype float16 / half) runs on CUDA only. On the CPU it is refused, not mapped: PyTorch's
    CPU float16 matmuls are slower than float32, and a silent swap to another dtype would change the
    numbers the user asked for."""
    if dtype == "fp16" and not is_gpu(device):
        raise InvalidRequest(f"--dtype float16 runs on CUDA only (this device: {device}): PyTorch's CPU float16 "
                             f"matmuls are slower than float32's; pass --dtype auto (float32 on the CPU), "
                             f"bfloat16 or float32")


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device now (cudaMemGetInfo)."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def default_draft_dtype(device: str) -> str:
    """The draft head's precision when none is asked for: int8 dynamic linears on the CPU (docs/design.md
    "Cheaper rounds": a draft step ~4x cheaper on this CPU at the same agreement); torch's dynamic
    int8 kernels are CPU-only, so bf16 on a GPU."""
    return "bf16" if is_gpu(device) else "int8"


def free_memory_bytes(device: str) -> int:
    """Memory free for new allocations on `device` now: the GPU's free bytes (cudaMemGetInfo), or on
    the CPU the kernel's MemAvailable, lowered to what the process's cgroup (a pod's memory limit)
    still allows when it has a limit."""
    if is_gpu(device):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    try:  # cgroup v2: memory.max is "max" or bytes
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            free = min(free, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return free
