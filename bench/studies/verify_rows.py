"""Study: what does the target's forward cost by rows (a plain step, then a verify of 1 to 4 drafts), with
int8 and with float32 activations? Answer: docs/internals.md#products-that-ask-for-their-weights-ahead.

    .venv/bin/python bench/studies/verify_rows.py --label NAME   # adds a run to bench/results/verify_rows.json
    .venv/bin/python bench/studies/verify_rows.py --after-prompt --repeats 15

The embedded target, target-only, forwards of 1 to 5 new tokens with logits for every row (as a verify
computes them) after a context of 300 and of 1,000 random tokens, the row counts interleaved and each
forward rolled back, medians of ``--repeats``. Each run is kept under its label beside the commit and the
host, so two builds of engine/cpu/_blocks can be compared run against run: build one, run, build the
other, run, and alternate (the host drifts by 10% over minutes; compare within the alternation).
``--layers-apart`` calls a step's fused layers one by one from Python (as before specserve::decode_layers),
the other side of that comparison in one build.

``--after-prompt`` asks another question: what do the first decode steps after a prompt's read cost
(docs/internals.md#steps-after-a-prompt)? The int8 target reads a prompt of 8, 32 or 128 tokens, or
reads 32 tokens one by one (the control), or reads them one by one and then sums a float32 tensor twice
the host's last-level cache (other memory read through it); then 8 single-token steps, each timed.
The 128 are also read 16 at a time (the rows a decode kernel takes itself). Medians over ``--repeats``
rounds, by step and of the condition itself, the conditions taking turns; written to verify_rows.json
under "after a prompt", with the host (its last-level cache size among it).
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

from bench.host import host, last_level_cache_mib  # noqa: E402
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


def after_prompt_ms(target, repeats: int, steps: int = 8) -> dict[str, dict]:
    """By condition (``--after-prompt``): median milliseconds of each of ``steps`` single-token steps after it,
    and of the condition itself."""
    cache_mib = last_level_cache_mib() or 256
    elsewhere = torch.ones(int(2 * cache_mib * 2**20) // 4)  # [N] float32, twice the last-level cache
    conditions = {
        "after a prompt of 8": lambda: target.extend([100] * 8, num_logits=1),
        "after a prompt of 32": lambda: target.extend([100] * 32, num_logits=1),
        "after a prompt of 128": lambda: target.extend([100] * 128, num_logits=1),
        "after a prompt of 128 read 16 at a time": lambda: [target.extend([100] * 16, num_logits=1) for _ in range(8)],
        "after 32 single steps": lambda: [target.extend([100]) for _ in range(32)],
        "after 32 single steps, then reading other memory": lambda: (
            [target.extend([100]) for _ in range(32)],
            elsewhere.sum(),
        ),
    }
    times: dict[str, list[list[float]]] = {name: [[] for _ in range(steps + 1)] for name in conditions}
    for _ in range(repeats):
        for name, condition in conditions.items():
            target.cache.rollback(0)
            started = time.perf_counter()
            condition()
            times[name][steps].append(time.perf_counter() - started)  # the condition itself, last
            for step in range(steps):
                started = time.perf_counter()
                target.extend([200 + step])
                times[name][step].append(time.perf_counter() - started)
    target.cache.rollback(0)
    medians = {name: [round(statistics.median(spent) * 1e3, 2) for spent in by_step] for name, by_step in times.items()}
    return {name: {"steps": by_step[:-1], "condition": by_step[-1]} for name, by_step in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", help="what this build is (a commit, a change's name); not with --after-prompt")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--layers-apart", action="store_true", help="one decode_layer call a layer, not decode_layers")
    parser.add_argument("--after-prompt", action="store_true", help="the first steps after a prompt's read")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    if not args.after_prompt and not args.label:
        parser.error("--label is required: what this build is")
    if args.after_prompt:
        target = load_engine(EngineConfig(drafter="none", activations="int8"), show_progress=False).engine.target
        results = after_prompt_ms(target, args.repeats)
        for name, measured in results.items():
            print(f"{name:>50}: {measured}", flush=True)
        kept = json.loads(RESULT.read_text())
        kept["after a prompt"] = {"host": host(), "commit": commit.strip(), "repeats": args.repeats, "ms": results}
        RESULT.write_text(json.dumps(kept, indent=2) + "\n")
        return
    run: dict = {
        "label": args.label,
        "commit": commit.strip(),
        "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": host(),  # hosts differ from run to run: the file's own host is its first runs'
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
