"""Target-only vs speculative decoding on one model, same prompts, same process, interleaved.

    make bench                      # the embedded SmolLM2-135M default, greedy, 96 new tokens
    make bench ARGS="--repeats 5"

Writes bench/results/speed.json: per prompt and mode, median tokens/s, time to first token,
acceptance, and whether greedy outputs are identical to target-only decoding.
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


def timed_run(engine: SpecEngine, prompt_ids: list[int], max_tokens: int) -> dict:
    engine.reset()  # every run prefills from scratch, so repeats are comparable
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    for output in engine.generate(Request("bench", prompt_ids, params)):
        if first is None:
            first = time.perf_counter() - start
        tokens += output.token_ids
    elapsed = time.perf_counter() - start
    stats = output.stats
    return {
        "tokens": tokens,
        "tokens_per_s": len(tokens) / elapsed,
        "decode_tokens_per_s": (len(tokens) - 1) / max(elapsed - first, 1e-9),
        "ttft_s": first,
        "acceptance_rate": stats.acceptance_rate,
        "mean_tokens_per_forward": stats.mean_tokens_per_forward,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="model ref (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default="copy:bfloat16")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "speed.json"))
    args = parser.parse_args()

    config = EngineConfig(
        target=args.target, draft=args.draft, num_draft_tokens=args.num_draft_tokens, max_model_len=2048
    )
    models = load(config)
    eos = eos_token_ids(models.target, models.tokenizer)
    engines = {
        "target-only": build_engine(EngineConfig(target=args.target, max_model_len=2048), models.target, None, eos),
        f"speculative (draft {args.draft}, k={args.num_draft_tokens})": build_engine(
            config, models.target, models.draft, eos
        ),
    }
    results = {}
    for name, text in PROMPTS.items():
        prompt_ids = models.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = models.tokenizer(prompt_ids, add_special_tokens=False).input_ids
        runs: dict[str, list[dict]] = {mode: [] for mode in engines}
        for _ in range(args.repeats):
            for mode, engine in engines.items():  # interleaved, so machine noise hits every mode alike
                runs[mode].append(timed_run(engine, prompt_ids, args.max_tokens))
        baseline = runs["target-only"][0]["tokens"]
        results[name] = {
            mode: {
                "tokens": len(r[0]["tokens"]),
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in r),
                "decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in r),
                "ttft_s": statistics.median(x["ttft_s"] for x in r),
                "acceptance_rate": r[0]["acceptance_rate"],
                "mean_tokens_per_forward": r[0]["mean_tokens_per_forward"],
                "greedy_identical_to_target_only": r[0]["tokens"] == baseline,
            }
            for mode, r in runs.items()
        }
        modes = list(results[name].values())
        results[name]["speedup"] = modes[1]["tokens_per_s"] / modes[0]["tokens_per_s"]
        print(name, json.dumps(results[name], indent=1))
    report = {
        "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "model": models.target_name,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
