"""Study: what does the matmul plan measure on this host? Answer: docs/internals.md#the-matmul-plan.

What the engine's MatmulPlan measures on this host, on the embedded model's own weights.

    .venv/bin/python bench/studies/matmul.py            # writes bench/results/matmul.json

For the float32 target and its bfloat16 copy: every weight shape at 1..6 rows (decode and a k = 4
verify) and at LONG_ROWS rows (prompts), each formulation's time over a cache-spilling group of
that shape's weights, and the choice. Then one 1-token step and one 5-token verify with the plan,
with the plan's best BLAS formulation wherever it packed weights for oneDNN ("plan, unpacked"), and
with plain ``F.linear``, interleaved, medians, and one 1,500-token prompt each way (a draft's
catch-up on a long prompt). The host is recorded beside them.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for bench.host
from bench.host import host  # noqa: E402
from engine.config import EngineConfig
from engine.cpu.matmul import LONG, PACKED, MatmulPlan
from engine.model.loader import load
from engine.model.model import CausalLM

MAX_ROWS = 6


def step_ms(lm: CausalLM, plans: dict[str, MatmulPlan], num_new: int, repeats: int = 15) -> dict[str, float]:
    context = lm.cache.length
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(repeats):
        for name, plan in plans.items():
            lm.weights.use_plan(plan)  # packs or unpacks weights: untimed
            started = time.perf_counter()
            lm.extend(list(range(2000, 2000 + num_new)), num_logits=num_new)
            times[name].append(time.perf_counter() - started)
            lm.cache.rollback(context)
    return {name: round(statistics.median(values) * 1e3, 2) for name, values in times.items()}


def unpacked(plan: MatmulPlan) -> MatmulPlan:
    """``plan`` with each PACKED choice replaced by the fastest other formulation measured there."""
    choices = dict(plan.choices)
    for slot, timings in plan.timings_us.items():
        if choices[slot] == PACKED:
            choices[slot] = min((name for name in timings if name != PACKED), key=timings.__getitem__)
    return MatmulPlan(plan.max_rows, choices, plan.timings_us)


def main() -> None:
    models = load(EngineConfig(draft="copy:bfloat16", max_model_len=2048))
    report: dict = {"host": host(), "models": {}}
    for role, hf_model in (("target float32", models.target), ("draft bfloat16", models.draft)):
        lm = CausalLM(hf_model, 2048)
        started = time.perf_counter()
        plan = lm.weights.plan_matmuls(MAX_ROWS)
        seconds = time.perf_counter() - started
        cases = [
            {
                "shape": list(key[:2]),
                "rows": rows or f"long ({LONG} slot)",
                "us": {name: round(us) for name, us in timings.items()},
                "choice": plan.choices[key, rows],
            }
            for (key, rows), timings in plan.timings_us.items()
        ]
        lm.extend(list(range(1000, 1200)))  # 200 tokens of context
        plans = {"plan": plan, "plan, unpacked": unpacked(plan), "F.linear": MatmulPlan()}
        steps = {f"{n} tokens": step_ms(lm, plans, n) for n in (1, 5)}
        steps["prompt of 1,500 tokens"] = {}
        for name, chosen in plans.items():
            lm.weights.use_plan(chosen)
            lm.cache.rollback(0)
            started = time.perf_counter()
            lm.extend(list(range(1000, 2500)))
            steps["prompt of 1,500 tokens"][name] = round((time.perf_counter() - started) * 1e3, 1)
        lm.weights.use_plan(plan)
        report["models"][role] = {
            "measure_s": round(seconds, 2),
            "plan": plan.describe(),
            "cases": cases,
            "steps_ms": steps,
        }
        print(f"{role}: {plan.describe()} in {seconds:.1f} s; steps ms {steps}")
    out = Path(__file__).resolve().parents[1] / "results" / "matmul.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
