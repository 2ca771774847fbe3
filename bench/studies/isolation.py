"""Study: what does tenant isolation cost a long prompt's first token? Answer: docs/benchmarks.md.

What tenant isolation costs: the first token of a long prompt with its prefix reused (the same
scope sent it before) and recomputed (another scope computed it: the engine does not reuse it).

    .venv/bin/python bench/studies/isolation.py [--prompt-tokens 1000] [--repeats 4]    # writes bench/results/isolation.json

The embedded model, target alone, in this process; interleaved, medians. The host is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for bench.host
from bench.host import host  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    loaded = load_engine(EngineConfig(drafter="none", draft=None, max_model_len=2048), show_progress=False)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(200))
    prompt = tokenizer(text).input_ids[: args.prompt_tokens]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def first_token(scope: str, last: int) -> tuple[float, int]:
        started = time.perf_counter()
        output = next(iter(engine.generate(Request("bench", [*prompt, last], params, tenant=scope))))
        return time.perf_counter() - started, output.cached_tokens

    first_token("owner", 1)
    reused, recomputed = [], []
    for i in range(args.repeats):
        reused.append(first_token("owner", 10 + i))  # the owner again: its prefix is in the cache
        recomputed.append(first_token(f"other-{i}", 20 + i))  # another scope: computed again
        first_token("owner", 30 + i)  # the owner's prefix back in the cache
    report = {
        "host": host(),
        "prompt_tokens": len(prompt),
        "first_token_ms": {
            "prefix_reused": round(statistics.median(s for s, _ in reused) * 1e3, 1),
            "prefix_recomputed": round(statistics.median(s for s, _ in recomputed) * 1e3, 1),
        },
        "cached_tokens": {"prefix_reused": reused[0][1], "prefix_recomputed": recomputed[0][1]},
        "date": time.strftime("%Y-%m-%d"),
    }
    (RESULTS / "isolation.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["first_token_ms"]))


if __name__ == "__main__":
    main()
