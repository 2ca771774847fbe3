"""Timing a forward on its device: the one helper the graph runner, auto's start-up prices and the
benchmarks share."""

from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``fn`` (after one untimed call), waiting for
    ``device`` around each."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
