"""Matmul plans kept per host and model, so that one start decides as the last one did.

Measured afresh, a plan's choice between forms that run alike moves between starts of the same
server on an idle host (oneDNN packed 21 or 28 of the embedded target's 35 slots, and the
formulations of up to 8 slots changed, over six measurements: bench/results/plan_stability.json).
A ``PlanCache`` stores each measured plan under a key of what it was measured on: the CPU (its
model name and the instruction set torch dispatches to), the thread count, torch's version, the
weights' shapes and dtypes, which of them can be held as GGUF blocks, and the row counts. A start
whose key matches reads the stored plan instead of measuring; ``--matmul-plan measure`` measures
again and replaces it.

A plan timed while other processes had the cores is not stored (``MatmulPlan.disturbed``): its
timings are the scheduler's, not the products' (a plan measured beside a training job took 120-470 ms
for products of 5 ms, chose at random, and cut every later start's target-only speed to a third).
Plans stored before the share was recorded are measured again once.

``copy:auto``'s choice of draft copy is stored the same way, beside the target's plan
(``load_record``/``save_record``; engine/measure.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .matmul import CROSSING_ROWS, Key, MatmulPlan, busy

log = logging.getLogger(__name__)


def default_folder() -> Path:
    """$XDG_CACHE_HOME/specserve/matmul-plans (~/.cache/... where unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specserve" / "matmul-plans"


def digest(described: dict | list) -> str:
    """A short stable name for what a record is stored under (JSON-able values)."""
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True, slots=True)
class PlanCache:
    folder: Path
    remeasure: bool = False  # measure even where a stored plan matches, and store the new one

    @classmethod
    def configured(cls, mode: str, folder: str | None) -> PlanCache:
        return cls(Path(folder).expanduser() if folder else default_folder(), remeasure=mode == "measure")

    def key(self, shapes: list[Key], block_shapes: list[Key], max_rows: int) -> str:
        """A digest of the host and the weights a plan is measured on."""
        described = {
            "cpu": _cpu_name(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "shapes": sorted(_encode_key(key) for key in shapes),
            "blocks": sorted(_encode_key(key) for key in block_shapes),
            "max_rows": max_rows,
            "direct_rows_at": CROSSING_ROWS,  # plans from before block products' crossings were measured differ
        }
        return digest(described)

    def load(self, key: str) -> MatmulPlan | None:
        stored = self.load_record(key, "matmul plan")
        if stored is None:
            return None
        try:
            plan = MatmulPlan(stored["max_rows"], stored=stored.get("measured", "at an unknown time"))
            plan.cpu_share = stored["cpu_share"]
            plan.direct_rows = {str(key): int(rows) for key, rows in stored["direct_rows"].items()}
            for shape_rows, choice in stored["choices"]:
                plan.choices[_decode_key(shape_rows[:3]), shape_rows[3]] = choice
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("matmul plan %s is unreadable (%s); measuring again", self.folder / f"{key}.json", error)
            return None
        return plan

    def save(self, key: str, plan: MatmulPlan) -> None:
        stored = {
            "max_rows": plan.max_rows,
            "direct_rows": plan.direct_rows,
            "choices": [[[*_encode_key(shape), rows], choice] for (shape, rows), choice in plan.choices.items()],
            "timings_us": [
                [[*_encode_key(shape), rows], {name: round(us, 1) for name, us in timings.items()}]
                for (shape, rows), timings in plan.timings_us.items()
            ],
        }
        self.save_record(key, "matmul plan", stored, plan.cpu_share)

    def load_record(self, key: str, what: str) -> dict | None:
        """What was stored under ``key`` (a plan, or ``copy:auto``'s choice: engine/measure.py), with
        "measured" and "cpu_share"; None where measuring was asked for, nothing is stored, or what is
        stored is unreadable or does not say how busy the host was."""
        path = self.folder / f"{key}.json"
        if self.remeasure or not path.is_file():
            return None
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            log.warning("%s %s is unreadable (%s); measuring again", what, path, error)
            return None
        if not isinstance(stored, dict) or "cpu_share" not in stored:  # stored before busy hosts were kept out
            log.info("%s %s does not say how busy the host was; measuring again", what, path)
            return None
        log.info("%s read from %s (measured %s)", what, path, stored.get("measured", "?"))
        return stored

    def save_record(self, key: str, what: str, stored: dict, cpu_share: float | None) -> None:
        """Store ``stored`` under ``key``, unless it was timed on a busy host (``cpu_share``, the timing
        thread's share of the time, below matmul.UNDISTURBED_SHARE)."""
        path = self.folder / f"{key}.json"
        if busy(cpu_share):
            log.warning(
                "%s timed while its thread ran %.0f%% of the time (other processes had the cores): "
                "not stored; the next start measures again",
                what,
                100 * cpu_share,
            )
            # one stored before is there only where measuring was asked for (--matmul-plan measure):
            # dropped, so that the next start does measure again
            path.unlink(missing_ok=True)
            return
        stored = {
            "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpu_share": None if cpu_share is None else round(cpu_share, 3),
            **stored,
        }
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            temporary = self.folder / f"{key}.json.{os.getpid()}"
            temporary.write_text(json.dumps(stored) + "\n")
            temporary.replace(path)
        except OSError as error:  # a read-only home, say: measured again at each start
            log.warning("cannot store the %s in %s (%s)", what, self.folder, error)


def _encode_key(key: Key) -> list:
    out_features, in_features, dtype = key
    return [out_features, in_features, str(dtype).removeprefix("torch.")]


def _decode_key(encoded: list) -> Key:
    out_features, in_features, dtype = encoded
    return out_features, in_features, getattr(torch, dtype)
