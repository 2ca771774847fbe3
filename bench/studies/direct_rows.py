"""Study: how many rows should a block product send through its own kernel? Answer: docs/internals.md#gguf-blocks.

Where a GGUF block product stops going through its own kernel: at DIRECT_ROWS (16) rows, as
before, or at the row count measured per weight shape on this host (``with_direct_rows``,
engine/cpu/matmul.py), side by side in one process on the embedded target and its shipped EAGLE-3 head.

Prints the rows measured per shape, then times, the two settings alternated: the target reading a
prompt of 24 to 500 tokens after 100 cached ones (a follow-up turn, a tool result, a document), and
the head's step over 1 to 64 tokens (its catch-up after a run of another drafter, or a probe after
steps without drafting). Writes bench/results/direct_rows.json.

    .venv/bin/python bench/studies/direct_rows.py
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
from engine.cpu.blocks import DIRECT_ROWS, BlockWeight  # noqa: E402
from engine.factory import load_engine  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
PROMPT_TOKENS = (24, 48, 96, 200, 500)
HEAD_ROWS = (1, 8, 16, 24, 32, 48, 64)
CACHED = 100  # tokens already in the target's cache before a prompt is read


def settings(held: dict) -> dict[str, dict]:
    """``held`` (BlockWeights by key) as measured, and with every direct_rows back at DIRECT_ROWS."""
    fixed = {key: replace(w, direct_rows=DIRECT_ROWS) if isinstance(w, BlockWeight) else w for key, w in held.items()}
    return {"measured": dict(held), "16 rows": fixed}


def timed_ms(run, size: int, repeats: int) -> float:
    """Best ms of ``repeats`` calls of run(size)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run(size)
        best = min(best, time.perf_counter() - started)
    return 1000 * best


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two settings")
    args = parser.parse_args()
    engine = load_engine(EngineConfig(max_model_len=2048), show_progress=False).engine
    target, head = engine.target, engine.drafter("eagle3").head
    crossings = {
        "target": dict(target.weights.plan.direct_rows),
        "head": {name: weight.direct_rows for name, weight in head.blocks.items()},
    }
    print("rows through the kernel:", crossings, flush=True)
    target_forms, head_forms = settings(target.weights.prepared), settings(head.blocks)
    token_ids = [(17 * i) % 20000 + 100 for i in range(CACHED + max(PROMPT_TOKENS))]
    features = torch.randn(max(HEAD_ROWS), head.fc.in_features)  # [T, A*E]

    def read_prompt(length: int) -> None:
        target.cache.rollback(CACHED)
        target.extend(token_ids[CACHED : CACHED + length], num_logits=1)

    def head_step(rows: int) -> None:
        head.cache.rollback(CACHED)
        head.step(token_ids[:rows], head.fuse(features[:rows]))

    target.extend(token_ids[:CACHED], num_logits=1)
    head.step(token_ids[:CACHED], head.fuse(torch.randn(CACHED, head.fc.in_features)))
    cases = [("prompt", n, read_prompt) for n in PROMPT_TOKENS] + [("head step", n, head_step) for n in HEAD_ROWS]
    times = {(kind, n, name): [] for kind, n, _ in cases for name in target_forms}
    for round_index in range(args.rounds):
        for name in target_forms if round_index % 2 == 0 else reversed(list(target_forms)):
            target.weights.prepared.update(target_forms[name])
            head.blocks.update(head_forms[name])
            for kind, n, run in cases:
                times[kind, n, name].append(timed_ms(run, n, 2 if kind == "prompt" else 5))
    target.weights.prepared.update(target_forms["measured"])
    head.blocks.update(head_forms["measured"])
    table = {}
    for kind, n, _ in cases:
        row = {name: round(statistics.median(times[kind, n, name]), 3) for name in target_forms}
        row["16 rows / measured"] = round(row["16 rows"] / row["measured"], 2)
        table[f"{kind} {n}"] = row
        print(f"{kind} {n}: {row}", flush=True)
    out = RESULTS / "direct_rows.json"
    out.write_text(
        json.dumps(
            {"host": host(), "settings": vars(args), "rows_through_the_kernel": crossings, "ms": table}, indent=2
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
