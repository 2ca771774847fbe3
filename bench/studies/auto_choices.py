"""Study: would another version of auto's policy cost fewer steps, counted not timed? Answer: docs/benchmarks.md.

What ``auto``'s choices would cost, counted rather than timed: a comparison of two versions of
its policy that this host's noise (±10% between identical runs) cannot blur.

The step costs ``auto`` decides by are pinned to a line, a + b * rows ms a target forward (by
default 4.3 + 2.4 * rows, what bench/results/native_ops.json measured for the embedded model on a
Zen 4 host) and a head's draft step (0.6 ms), instead of being timed live. The embedded default then
decodes 96 tokens from the first turn of every prompt of bench/prompts.yaml, each request its own
tenant; every step's drafter, drafted tokens and accepted tokens are recorded and priced by the
same line. Output: per prompt type, tokens, steps, drafted and accepted tokens by drafter, and
modelled ms a token against target-only's a + b. At temperature 0 the text is the target's, so two
versions differ only by their choices; sampled, repeats average over the draws.

    .venv/bin/python bench/studies/auto_choices.py [--temperature 0.8 --repeats 3] [--name NAME]

Writes bench/results/auto_choices[-NAME].json, keyed by temperature. To price another commit's
policy the same way: ``git worktree add /tmp/old COMMIT``, copy this script, bench/runners.py and
engine/cpu/_blocks*.so into it, and run it there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from bench.runners import Conversation, EngineRunner, chat_ids  # noqa: E402
from engine.adaptive import StepCosts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.drafters.auto import AutoDrafter  # noqa: E402
from engine.factory import load_engine  # noqa: E402

BENCH = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=0.95, help="with a temperature")
    parser.add_argument("--repeats", type=int, default=1, help="runs per prompt")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--line", default="4.3,2.4", help="a,b: a target forward costs a + b * rows ms")
    parser.add_argument("--head-step", type=float, default=0.6, help="ms a draft model or head drafts a token")
    parser.add_argument("--name", default="", help="results file suffix")
    args = parser.parse_args()
    fixed, per_row = (float(x) / 1000 for x in args.line.split(","))
    steps: list[tuple[str | None, int, int]] = []  # (track, drafted, accepted) per step
    accept = AutoDrafter.accept

    def recording_accept(self, num_committed: int) -> None:
        if (choice := self._choice) is not None:
            accepted = max(0, min(num_committed - choice.sequence_length, choice.drafted))
            steps.append(((choice.track or "none").split("@")[0], choice.drafted, accepted))
        accept(self, num_committed)

    AutoDrafter.accept = recording_accept
    StepCosts.observe = lambda self, *_, **__: None  # no live timing: the pinned line decides
    loaded = load_engine(EngineConfig(max_model_len=4096), show_progress=False)
    auto = loaded.engine.drafter("auto")
    auto.verify = StepCosts(0.0, {k: fixed + per_row * (k + 1) for k in range(9)})  # k drafts: k + 1 rows
    for name in auto.draft_costs:
        auto.draft_costs[name] = StepCosts(args.head_step / 1000)
    runner = EngineRunner(loaded.engine)
    sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature else None
    prompts = yaml.safe_load((BENCH / "prompts.yaml").read_text())
    by_type = {}
    for kind, entries in prompts.items():
        total = Counter()
        for index, entry in enumerate(entries):
            prompt_ids = chat_ids(loaded.tokenizer, Conversation.of(entry).first_request())
            for repeat in range(args.repeats):
                steps.clear()
                run = runner.run("default", False, prompt_ids, args.max_tokens, f"{kind}{index}#{repeat}", sampling)
                total["tokens"] += len(run.token_ids) - 1  # after the first, which the prompt's read makes
                for track, drafted, accepted in steps[1:]:
                    total["steps"] += 1
                    if drafted:
                        total[f"drafted:{track}"] += drafted
                        total[f"accepted:{track}"] += accepted
                    drafting = drafted * args.head_step / 1000 if track != "suffix" else 0.0  # text matching: free
                    total["ms"] += 1000 * (fixed + per_row * (1 + drafted) + drafting)
        ms_per_token = total.pop("ms") / max(1, total["tokens"])
        by_type[kind] = dict(total) | {
            "ms_per_token": round(ms_per_token, 3),
            "vs_target_only": round(1000 * (fixed + per_row) / ms_per_token, 3),
        }
        print(kind, by_type[kind], flush=True)
    geomean = statistics.geometric_mean([row["vs_target_only"] for row in by_type.values()])
    out = BENCH / "results" / f"auto_choices{'-' + args.name if args.name else ''}.json"
    results = json.loads(out.read_text()) if out.is_file() else {}
    results[f"temperature {args.temperature}"] = {
        "host": host(bandwidth=False),
        "settings": vars(args),
        "by_type": by_type,
        "geomean_vs_target_only": round(geomean, 3),
    }
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"geometric mean {geomean:.3f}x target-only (modelled); wrote {out}")


if __name__ == "__main__":
    main()
