"""Handing memory that start-up freed back to the system.

glibc keeps freed heap pages mapped (and raises its threshold for giving large blocks their own
maps after each one is freed), so what a start-up stage builds and drops stays resident: a
float32 copy that became blocks, a tokenizer's conversion, a copy copy:auto timed and let go.
Trimming after each such stage keeps the next stage's temporaries from stacking on top of them,
which is what sets the peak.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys
from pathlib import Path


def release_freed_memory() -> None:
    """Collect garbage, then return the allocator's free pages to the system (Linux; else nothing)."""
    gc.collect()
    return_free_pages()


def return_free_pages() -> None:
    """The allocator's free pages back to the system, without collecting (microseconds, not the
    tenth of a second a collection takes): between timings whose temporaries the next would stack on."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_bytes() -> int | None:
    """This process's resident memory now (VmRSS, from /proc/self/statm); None where there is no /proc."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])  # size, resident, ... in pages
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def high_water_bytes(pid: int | str = "self") -> int | None:
    """The most a process has held resident since it began, or since its clear_refs was last reset:
    its memory's high-water mark (VmHWM in /proc/PID/status); None where there is none to read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(status.split("VmHWM:", 1)[1].split()[0]) * 1024  # "VmHWM:   474476 kB"
    except (OSError, IndexError, ValueError):
        return None


def peak_resident_bytes() -> int:
    """The most this process has held resident: its memory's high-water mark (Linux), else ru_maxrss.
    Not ru_maxrss on Linux: it keeps the high-water mark of the image the process replaced at exec, a
    forked copy of its parent, so a server a 2 GB process started said 2 GB."""
    peak = high_water_bytes()
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux kB
