"""Study: how long does the suffix drafter's lookup take at 4k tokens with a full cache? Answer: docs/benchmarks.md.

How long the suffix drafter's lookup takes: a 4k-token context with a full shared cache.

    .venv/bin/python bench/studies/suffix.py [--context 4096] [--cached-requests 64] [--output-tokens 1024]

The text is drawn from a small vocabulary with repeated phrases, so matches are long and frequent,
which is the drafter's slow case. Writes bench/results/suffix.json with the host it ran on.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH.parent))
from bench.host import host  # noqa: E402
from engine.drafters.suffix import SuffixDrafter  # noqa: E402
from engine.outputs import OutputCache  # noqa: E402


def text(rng: random.Random, length: int, phrases: list[list[int]]) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < length:
        tokens += (
            rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(5000) for _ in range(rng.randrange(1, 6))]
        )
    return tokens[:length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--cached-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(BENCH / "results" / "suffix.json"))
    args = parser.parse_args()
    import torch

    rng = random.Random(0)
    phrases = [[rng.randrange(5000) for _ in range(rng.randrange(4, 24))] for _ in range(300)]
    cache = OutputCache(args.cached_requests)
    started = time.perf_counter()
    for _ in range(args.cached_requests):
        cache.add("tenant", text(rng, args.output_tokens, phrases))
    fill_seconds = time.perf_counter() - started
    drafter = SuffixDrafter(torch.device("cpu"), cache)
    sequence = text(rng, args.context, phrases)
    drafter.begin(sequence[:-1], tenant="tenant")
    started = time.perf_counter()
    drafter.propose(sequence, 8, None)  # indexes the whole context once
    first_step = time.perf_counter() - started
    steps, drafted = [], 0
    for _ in range(args.steps):
        sequence = sequence + text(rng, rng.randrange(1, 6), phrases)  # what the last step committed
        started = time.perf_counter()
        proposal = drafter.propose(sequence, 8, None)
        steps.append(time.perf_counter() - started)
        drafted += proposal.token_ids.numel()
    report = {
        "host": host(bandwidth=False),
        "context_tokens": args.context,
        "cache": cache.stats,
        "cache_fill_seconds": round(fill_seconds, 3),
        "first_step_ms (indexes the context)": round(first_step * 1e3, 2),
        "step_ms_median": round(statistics.median(steps) * 1e3, 3),
        "step_ms_p99": round(sorted(steps)[int(0.99 * len(steps))] * 1e3, 3),
        "mean_drafted_tokens": round(drafted / args.steps, 2),
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
