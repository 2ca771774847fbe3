"""Acceptance of seeded against unseeded requests, per drafter, on the bench's prompts.

A seeded request keeps a draft exactly when it equals the target's own draw at a uniform keyed by
(seed, position) (docs/api.md#seeds); drafters that sample draw their proposals at the same
uniforms (a coupling by inverse CDF). An unseeded request keeps rejection sampling, which accepts a
sampled draft with probability sum(min(p, q)), the most any coupling can. This measures what the
seeded rule costs: for every drafter, the bench's chat, code and summarise prompts, each sampled
with seeds 0..S-1 and S times unseeded, at the same temperature and top_p, in this process on the
embedded target (drafts from the default copy). Counts, not timings: the host only has to run it.

    .venv/bin/python bench/seeded.py                     # about 6 minutes on 2 cores
    .venv/bin/python bench/seeded.py --samples 1 --max-tokens 16 --drafters eagle3   # a smoke run

Writes bench/results/seeded.json; docs/drafters.md#seeded-requests has the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host import host  # noqa: E402
from bench.runners import chat_ids  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.stats import SpecStats  # noqa: E402
from server.settings import DEFAULT_DRAFT  # noqa: E402

BENCH = Path(__file__).resolve().parent
DRAFTERS = "model,eagle3,medusa,self,staged,ngram,suffix,auto"


def totals(stats: SpecStats) -> dict:
    drafted, accepted = stats.drafted_tokens, stats.accepted_tokens
    return {
        "drafted": drafted,
        "accepted": accepted,
        "forwards": stats.target_forwards,
        "emitted": stats.emitted_tokens,
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "tokens_per_forward": round(stats.emitted_tokens / stats.target_forwards, 3) if stats.target_forwards else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default=DRAFTERS)
    parser.add_argument("--samples", type=int, default=3, help="seeds (and unseeded runs) per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--types", default="chat,code,summarise")
    parser.add_argument("--name", default="seeded", help="results file stem under bench/results")
    args = parser.parse_args()
    prompts = yaml.safe_load((BENCH / "prompts.yaml").read_text())
    texts = [text for kind in args.types.split(",") for text in prompts[kind]]
    loaded = load_engine(EngineConfig(drafter="none", draft=DEFAULT_DRAFT), show_progress=False)
    engine, started = loaded.engine, time.time()
    ids = [chat_ids(loaded.tokenizer, [{"role": "user", "content": text}]) for text in texts]
    runnable = set(engine.description.runnable_drafters)
    rows = {}
    for drafter in args.drafters.split(","):
        if drafter not in runnable:
            print(f"{drafter}: cannot run here, skipped", flush=True)
            continue
        row = {}
        for label in ("seeded", "unseeded"):
            total = SpecStats()
            for p, prompt in enumerate(ids):
                for sample in range(args.samples):
                    seed = sample if label == "seeded" else None
                    params = SamplingParams(
                        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=seed
                    )
                    request = Request(f"{drafter}-{label}-{p}-{sample}", prompt, params, drafter=drafter)
                    total.add(list(engine.generate(request))[-1].stats)
            row[label] = totals(total)
        rows[drafter] = row
        seeded, unseeded = row["seeded"], row["unseeded"]
        print(
            f"{drafter}: acceptance seeded {seeded['acceptance']} unseeded {unseeded['acceptance']}; "
            f"tokens/forward {seeded['tokens_per_forward']} vs {unseeded['tokens_per_forward']}",
            flush=True,
        )
    report = {
        "host": host(),
        "draft": engine.config.draft,
        "num_draft_tokens": engine.config.num_draft_tokens,
        "samples": args.samples,
        "prompts": len(ids),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seconds": round(time.time() - started),
        "drafters": rows,
    }
    out = BENCH / "results" / f"{args.name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
