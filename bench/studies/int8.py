"""Study: what do int8 activations change, forward by rows and served? Answer: docs/internals.md#int8-activations.

What --activations int8 changes on CPU: the embedded target served with float32 activations and
with int8 ones (llama.cpp's arithmetic, docs/internals.md#int8-activations), side by side in one
process, with the shipped EAGLE-3 head loaded in both.

Times the served forward over 1..8 rows at a window of 200 positions (row counts in turn, the two
targets alternated within each count, reversed every other round), fits a step's fixed cost plus a
cost per row, and the ceiling those times set for a chain of drafts (``ceiling`` of
bench/studies/native_ops.py); times a 1,500-token prompt on each (int8 takes the kernels and
decode_attention at every length); and counts how often the two targets' greedy next tokens agree,
teacher-forced over the float32 target's own answers to a few prompts; and the shipped EAGLE-3
head's greedy acceptance on each target over bench/prompts.yaml. Writes bench/results/int8.json.

    .venv/bin/python bench/studies/int8.py [--head-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from bench.studies.native_ops import WINDOW, row_report, step_ms  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
ACTIVATIONS = ("float32", "int8")
PROMPTS = (
    "What are three good habits for staying focused while working from home?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarise in two sentences: the council voted to close the old bridge to cars next spring.",
)


def row_sweep(targets: dict, rounds: int, repeats: int) -> dict[str, dict[int, float]]:
    """Median ms of each target's forward over 1..8 rows, the targets alternated within each count."""
    times = {name: {n: [] for n in range(1, 9)} for name in targets}
    for round_index in range(rounds):
        for n in range(1, 9) if round_index % 2 == 0 else range(8, 0, -1):
            for name, target in targets.items():
                times[name][n].append(step_ms(target, n, repeats))
    return {name: {n: statistics.median(values) for n, values in by_rows.items()} for name, by_rows in times.items()}


def prompt_ms(targets: dict, length: int, repeats: int) -> dict[str, float]:
    token_ids = [(17 * i) % 20000 + 100 for i in range(length)]
    times: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(repeats):
        for name, target in targets.items():
            target.cache.rollback(0)
            started = time.perf_counter()
            target.extend(token_ids)
            times[name].append(time.perf_counter() - started)
    return {name: round(1000 * statistics.median(values), 1) for name, values in times.items()}


def agreement(loaded: dict, max_tokens: int) -> dict:
    """Teacher-forced over the float32 target's greedy answers: how often the int8 target's argmax
    is the same token, and where the two targets' own greedy answers first differ."""
    tokenizer = loaded["float32"].tokenizer
    same = total = 0
    first_differences = []
    for i, text in enumerate(PROMPTS):
        chat = [{"role": "user", "content": text}]
        prompt = tokenizer(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)).input_ids
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        answers = {
            name: [
                t
                for o in item.engine.generate(Request(f"{name}{i}", prompt, params, drafter="none"))
                for t in o.token_ids
            ]
            for name, item in loaded.items()
        }
        int8 = loaded["int8"].engine.target
        int8.cache.rollback(0)
        logits = int8.extend(prompt + answers["float32"][:-1], num_logits=len(answers["float32"]))  # [N, V]
        same += int((logits.argmax(-1) == torch.tensor(answers["float32"])).sum())
        total += len(answers["float32"])
        pairs = zip(answers["float32"], answers["int8"], strict=False)
        first_differences.append(next((j for j, (a, b) in enumerate(pairs) if a != b), None))
    return {"top1_agreement": round(same / total, 3), "positions": total, "first_greedy_difference": first_differences}


def head_acceptance(loaded: dict, max_tokens: int) -> dict:
    """The shipped EAGLE-3 head drafting for each target, greedy, over the first turn of every
    prompt of bench/prompts.yaml: its acceptance and tokens per target forward, mean over prompts
    (the head was trained on the float32 target's features)."""
    import yaml

    tokenizer = loaded["float32"].tokenizer
    sets = yaml.safe_load((Path(__file__).resolve().parents[1] / "prompts.yaml").read_text())
    chats = [
        [{"role": "user", "content": item}]
        if isinstance(item, str)
        else [{"role": "system", "content": item["system"]}, {"role": "user", "content": item["turns"][0]}]
        for items in sets.values()
        for item in items
    ]
    found = {}
    for name, item in loaded.items():
        acceptance, per_forward = [], []
        for i, chat in enumerate(chats):
            prompt = tokenizer(
                tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            ).input_ids
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            outputs = list(item.engine.generate(Request(f"h{name}{i}", prompt, params, drafter="eagle3")))
            stats = outputs[-1].stats.to_dict()
            acceptance.append(stats["acceptance_rate"])
            per_forward.append(stats["mean_tokens_per_forward"])
        found[name] = {
            "acceptance": round(statistics.mean(acceptance), 3),
            "tokens_per_forward": round(statistics.mean(per_forward), 3),
            "prompts": len(chats),
        }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--head-only", action="store_true", help="only the EAGLE-3 head's acceptance on each target")
    args = parser.parse_args()
    loaded = {
        name: load_engine(
            EngineConfig(max_model_len=2048, drafter="eagle3", draft=None, activations=name), show_progress=False
        )
        for name in ACTIVATIONS
    }
    if args.head_only:  # merged into the last full run's results
        path = RESULTS / "int8.json"
        report = json.loads(path.read_text()) if path.exists() else {"host": host()}
        report["eagle3_head"] = head_acceptance(loaded, 96)
        report["eagle3_head_host"] = host()
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["eagle3_head"], indent=2))
        return
    targets = {name: item.engine.target for name, item in loaded.items()}
    head_ms = {name: 1000 * item.engine.drafter("eagle3").own_costs().step_seconds for name, item in loaded.items()}
    for target in targets.values():
        target.cache.rollback(0)
        target.extend(list(range(100, 100 + WINDOW)), num_logits=0)
    sweep = row_sweep(targets, args.rounds, args.repeats)
    served = {name: row_report(medians, head_ms[name]) for name, medians in sweep.items()}
    report = {
        "host": host(),
        "model": "embedded SmolLM2-135M-Instruct on its GGUF blocks, shipped EAGLE-3 head loaded",
        "products": {name: target.weights.describe() for name, target in targets.items()},
        "window": WINDOW,
        "served_rows": served,
        "int8_over_float32_by_rows": {str(n): round(sweep["int8"][n] / sweep["float32"][n], 3) for n in range(1, 9)},
        "prompt_1500_tokens_ms": prompt_ms(targets, 1500, 3),
        "agreement": agreement(loaded, 96),
        "eagle3_head": head_acceptance(loaded, 96),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8.json").write_text(json.dumps(report, indent=2) + "\n")
    shown = ("served_rows", "int8_over_float32_by_rows", "prompt_1500_tokens_ms", "agreement")
    print(json.dumps({key: report[key] for key in shown}, indent=2))


if __name__ == "__main__":
    main()
