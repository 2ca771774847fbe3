"""What the eager forward around the products costs, with engine/csrc's ops and with torch's.

Loads the embedded target as the server does (its products through the GGUF blocks where the plan
keeps them), then times a decode step (one token) and a verify (k + 1 = 5 tokens) at a window of
about 200 positions, alternating three forms round by round so host noise hits all alike:
``layers`` (what serving runs: each decoder layer one specserve::decode_layer call), ``ops`` (the
same ops of engine/csrc called one by one from Python: norms, rotation into the cache, decode
attention) and ``torch`` (torch's eager ops, as a compiled forward traces them). Also splits a
served decode step by op with torch's profiler. Writes bench/results/native_ops.json.

    .venv/bin/python bench/native_ops.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.host import host  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WINDOW = 200  # cache positions before the timed tokens


def step_ms(target, num_tokens: int, repeats: int) -> float:
    """Median milliseconds of an extend over ``num_tokens`` at WINDOW positions (rolled back after each)."""
    times = []
    for _ in range(repeats):
        target.cache.rollback(WINDOW)
        started = time.perf_counter()
        target.extend([42] * num_tokens, num_logits=num_tokens)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def op_split(target, steps: int = 30) -> dict:
    """Milliseconds per decode step by op (self time): the fused layers (their products inside), the
    products outside them (the LM head), and the rest."""
    with torch.profiler.profile() as profile:
        for _ in range(steps):
            target.cache.rollback(WINDOW)
            target.extend([42])
    ops = {event.key: event.self_cpu_time_total / 1000 / steps for event in profile.key_averages()}
    products = sum(ms for name, ms in ops.items() if "blocks_times" in name or name in ("aten::mm", "aten::addmm"))
    top = sorted(ops.items(), key=lambda item: -item[1])[:8]
    return {
        "layers_ms": round(ops.get("specserve::decode_layer", 0.0), 2),
        "products_outside_layers_ms": round(products, 2),
        "all_ops_ms": round(sum(ops.values()), 2),
        "top_ops_ms": {name: round(ms, 3) for name, ms in top},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    target = load_engine(EngineConfig(max_model_len=1024, drafter="none"), show_progress=False).engine.target
    target.cache.rollback(0)
    target.extend(list(range(100, 100 + WINDOW)), num_logits=0)
    layer_products = target._layer_products
    forms = {"layers": (True, layer_products), "ops": (True, [None] * len(layer_products)), "torch": (False, None)}
    results: dict[str, dict[str, list[float]]] = {form: {"decode": [], "verify": []} for form in forms}
    for _ in range(args.rounds):
        for form, (native, products) in forms.items():
            target.use_kernels("eager", native=native)
            target._layer_products = products or layer_products
            results[form]["decode"].append(step_ms(target, 1, args.repeats))
            results[form]["verify"].append(step_ms(target, 5, args.repeats))
    target.use_kernels("eager")
    target._layer_products = layer_products
    summary = {
        form: {shape: round(statistics.median(values), 2) for shape, values in shapes.items()}
        for form, shapes in results.items()
    }
    report = {
        "host": host(),
        "model": "embedded SmolLM2-135M-Instruct (GGUF blocks where the plan keeps them)",
        "products": target.weights.describe(),
        "window": WINDOW,
        "median_ms": summary,
        "over_layers": {
            form: {shape: round(summary[form][shape] / summary["layers"][shape], 2) for shape in ("decode", "verify")}
            for form in ("ops", "torch")
        },
        "served_decode_split": op_split(target),
        "rounds": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "native_ops.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({key: report[key] for key in ("median_ms", "over_layers", "served_decode_split")}, indent=2))


if __name__ == "__main__":
    main()
