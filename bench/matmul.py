"""Guard the LM-head formulation in engine/model.py: one ``F.linear`` vs vocabulary slices, by row count.

    .venv/bin/python bench/matmul.py            # writes bench/results/matmul.json

The weight is read from memory, not cache (a large buffer is touched between repeats), as in a
real forward. If slices stop winning at LM_HEAD_SLICE_MIN_ROWS rows or more, change the constants.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model import LM_HEAD_SLICE, LM_HEAD_SLICE_MIN_ROWS, sliced_linear


def median_ms(fn, evict: torch.Tensor, repeats: int = 9) -> float:
    times = []
    for _ in range(repeats):
        evict.add_(1)  # push the weight out of the caches
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    torch.manual_seed(0)
    weight = torch.randn(49152, 576)  # SmolLM2's tied embedding / LM head  # [V, E]
    evict = torch.zeros(64 * 2**20)
    rows = {}
    for num_rows in range(1, 10):
        x = torch.randn(num_rows, 576)  # [N, E]
        whole = median_ms(lambda x=x: F.linear(x, weight), evict)
        sliced = median_ms(lambda x=x: sliced_linear(x, weight, None, LM_HEAD_SLICE), evict)
        rows[num_rows] = {"linear_ms": round(whole, 2), "sliced_ms": round(sliced, 2)}
        print(f"{num_rows} rows: linear {whole:6.2f} ms  sliced {sliced:6.2f} ms")
    chosen_ok = all(
        (r["sliced_ms"] <= r["linear_ms"]) == (n >= LM_HEAD_SLICE_MIN_ROWS)
        or abs(r["sliced_ms"] - r["linear_ms"]) < 1.0
        for n, r in rows.items()
    )
    report = {"slice": LM_HEAD_SLICE, "slice_min_rows": LM_HEAD_SLICE_MIN_ROWS, "rows": rows, "choice_holds": chosen_ok}
    out = Path(__file__).parent / "results" / "matmul.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"choice holds: {chosen_ok}; wrote {out}")


if __name__ == "__main__":
    main()
