"""Study: how close are the int8 and float32 targets to llama.cpp itself? Answer: docs/internals.md#int8-activations.

The embedded GGUF run three ways on the same prompt token ids: llama.cpp (llama-cpp-python, every
row's logits kept), the served target with int8 activations (llama.cpp's arithmetic on the file's
blocks) and with float32 ones (the file's dequantized weights, exact). Over the first request of
every prompt in ``bench/prompts.yaml``, each writes ``--max-tokens`` greedily; the report gives, per
prompt, the position where each target's answer first leaves llama.cpp's (None: never, within the
answer), and, teacher-forced over llama.cpp's own answer, how often each target's greedy token is
llama.cpp's (top-1 agreement) and the mean total variation between their next-token distributions
(at temperature 1). Also the README question's first token distribution on all three. Counts, not
timings. Writes bench/results/llama_cpp_agreement.json.

    .venv/bin/python bench/studies/llama_cpp_agreement.py [--max-tokens 96]

llama-cpp-python is not a dependency (docs/benchmarks.md says how to build it; on a host whose
CPU has AMX, build it without the AMX kernels, which crashed in ``llama_decode`` here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from bench.runners import Conversation, chat_ids  # noqa: E402
from bench.studies.eagle3_unseen import greedy_answer  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.model.loader import embedded_gguf  # noqa: E402

BENCH = Path(__file__).resolve().parents[1]
README_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class LlamaCpp:
    """llama.cpp on the GGUF, greedy from token ids, with every evaluated row's logits."""

    def __init__(self, path: Path, context: int) -> None:
        from llama_cpp import Llama

        self.model = Llama(model_path=str(path), n_ctx=context, n_threads=torch.get_num_threads(), logits_all=True,
                           verbose=False)  # fmt: skip

    def answer(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
        """(greedy answer, the logits that chose each of its tokens: [max_tokens, V])."""
        self.model.reset()
        self.model.eval(prompt_ids)
        answer, rows = [], []
        for _ in range(max_tokens):
            rows.append(np.array(self.model.scores[self.model.n_tokens - 1], dtype=np.float32))
            answer.append(int(rows[-1].argmax()))
            self.model.eval(answer[-1:])
        return answer, np.stack(rows)


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    return next((t for t, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


@torch.inference_mode()
def teacher_forced(target, prompt_ids: list[int], answer: list[int], theirs: np.ndarray) -> tuple[float, float]:
    """Over llama.cpp's answer: (top-1 agreement with llama.cpp, mean total variation at temperature 1)."""
    target.cache.rollback(0)
    logits = target.extend(prompt_ids + answer[:-1], len(answer)).float()  # [T, V]
    target.cache.rollback(0)
    reference = torch.from_numpy(theirs).float()  # [T, V]
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    variation = 0.5 * (torch.softmax(logits, -1) - torch.softmax(reference, -1)).abs().sum(-1).mean()
    return round(float(agree), 4), round(float(variation), 4)


def top_tokens(tokenizer, logits: torch.Tensor, count: int = 4) -> list[tuple[str, float]]:
    probs = torch.softmax(logits.float(), -1)  # [V]
    top = probs.topk(count)
    return [(tokenizer.decode([int(i)]), round(float(p), 3)) for p, i in zip(top.values, top.indices, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    context = 2048
    targets, tokenizer = {}, None
    for activations in ("int8", "float32"):
        config = EngineConfig(activations=activations, drafter="none", max_model_len=context)
        loaded = load_engine(config, show_progress=False)
        targets[activations], tokenizer = loaded.engine.target, loaded.tokenizer
    llama = LlamaCpp(embedded_gguf(), context)
    prompts = yaml.safe_load((BENCH / "prompts.yaml").read_text())
    results = {}
    for kind, texts in prompts.items():
        for index, text in enumerate(texts):
            prompt_ids = chat_ids(tokenizer, Conversation.of(text).first_request())[: context - args.max_tokens - 2]
            theirs, rows = llama.answer(prompt_ids, args.max_tokens)
            entry = {}
            for name, target in targets.items():
                ours = greedy_answer(target, prompt_ids, args.max_tokens)
                agreement, variation = teacher_forced(target, prompt_ids, theirs, rows)
                entry[name] = {"first_divergence": first_divergence(ours, theirs), "top1_agreement": agreement,
                               "total_variation": variation}  # fmt: skip
            results[f"{kind}[{index}]"] = entry
            print(kind, index, entry, flush=True)
    question = chat_ids(tokenizer, README_QUESTION)
    _, first = llama.answer(question, 1)
    readme = {"llama.cpp": top_tokens(tokenizer, torch.from_numpy(first[0]))}
    for name, target in targets.items():
        target.cache.rollback(0)
        readme[name] = top_tokens(tokenizer, target.extend(question)[-1])
        target.cache.rollback(0)
    summary = {}
    for name in targets:
        entries = [entry[name] for entry in results.values()]
        summary[name] = {
            "same_answer_as_llama_cpp": sum(entry["first_divergence"] is None for entry in entries),
            "prompts": len(entries),
            "median_first_divergence": statistics.median(
                args.max_tokens if entry["first_divergence"] is None else entry["first_divergence"] for entry in entries
            ),
            "mean_top1_agreement": round(statistics.mean(entry["top1_agreement"] for entry in entries), 4),
            "mean_total_variation": round(statistics.mean(entry["total_variation"] for entry in entries), 4),
        }
    import llama_cpp

    report = {
        "host": host(),
        "llama_cpp_python": llama_cpp.__version__,
        "max_tokens": args.max_tokens,
        "summary": summary,
        "readme_question_first_token": readme,
        "prompts": results,
    }
    out = BENCH / "results" / "llama_cpp_agreement.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"summary": summary, "readme_question_first_token": readme}, indent=2))


if __name__ == "__main__":
    main()
