"""Study: what does the eager forward around the products cost, C++ ops against torch's? Answer: docs/internals.md.

What the eager forward around the products costs, with engine/cpu/csrc's ops and with torch's.

Loads the embedded target as the server does (its products through the GGUF blocks where the plan
keeps them), then times a decode step (one token) and a verify (k + 1 = 5 tokens) at a window of
about 200 positions, alternating three forms round by round so host noise hits all alike:
``layers`` (what serving runs: each decoder layer one specserve::decode_layer call), ``ops`` (the
same ops of engine/cpu/csrc called one by one from Python: norms, rotation into the cache, decode
attention) and ``torch`` (torch's eager ops, as a compiled forward traces them). Also splits a
served decode step by op with torch's profiler, and times the served forward over 1..8 rows with
the shipped EAGLE-3 head's step: the line through them, a step's fixed cost plus a cost per row,
bounds what any chain of drafts can gain here (``ceiling``: the best speedup over k at each
per-token acceptance, drafting at the head's step and for free); one Q4_1 product over 1..8
rows, for what a row past the first costs the kernel; and the embedding lookup (the tied head's
blocks, by specserve::blocks_rows) against decoding each token's whole repacked group of 16 rows
and picking its row, as BlockWeight.rows did before. Writes bench/results/native_ops.json.

    .venv/bin/python bench/studies/native_ops.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from engine.adaptive import expected_tokens  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.measure import fitted_line  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
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


def ceiling(step_ms: dict[int, float], draft_ms: float) -> dict:
    """The best speedup over target-only that any chain of k drafts (k + 1 <= the rows timed) gives
    at per-token acceptance alpha, when a forward over n rows costs step_ms[n] and each draft
    draft_ms: expected tokens (1 - alpha^(k+1)) / (1 - alpha) per step_ms[k + 1] + k * draft_ms,
    against one token per step_ms[1]."""
    table = {}
    for alpha in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        speedup, k = max(
            (expected_tokens(alpha, k) * step_ms[1] / (step_ms[k + 1] + k * draft_ms), k)
            for k in range(1, max(step_ms))
        )
        table[str(alpha)] = {"speedup": round(speedup, 2), "k": k}
    return table


def row_sweep(target, head_step_ms: float, rounds: int, repeats: int) -> dict:
    """The served forward over 1..8 rows at WINDOW (row counts in turn, reversed every other round),
    the least-squares line through it, and the ceiling its times set."""
    rows = list(range(1, 9))
    times: dict[int, list[float]] = {n: [] for n in rows}
    for round_index in range(rounds):
        for n in rows if round_index % 2 == 0 else reversed(rows):
            times[n].append(step_ms(target, n, repeats))
    return row_report({n: statistics.median(values) for n, values in times.items()}, head_step_ms)


def row_report(medians: dict[int, float], head_step_ms: float) -> dict:
    """Median ms of a forward over 1..8 rows -> those times, the least-squares line through them
    (a step's fixed cost plus a cost per row), and the ceiling they set."""
    line = fitted_line([medians[n] for n in range(1, 9)])  # at 1..8 rows
    per_row = line[1] - line[0]
    return {
        "ms_by_rows": {str(n): round(ms, 2) for n, ms in medians.items()},
        "fixed_ms": round(line[0] - per_row, 2),
        "per_row_ms": round(per_row, 2),
        "head_step_ms": round(head_step_ms, 2),
        # drafts at the head's step, and free ones (text matching proposes at next to no cost)
        "ceiling": {"eagle3_head": ceiling(medians, head_step_ms), "free_drafts": ceiling(medians, 0.0)},
    }


def kernel_rows(repeats: int = 50) -> dict:
    """One Q4_1 product the shape of a layer's gate and up ([3072, 576], random weights, cache-warm)
    over 1..8 rows: microseconds and billions of multiply-adds a second, and what a row past the
    first adds, at this process's threads."""
    import gguf
    import numpy as np

    from engine.cpu.blocks import FORMATS, kernel_isa

    out_features, in_features = 3072, 576
    weights = np.random.default_rng(0).standard_normal((out_features, in_features)).astype(np.float32) * 0.02
    blocks = torch.from_numpy(gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1))
    isa, micros = kernel_isa(), {}
    for rows in range(1, 9):
        x, out = torch.randn(rows, in_features), torch.empty(rows, out_features)

        def product(x=x, out=out) -> None:
            torch.ops.specserve.blocks_times(x, blocks, FORMATS["Q4_1"], in_features, isa, out)

        for _ in range(10):
            product()
        timings = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(repeats):
                product()
            timings.append((time.perf_counter() - started) / repeats)
        micros[rows] = 1e6 * statistics.median(timings)
    per_row = (micros[5] - micros[1]) / 4
    return {
        "us_by_rows": {str(n): round(us, 1) for n, us in micros.items()},
        "gfma_per_s_by_rows": {str(n): round(n * out_features * in_features / us / 1e3, 1) for n, us in micros.items()},
        "gfma_per_s_of_a_row_past_the_first": round(out_features * in_features / per_row / 1e3, 1),
    }


def embedding_rows(target, rounds: int, repeats: int = 200) -> dict:
    """Microseconds of the embedding lookup of 1 and 200 random ids, served (one row decoded each)
    against the whole group decoded and the row picked, the forms alternating round by round; the
    rows must be the same."""
    from engine.cpu.blocks import INT8_FORMATS, INT8_ROWS, BlockPart, decode

    weights = target.weights
    table = weights.prepared.get(weights._tied)  # the tied LM head's blocks, where the table was freed
    if table is None or table.parts[0].format not in INT8_FORMATS:
        return {"skipped": "no repacked tied head here"}
    (part,) = table.parts

    def by_group(ids: torch.Tensor) -> torch.Tensor:
        decoded = decode(BlockPart(part.blocks[ids // INT8_ROWS], part.format), table.in_features, table.isa)
        return decoded.view(-1, INT8_ROWS, table.in_features)[torch.arange(ids.shape[0]), ids % INT8_ROWS]

    report = {}
    with torch.inference_mode():
        for count in (1, 200):
            ids = torch.randint(0, table.out_features, (count,), generator=torch.Generator().manual_seed(count))
            assert torch.equal(weights.embedding_rows(ids), by_group(ids))
            times: dict[str, list[float]] = {"rows": [], "whole_group": []}
            for _ in range(rounds):
                for form, lookup in (("rows", weights.embedding_rows), ("whole_group", by_group)):
                    started = time.perf_counter()
                    for _ in range(repeats):
                        lookup(ids)
                    times[form].append(1e6 * (time.perf_counter() - started) / repeats)
            report[f"{count}_ids_us"] = {form: round(statistics.median(values), 1) for form, values in times.items()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    engine = load_engine(EngineConfig(max_model_len=1024, drafter="eagle3", draft=None), show_progress=False).engine
    target = engine.target
    head_step_ms = 1000 * engine.drafter("eagle3").own_costs().step_seconds
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
        "served_rows": row_sweep(target, head_step_ms, args.rounds, args.repeats),
        "kernel_rows": kernel_rows(),
        "embedding_rows": embedding_rows(target, args.rounds),
        "rounds": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "native_ops.json").write_text(json.dumps(report, indent=2) + "\n")
    shown = ("median_ms", "over_layers", "served_decode_split", "served_rows", "kernel_rows", "embedding_rows")
    print(json.dumps({key: report[key] for key in shown}, indent=2))


if __name__ == "__main__":
    main()
