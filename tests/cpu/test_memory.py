"""engine/cpu/memory.py's readings of the process's resident memory, as the start-up line and /metrics
give them: the peak is the process's own, not the parent's it was forked from."""

from __future__ import annotations

import subprocess
import sys

from engine.cpu.memory import peak_resident_bytes, resident_bytes
from tests.conftest import REPO

# A parent that holds 1 GB resident, then starts a Python that reads its own peak. On Linux
# ru_maxrss keeps the high-water mark of the image exec replaced (the forked copy of the parent),
# so a reading from it says about 1 GB; the child's own is tens of MB.
PARENT = """
import subprocess, sys
held = bytearray(1 << 30)
held[:: 4096] = b"x" * len(held[:: 4096])  # every page touched: resident
child = "from engine.cpu.memory import peak_resident_bytes; print(peak_resident_bytes())"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
"""


def test_the_peak_is_the_processs_own_not_its_forked_parents():
    result = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, cwd=REPO, check=True)
    assert int(result.stdout) < 300 * 2**20, result.stdout  # a bare Python with this module: well under 1 GB


def test_resident_now_is_at_most_the_peak_and_grows_with_what_is_held():
    before = resident_bytes()
    held = bytearray(64 << 20)
    held[::4096] = b"x" * len(held[::4096])
    assert before is not None and resident_bytes() >= before + 60 * 2**20
    assert resident_bytes() <= peak_resident_bytes()
