"""What machine a benchmark ran on: hosts of one kind differ in CPU generation, and bfloat16 and
small-row matmul speeds differ with it, and in last-level cache: where it holds the model's weights
(480 MiB on one Xeon against the embedded model's 94 MiB; 32 MiB a Zen 4 CCD), a decode step reads
much of them from the cache, not from memory (docs/internals.md#steps-after-a-prompt). Compare
ratios within one run, never figures across runs."""

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
        "last_level_cache_mib": last_level_cache_mib(),
    }


def last_level_cache_mib(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> float | None:
    """The size of the first CPU's highest-level cache, in MiB (as sysfs gives it, e.g. "491520K");
    None where sysfs does not say."""
    found: dict[int, float] = {}
    for index in caches.glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(size[-1:].upper())
        if scale is not None and size[:-1].isdigit():
            found[level] = int(size[:-1]) * scale
    return found[max(found)] if found else None


def measure_read_bandwidth(megabytes: int | None = None, repeats: int = 7) -> float:
    """Bytes per second reading one large float32 tensor (median of repeats): the decode speed limit
    where the weights come from memory. By default 512 MiB, or twice the last-level cache where that
    is more: on a Xeon listing 480 MiB, 512 MiB read at 25-31 GB/s and 64 MiB at 49."""
    import torch

    megabytes = megabytes or max(512, round(2 * (last_level_cache_mib() or 0)))
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
