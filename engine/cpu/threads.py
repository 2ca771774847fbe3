"""How many CPU threads the engine may use, and how long its thread team spins while it waits.

torch counts the host's cores. A container's CPU quota, a narrowed affinity mask, or a second
replica on the same cores make that count wrong; and an OpenMP team that spins while it waits
holds cores another process needs, so two processes on the same cores slow each other down far
more than sharing alone would. So the thread count follows the CPUs this process may really use,
and the team spins briefly before it sleeps: 3,000 spins, some 40-80 microseconds, long enough to
bridge most gaps between a step's parallel regions (waking a worker that slept cost 40-80
microseconds on this project's machine, and a step crosses dozens of such gaps), too short to hold
cores through the gaps between steps or requests (measured in docs/deployment.md, "Threads").
"""

from __future__ import annotations

import math
import os
from pathlib import Path

SPIN_COUNT = "3000"
CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP) -> float | None:
    """CPUs allowed by the cgroup quota (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may really use: its affinity mask, capped by the cgroup quota."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    if limit is not None:
        count = min(count, max(1, math.ceil(limit)))
    return max(1, count)


def set_wait_policy() -> None:
    """Before torch is imported (OpenMP reads these once): a short spin, then sleep, unless the user
    chose a policy of their own. GOMP_* is GNU OpenMP (torch's CPU wheels), KMP_* Intel's (in ms)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
        os.environ.setdefault("KMP_BLOCKTIME", "1")


def set_threads(count: int) -> None:
    """Intra-op threads for this process; call it in the thread that will run the forward passes."""
    import torch

    torch.set_num_threads(count)
