"""Study: what do the block products give a CPU without AVX-512, per instruction set? Answer: docs/internals.md#int8-activations.

What a CPU without AVX-512 gets from the block products: every GGUF block product of one forward
of the embedded target, with float32 and with int8 activations, through each instruction set the
kernels have (engine/cpu/csrc: portable, AVX2, AVX-512; int8 through AVX-512 VNNI), forced on this host.

A host with AVX-512 runs the AVX2 code as an AVX2-only host would, at its own clock and bandwidth,
so compare paths within one run. Rows 1, 4 and 8 (a decode step, verifies); the paths alternate
within each round; medians over the rounds. The portable int8 path, a scalar loop, is timed at 1
row only. Writes bench/results/int8_paths.json.

    .venv/bin/python bench/studies/int8_paths.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cpu.blocks import ISAS, BlockWeight, kernel_isa  # noqa: E402
from engine.factory import load_engine  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
ROWS = (1, 4, 8)


def forward_products(weights: list[BlockWeight], rows: int) -> float:
    """ms to multiply ``rows`` random rows by every weight once."""
    inputs = {w.in_features: torch.randn(rows, w.in_features) for w in weights}
    started = time.perf_counter()
    for weight in weights:
        weight.linear(inputs[weight.in_features])
    return 1000 * (time.perf_counter() - started)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    paths: dict[str, list[BlockWeight]] = {}
    for activations in ("float32", "int8"):
        engine = load_engine(EngineConfig(max_model_len=512, activations=activations), show_progress=False).engine
        held = [w for w in engine.target.weights.prepared.values() if isinstance(w, BlockWeight)]
        for isa in range(kernel_isa() + 1):
            if activations == "float32" and isa == 0:
                continue  # the float32 kernels' portable reference: a test oracle, never chosen on x86
            paths[f"{activations} {ISAS[isa]}"] = [replace(w, isa=isa) for w in held]
    cases = [(name, rows) for name in paths for rows in ROWS if not (name == "int8 portable" and rows > 1)]
    times: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    for name, rows in cases:
        forward_products(paths[name], rows)  # untimed: first-call costs
    for round_index in range(args.rounds):
        for name, rows in cases if round_index % 2 == 0 else reversed(cases):
            times[name, rows].append(forward_products(paths[name], rows))
    table = {
        name: {str(rows): round(statistics.median(times[name, rows]), 2) for n, rows in cases if n == name}
        for name in paths
    }
    for name, by_rows in table.items():
        print(f"{name}: {by_rows} ms")
    out = RESULTS / "int8_paths.json"
    report = {
        "host": host(),
        "model": "embedded SmolLM2-135M-Instruct, every GGUF block product of one forward (121)",
        "settings": vars(args),
        "ms_by_path_and_rows": table,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
