"""Study: what does the target's forward cost by rows (a plain step, then a verify of 1 to 4 drafts), with
int8 and with float32 activations? Answer: docs/internals.md#products-that-ask-for-their-weights-ahead.

    .venv/bin/python bench/studies/verify_rows.py --label NAME   # adds a run to bench/results/verify_rows.json

The embedded target, target-only, forwards of 1 to 5 new tokens with logits for every row (as a verify
computes them) after a context of 300 and of 1,000 random tokens, the row counts interleaved and each
forward rolled back, medians of ``--repeats``. Each run is kept under its label beside the commit and the
host, so two builds of engine/cpu/_blocks can be compared run against run: build one, run, build the
other, run, and alternate (the host drifts by 10% over minutes; compare within the alternation).
``--layers-apart`` calls a step's fused layers one by one from Python (as before specserve::decode_layers),
the other side of that comparison in one build.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository, for bench.host and the engine

from bench.host import host  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402

RESULT = ROOT / "bench" / "results" / "verify_rows.json"


def forward_ms(target, context: int, repeats: int) -> dict[int, float]:
    """Median milliseconds of a forward over T = 1..5 new tokens at ``context``, logits for every row."""
    generator = torch.Generator().manual_seed(0)
    target.cache.rollback(0)
    target.extend(torch.randint(100, 40000, (context,), generator=generator).tolist(), num_logits=1)
    times: dict[int, list[float]] = {rows: [] for rows in range(1, 6)}
    for _ in range(repeats):
        for rows in times:
            tokens = torch.randint(100, 40000, (rows,), generator=generator).tolist()
            started = time.perf_counter()
            target.extend(tokens, num_logits=rows)
            times[rows].append(time.perf_counter() - started)
            target.cache.rollback(context)
    return {rows: round(statistics.median(spent) * 1e3, 3) for rows, spent in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="what this build is (a commit, a change's name)")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--layers-apart", action="store_true", help="one decode_layer call a layer, not decode_layers")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    run: dict = {
        "label": args.label,
        "commit": commit.strip(),
        "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for activations in ("int8", "float32"):
        loaded = load_engine(EngineConfig(drafter="none", activations=activations), show_progress=False)
        target = loaded.engine.target
        if args.layers_apart:  # the step's layers called one by one from Python, as before decode_layers
            target._stack.run = lambda *_: None
        run[activations] = {f"context {context}": forward_ms(target, context, args.repeats) for context in (300, 1000)}
        print(args.label, activations, run[activations], flush=True)
        del loaded, target
    kept = json.loads(RESULT.read_text()) if RESULT.exists() else {"host": host(), "runs": []}
    kept["runs"].append(run)
    RESULT.write_text(json.dumps(kept, indent=2) + "\n")


if __name__ == "__main__":
    main()
