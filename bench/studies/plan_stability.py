"""Study: how often does the matmul plan's choice move between starts? Answer: docs/internals.md#stored-plans.

How often the matmul plan's choice moves between starts, and what one row costs through each form.

Measures the embedded target's plan ``--starts`` times in one process (each measurement is what one
start of the server does), with the margin rule (engine/cpu/matmul.py: HELD_MARGIN, RETIMES) and without
it (a held form taken wherever its geometric mean is below 1, as before), with the GGUF blocks
offered and without, and (float32 only) starts that read the plan the first one stored. Reports the distinct plans seen and how many (shape, rows) slots differ from the
most common plan. Also times a 1-row product over every weight of the target in each form, for the
kernel's achieved read bandwidth against bench/host.py's bound. Writes bench/results/plan_stability.json.

    .venv/bin/python bench/studies/plan_stability.py --starts 8
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cpu import matmul  # noqa: E402
from engine.cpu.blocks import FileTensors, offer_blocks  # noqa: E402
from engine.cpu.matmul import MatmulPlan  # noqa: E402
from engine.cpu.plan_cache import PlanCache  # noqa: E402
from engine.factory import build_engine  # noqa: E402
from engine.model.loader import load  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def cached_plans(weights, starts: int, max_rows: int, folder: Path) -> dict:
    """Starts that read the plan the first one measured and stored (engine/cpu/plan_cache.py)."""
    cache = PlanCache(folder)
    plans = []
    for _ in range(starts):
        weights.use_plan(MatmulPlan())
        weights.plan_matmuls(max_rows, cache)
        plans.append(tuple(sorted((str(k), v) for k, v in weights.plan.choices.items())))
    weights.use_plan(MatmulPlan())
    return {"starts": starts, "distinct_plans": len(set(plans))}


def measure_plans(weights, starts: int, max_rows: int, margin: bool) -> dict:
    saved = matmul.HELD_MARGIN, matmul.RETIMES
    if not margin:
        matmul.HELD_MARGIN, matmul.RETIMES = 0.0, 0
    try:
        by_shape = weights.blocks_by_shape()
        plans = [MatmulPlan.measure(weights.linear_weights(), max_rows, blocks=by_shape).choices for _ in range(starts)]
    finally:
        matmul.HELD_MARGIN, matmul.RETIMES = saved
    keyed = [tuple(sorted((f"{k[0][0]}x{k[0][1]}", k[1], v) for k, v in plan.items())) for plan in plans]
    common, _ = collections.Counter(keyed).most_common(1)[0]
    held_per_start = [
        collections.Counter(v for v in plan.values() if v in matmul.HELD) for plan in plans
    ]  # slots held per form
    return {
        "starts": starts,
        "distinct_plans": len(set(keyed)),
        "slots_differing_from_the_most_common": [len(set(k) - set(common)) for k in keyed],
        "held_slots_per_start": [dict(counts) for counts in held_per_start],
    }


def one_row_sweep(weights, forms: dict) -> dict:
    """Milliseconds for a 1-row product over every weight, per form; blocks' read bandwidth."""
    out = {}
    for name, products in forms.items():
        x = {shape: torch.randn(1, shape) for shape in {p[1] for p in products}}
        best = float("inf")
        for _ in range(7):
            started = time.perf_counter()
            for product, in_features, _ in products:
                product(x[in_features])
            best = min(best, time.perf_counter() - started)
        out[name] = {"ms": round(best * 1e3, 2), "bytes": sum(p[2] for p in products)}
        out[name]["gb_s"] = round(out[name]["bytes"] / best / 1e9, 1)
    return out


def float32_product(weight: torch.Tensor):
    return lambda x: torch.nn.functional.linear(x, weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=8)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    args = parser.parse_args()
    config = EngineConfig(drafter="none", max_model_len=512)
    models = load(config)
    engine = build_engine(config, models.target, None, set())
    target = engine.target
    offer_blocks(target, FileTensors.read(models.target_file))
    weights = target.weights
    max_rows = args.num_draft_tokens + 2
    report = {"host": host(), "torch": torch.__version__, "blocks_line": weights.blocks_line}
    report["with_blocks"] = {
        "margin": measure_plans(weights, args.starts, max_rows, True),
        "no_margin": measure_plans(weights, args.starts, max_rows, False),
    }
    offered, weights.blocks = weights.blocks, {}
    with tempfile.TemporaryDirectory() as folder:
        report["float32_only"] = {
            "margin": measure_plans(weights, args.starts, max_rows, True),
            "no_margin": measure_plans(weights, args.starts, max_rows, False),
            "stored": cached_plans(weights, args.starts, max_rows, Path(folder)),
        }
    dense = [(float32_product(w), w.shape[1], w.nbytes) for w in (getattr(m, n) for m, n in weights.products)]
    held = [(b.linear, b.in_features, b.nbytes) for b in offered.values()]
    report["one_row_over_every_weight"] = one_row_sweep(weights, {"float32 F.linear": dense, "blocks": held})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_stability.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "host"}, indent=1))


if __name__ == "__main__":
    main()
