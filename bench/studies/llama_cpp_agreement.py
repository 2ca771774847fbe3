"""Study: how close is the int8 target to llama.cpp itself, and does the EAGLE-3 head hold on it? Answer: docs/internals.md#int8-activations.

``--activations int8`` multiplies the embedded GGUF's products as llama.cpp does (activations
rounded to int8 per block of 32, integer sums). This puts the served targets beside llama.cpp
(llama-cpp-python on the same file and threads) over the first turn of every prompt of
bench/prompts.yaml, greedy, 96 tokens each:

- each target's greedy answer against llama.cpp's: the position of the first token that differs
  (None: the same 96 tokens, or the same answer to its end);
- teacher-forced over llama.cpp's own answer: how often each target's argmax is llama.cpp's
  (llama.cpp's logits of every position read back with ``logits_all``);
- the shipped EAGLE-3 head's acceptance and tokens per target forward, greedy, over the same
  prompts, on the float32 target and on the int8 one.

    .venv/bin/python bench/studies/llama_cpp_agreement.py   (needs llama-cpp-python: pip install llama-cpp-python)

Writes bench/results/llama_cpp_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from bench.runners import chat_ids  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.model.loader import embedded_gguf  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
ACTIVATIONS = ("float32", "int8")


def prompts() -> dict[str, list[dict]]:
    """The first turn of every prompt of bench/prompts.yaml as chat messages, by type and index ("chat-0")."""
    sets = yaml.safe_load((ROOT / "bench" / "prompts.yaml").read_text())
    found = {}
    for kind, items in sets.items():
        for i, item in enumerate(items):
            if isinstance(item, str):
                found[f"{kind}-{i}"] = [{"role": "user", "content": item}]
            else:  # a conversation: its system message and first turn
                found[f"{kind}-{i}"] = [
                    {"role": "system", "content": item["system"]},
                    {"role": "user", "content": item["turns"][0]},
                ]
    return found


def llama_cpp_answer(model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    model.reset()
    answer = []
    for token in model.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        if token == eos or len(answer) == max_tokens:
            break
        answer.append(token)
    return answer


def llama_cpp_argmax(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """llama.cpp's greedy token at every position of ``answer`` given the tokens before it."""
    model.reset()
    model.eval(prompt + answer[:-1])
    scores = torch.from_numpy(model.scores[len(prompt) - 1 : len(prompt) - 1 + len(answer)].copy())  # [N, V]
    return scores.argmax(-1)


def target_answer(engine, prompt: list[int], max_tokens: int, drafter: str = "none") -> tuple[list[int], dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs = list(engine.generate(Request("study", prompt, params, drafter=drafter)))
    return [t for o in outputs for t in o.token_ids], outputs[-1].stats.to_dict()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    reference = Llama(str(embedded_gguf()), n_threads=threads, n_ctx=4096, logits_all=True, verbose=False)
    loaded = {
        name: load_engine(EngineConfig(max_model_len=4096, drafter="none", draft=None, activations=name), False)
        for name in ACTIVATIONS
    }
    tokenizer = loaded["float32"].tokenizer
    rows = {}
    for key, messages in prompts().items():
        prompt = chat_ids(tokenizer, messages)
        answer = llama_cpp_answer(reference, prompt, args.max_tokens, tokenizer.eos_token_id)
        if not answer:
            continue
        expected = llama_cpp_argmax(reference, prompt, answer)
        row = {"llama_cpp_tokens": len(answer)}
        for name, item in loaded.items():
            own, _ = target_answer(item.engine, prompt, args.max_tokens)
            target = item.engine.target
            target.cache.rollback(0)
            logits = target.extend(prompt + answer[:-1], num_logits=len(answer))  # [N, V]
            target.cache.rollback(0)
            _, head = target_answer(item.engine, prompt, args.max_tokens, drafter="eagle3")
            row[name] = {
                "first_difference": first_difference(own, answer),
                "top1_agreement": round(float((logits.argmax(-1) == expected).float().mean()), 3),
                "eagle3_acceptance": head["acceptance_rate"],
                "eagle3_tokens_per_forward": head["mean_tokens_per_forward"],
            }
        rows[key] = row
        print(key, json.dumps(row), file=sys.stderr)
    summary = {
        name: {
            "top1_agreement": round(statistics.mean(row[name]["top1_agreement"] for row in rows.values()), 3),
            "same_answer": sum(row[name]["first_difference"] is None for row in rows.values()),
            "first_difference_median": statistics.median(
                row[name]["first_difference"] if row[name]["first_difference"] is not None else args.max_tokens
                for row in rows.values()
            ),
            "eagle3_acceptance": round(statistics.mean(row[name]["eagle3_acceptance"] for row in rows.values()), 3),
            "eagle3_tokens_per_forward": round(
                statistics.mean(row[name]["eagle3_tokens_per_forward"] for row in rows.values()), 2
            ),
        }
        for name in ACTIVATIONS
    }
    report = {
        "host": host(),
        "model": "embedded SmolLM2-135M-Instruct; llama.cpp is llama-cpp-python on the same GGUF file",
        "threads": threads,
        "max_tokens": args.max_tokens,
        "prompts": len(rows),
        "summary": summary,
        "by_prompt": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "llama_cpp_agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
