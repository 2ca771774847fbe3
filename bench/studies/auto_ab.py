"""Study: does a change to auto's pricing gain, against auto before it and its best candidate alone?

Two engines of the embedded default in this process: one runs auto as before the change (module
constants set so the change has no effect), the other as shipped; ``suffix`` alone (on the second
engine) is the reference. The three take turns request by request over the first turn of every
prompt of bench/prompts.yaml, greedy and at temperature 0.8 (seeded, a new seed each round), 96
tokens, each request its own scope. The constants are switched around each request; each engine
keeps its own live costs, so neither learns from the other's steps. Changes (``--change``):

- ``verify-slope``: the verify slope live steps show (``MIN_ROW_READINGS`` out of reach before) and
  probes only of draft models with little to catch up (``PROBE_CATCH_UP`` 1 before, a whole plain
  step). Answer: docs/drafters.md#verify-slope-learned-live.
- ``text-share``: a draft model's catch-up paid back over the share of steps text matching leaves
  to others (``LEFT_PRIOR_STEPS`` out of reach before: always all 64 tokens). Answer:
  docs/drafters.md#catch-up-over-the-steps-text-matching-leaves.
- ``context-slope``: verify prices that grow with the step's context at a slope live steps show
  (``MIN_CONTEXT_SPREAD`` out of reach before: one shift for every context). Answer:
  docs/drafters.md#verify-prices-by-context.

    .venv/bin/python bench/studies/auto_ab.py --change text-share [--rounds 3] [--cases code@0.0,long@0.8]

Writes the change's entry ("verify slope A/B", "text share A/B", "context slope A/B") of bench/results/auto_overhead.json:
median decode tokens/s (after the first arrival: ``Run.decode_tokens_per_s``) by case, and each
configuration over the others.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine.adaptive as adaptive  # noqa: E402
import engine.drafters.auto as auto_module  # noqa: E402
import engine.drafters.auto_state as auto_state  # noqa: E402
from bench.runners import EngineRunner, chat_ids  # noqa: E402
from bench.studies.auto_overhead import TEMPERATURES, bench_prompts, write_entry  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cpu.int8_blocks import held_activations  # noqa: E402
from engine.factory import load_engine  # noqa: E402

# where each constant lives, and its value as shipped
SHIPPED = {
    (adaptive, "MIN_ROW_READINGS"): adaptive.MIN_ROW_READINGS,
    (auto_module, "PROBE_CATCH_UP"): auto_module.PROBE_CATCH_UP,
    (auto_state, "LEFT_PRIOR_STEPS"): auto_state.LEFT_PRIOR_STEPS,
    (adaptive, "MIN_CONTEXT_SPREAD"): adaptive.MIN_CONTEXT_SPREAD,
}
CHANGES = {  # what each change's "before" sets, and the entry it writes
    "verify-slope": ("verify slope A/B", {(adaptive, "MIN_ROW_READINGS"): 10**9, (auto_module, "PROBE_CATCH_UP"): 1.0}),
    "text-share": ("text share A/B", {(auto_state, "LEFT_PRIOR_STEPS"): 1e12}),
    "context-slope": ("context slope A/B", {(adaptive, "MIN_CONTEXT_SPREAD"): math.inf}),
}


def use(constants: dict) -> None:
    for (module, name), value in constants.items():
        setattr(module, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--change", choices=sorted(CHANGES), default="verify-slope")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="", help="e.g. code@0.0,long@0.8 (default: every type at both temperatures)")
    args = parser.parse_args()
    entry, changed = CHANGES[args.change]
    before_constants = SHIPPED | changed
    before, shipped = (load_engine(EngineConfig(), show_progress=False) for _ in range(2))
    runners = {"before": EngineRunner(before.engine), "shipped": EngineRunner(shipped.engine)}
    # (name, engine's runner, constants, drafter), in the order they take turns
    configurations = [("suffix", "shipped", SHIPPED, "suffix"), ("before", "before", before_constants, "auto")]
    configurations.append(("shipped", "shipped", SHIPPED, "auto"))
    wanted = set(filter(None, args.cases.split(",")))
    rates: dict[str, dict[str, list[float]]] = {}
    for round_index in range(args.rounds):
        for index, (kind, messages) in enumerate(bench_prompts()):
            prompt = chat_ids(shipped.tokenizer, messages)
            for temperature in TEMPERATURES:
                case = f"{kind}@{temperature}"
                if wanted and case not in wanted:
                    continue
                sampling = {"temperature": temperature, "seed": 11 + round_index} if temperature else None
                for name, runner, constants, drafter in configurations:
                    use(constants)
                    run = runners[runner].run(drafter, False, prompt, 96, f"{index}{case}{name}{round_index}", sampling)
                    rates.setdefault(case, {}).setdefault(name, []).append(run.decode_tokens_per_s)
    use(SHIPPED)
    table = {}
    for case, by_name in rates.items():
        median = {name: statistics.median(values) for name, values in by_name.items()}
        table[case] = {
            "tokens_per_s": {name: round(value, 1) for name, value in median.items()},
            "before_over_suffix": round(median["before"] / median["suffix"], 3),
            "shipped_over_suffix": round(median["shipped"] / median["suffix"], 3),
            "shipped_over_before": round(median["shipped"] / median["before"], 3),
        }
        print(case, {key: value for key, value in table[case].items() if key != "tokens_per_s"})
    ratios = [key for key in next(iter(table.values())) if key != "tokens_per_s"]
    summary = {
        key: {
            "geometric_mean": round(math.exp(statistics.fmean(math.log(row[key]) for row in table.values())), 3),
            "least": min(row[key] for row in table.values()),
        }
        for key in ratios
    }
    print(summary)
    write_entry(
        entry + (f", {args.cases}" if args.cases else ""),
        {
            "model": f"embedded SmolLM2-135M-Instruct on its GGUF blocks, {held_activations(shipped.engine.target)}"
            " activations, in process, two engines",
            "rounds": args.rounds,
            "scopes": "one per request",
            "max_tokens": 96,
            "results": table,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
