"""What machine a benchmark ran on: hosts of one kind differ in CPU generation, and bfloat16 and
small-row matmul speeds differ with it. Compare ratios within one run, never figures across runs."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "avx512_vp2intersect")


def cpu() -> dict:
    """CPU model, vendor, family and the flags that decide which kernels run."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break  # the first processor describes them all
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "vendor": fields.get("vendor_id"),
        "family": fields.get("cpu family"),
        "model_number": fields.get("model"),
        "flags": [flag for flag in FLAGS_OF_INTEREST if flag in flags],
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def measure_read_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
    """Bytes per second reading one large float32 tensor (median of repeats): the decode speed limit."""
    import torch

    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - started)
    return data.nbytes / sorted(seconds)[len(seconds) // 2]


def host(bandwidth: bool = True) -> dict:
    import torch

    info = {"cpu": cpu(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if bandwidth:
        info["read_bandwidth_gb_s"] = round(measure_read_bandwidth() / 1e9, 2)
    return info
