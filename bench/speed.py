"""Target-only vs every drafter on one model: same prompts, same process, interleaved runs.

    make bench                                   # embedded SmolLM2-135M, greedy, 96 new tokens
    make bench ARGS="--repeats 3 --drafters none,model,ngram"

One engine serves every configuration (the drafter is chosen per request), so all share the same
weights and caches; every run starts from an empty cache. Writes bench/results/speed.json and prints
a markdown table: acceptance rate, mean accepted length, tokens/s and speedup vs target-only.
Greedy outputs are checked to be identical to target-only decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Request, SpecEngine, build_engine  # noqa: E402
from engine.loader import eos_token_ids, load  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

PROMPTS = {
    "chat": "What are three good habits for staying healthy? Explain each briefly.",
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "summarise": (
        "Summarise this passage in two sentences.\n\nThe printing press, developed by Johannes Gutenberg around "
        "1440, transformed how information spread across Europe. Before it, books were copied by hand, which was "
        "slow and expensive, so few people owned them. Movable metal type let printers produce many identical "
        "copies quickly, lowering prices and raising literacy. Within fifty years, millions of books were in "
        "circulation, and ideas from science, religion and politics travelled further than ever before."
    ),
}


def timed_run(engine: SpecEngine, drafter: str, prompt_ids: list[int], max_tokens: int) -> dict:
    engine.reset()  # every run prefills from scratch, so repeats are comparable
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    for output in engine.generate(Request("bench", prompt_ids, params, drafter=drafter)):
        first = first if first is not None else time.perf_counter() - start
        tokens += output.token_ids
    elapsed = time.perf_counter() - start
    stats = output.stats
    return {
        "tokens": tokens,
        "tokens_per_s": len(tokens) / elapsed,
        "ttft_s": first,
        "acceptance_rate": stats.acceptance_rate,
        "mean_tokens_per_forward": stats.mean_tokens_per_forward,
        "mean_num_draft_tokens": stats.mean_num_draft_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="model ref (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default="copy:bfloat16", help="the model drafter's draft")
    parser.add_argument("--drafters", default="none,model,ngram,self,medusa,staged")
    parser.add_argument("--adaptive", default="model,ngram", help="drafters also run with adaptive k")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "speed.json"))
    args = parser.parse_args()

    def config(adaptive: bool) -> EngineConfig:
        return EngineConfig(
            target=args.target,
            draft=args.draft,
            num_draft_tokens=args.num_draft_tokens,
            max_model_len=2048,
            adaptive_k=adaptive,
        )

    models = load(config(False))
    eos = eos_token_ids(models.target, models.tokenizer)
    fixed = build_engine(config(False), models.target, models.draft, eos)
    adaptive = build_engine(config(True), models.target, models.draft, eos)
    modes = {name: (fixed, name) for name in args.drafters.split(",")}
    modes.update({f"{name}+adaptive-k": (adaptive, name) for name in args.adaptive.split(",") if name})
    results: dict[str, dict] = {}
    for prompt_name, text in PROMPTS.items():
        chat = [{"role": "user", "content": text}]
        rendered = models.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt_ids = models.tokenizer(rendered, add_special_tokens=False).input_ids
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode, (engine, drafter) in modes.items():  # interleaved: machine noise hits every mode alike
                runs[mode].append(timed_run(engine, drafter, prompt_ids, args.max_tokens))
        baseline = runs["none"][0]
        base_speed = statistics.median(r["tokens_per_s"] for r in runs["none"])
        results[prompt_name] = {}
        for mode, mode_runs in runs.items():
            speed = statistics.median(r["tokens_per_s"] for r in mode_runs)
            results[prompt_name][mode] = {
                "tokens": len(mode_runs[0]["tokens"]),
                "tokens_per_s": round(speed, 2),
                "speedup_vs_target_only": round(speed / base_speed, 3),
                "ttft_s": round(statistics.median(r["ttft_s"] for r in mode_runs), 4),
                "acceptance_rate": round(mode_runs[0]["acceptance_rate"], 3),
                "mean_tokens_per_forward": round(mode_runs[0]["mean_tokens_per_forward"], 3),
                "mean_num_draft_tokens": round(mode_runs[0]["mean_num_draft_tokens"], 3),
                "greedy_identical_to_target_only": mode_runs[0]["tokens"] == baseline["tokens"],
            }
    report = {
        "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "model": models.target_name,
        "num_draft_tokens": args.num_draft_tokens,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    print(f"\nwrote {args.out}")


def table(results: dict[str, dict]) -> str:
    lines = [
        "| prompt | drafter | acceptance | tokens/forward | tokens/s | vs target-only | greedy same |",
        "|---|---|---|---|---|---|---|",
    ]
    for prompt_name, modes in results.items():
        for mode, r in modes.items():
            lines.append(
                f"| {prompt_name} | {mode} | {r['acceptance_rate']:.2f} | {r['mean_tokens_per_forward']:.2f} | "
                f"{r['tokens_per_s']:.1f} | {r['speedup_vs_target_only']:.2f}x | {r['greedy_identical_to_target_only']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
