"""Study: how well does an EAGLE-3 head agree with its target on unseen prompts? Answer: docs/drafters.md#eagle-3-heads.

How well an EAGLE-3 head agrees with its target on prompts it never saw: ``bench/prompts.yaml``
(disjoint from the training set; of a prompt of several turns, the first). The target answers
each prompt greedily; then, teacher-forced
over prompt and answer, the head drafts from every committed position of the answer as serving
runs it (``Eagle3Head.step``, one position at a time over its own cache) and the training code's
unrolled measure scores its four draft steps. Last, the engine drafts with the head alone, 4 a
step, greedy, over the same prompts: tokens per target forward (counted, not timed). Writes
bench/results/eagle3_unseen[-NAME].json. With ``--record``, the mean first-draft agreement over the
prompts goes into the head's training.json as ``unseen_acceptance``: ``auto`` starts a request
from it (what the head reaches on prompts it never saw, where its held-out answers were its own
training's kind).

    .venv/bin/python bench/studies/eagle3_unseen.py [--head DIR] [--max-tokens 96] [--name NAME] [--record]
        [--activations float32|int8]

``--activations int8``: the target ``serve --activations int8`` serves (the GGUF blocks with int8
activations) answers, gives the features and serves the head, in place of the float32 target.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from bench.runners import Conversation, EngineRunner, chat_ids  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.drafters.eagle3_head import default_aux_layers, load_head, shipped_head  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.model.loader import EMBEDDED_NAME, load_model, load_tokenizer  # noqa: E402
from engine.model.model import CausalLM  # noqa: E402
from engine.training.eagle3 import int8_target, unrolled_loss  # noqa: E402
from engine.training.eagle3_data import collect_features, make_batch  # noqa: E402

BENCH = Path(__file__).resolve().parents[1]


@torch.inference_mode()
def greedy_answer(target: CausalLM, prompt_ids: list[int], max_tokens: int) -> list[int]:
    target.cache.rollback(0)
    logits = target.extend(prompt_ids)  # [1, V]
    answer = []
    for _ in range(max_tokens):
        answer.append(int(logits[-1].argmax()))
        logits = target.extend(answer[-1:])
    target.cache.rollback(0)
    return answer


@torch.inference_mode()
def serving_agreement(head, row: dict, first_answer: int) -> float:
    """The head's first draft from each committed position t of the answer (reading token t + 1
    with the target's features of t) against the target's token t + 2."""
    ids, features = row["ids"].tolist(), row["features"].float()
    head.cache.rollback(0)
    hits = total = 0
    for t in range(len(ids) - 2):
        logits, _ = head.step([ids[t + 1]], head.fuse(features[t : t + 1]))
        head.cache.append([ids[t]])
        if t + 1 >= first_answer:
            total += 1
            hits += int(logits.argmax()) == ids[t + 2]
    head.cache.rollback(0)
    return hits / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", default=None, help="head folder (default: the one shipped for the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--name", default="", help="results file suffix")
    parser.add_argument("--record", action="store_true", help="write unseen_acceptance into the head's training.json")
    parser.add_argument("--activations", choices=("float32", "int8"), default="float32", help="the target's")
    args = parser.parse_args()
    head_dir = args.head or str(shipped_head(EMBEDDED_NAME))
    tokenizer = load_tokenizer(None)
    if args.activations == "int8":
        target = int8_target(None, 2048)
    else:
        target = CausalLM(load_model(None, torch.device("cpu"), torch.float32), 2048)
    prompts = yaml.safe_load((BENCH / "prompts.yaml").read_text())
    conversations, firsts, names, asked = [], [], [], []
    for kind, texts in prompts.items():
        for index, text in enumerate(texts):
            prompt_ids = chat_ids(tokenizer, Conversation.of(text).first_request())[
                : target.max_len - args.max_tokens - 2
            ]
            answer = greedy_answer(target, prompt_ids, args.max_tokens)
            conversations.append({"ids": prompt_ids + answer, "answer": [0] * len(prompt_ids) + [1] * len(answer)})
            firsts.append(len(prompt_ids))
            asked.append(prompt_ids)
            names.append(f"{kind}[{index}]")
    rows = collect_features(target, conversations, default_aux_layers(len(target.layers)))
    head = load_head(head_dir, target, blocks=False)  # the training code's measure reads its float weights
    target_rows = target.weights.dense(target.lm_head, "weight").float()[head.draft_to_target]  # [Vd, E]
    results = {}
    for name, row, first in zip(names, rows, firsts, strict=True):
        window = [(0, 0, len(row["ids"]))]
        with torch.no_grad():
            _, unrolled = unrolled_loss(head, target, make_batch([row], window), target_rows, 4)
        results[name] = {
            "serving_first_draft": round(serving_agreement(head, row, first), 3),
            "unrolled_per_step": [round(a, 3) for a in unrolled],
        }
    config = EngineConfig(
        drafter="eagle3", draft_head=head_dir, num_draft_tokens=4, max_model_len=2048, activations=args.activations
    )
    runner = EngineRunner(load_engine(config, show_progress=False).engine)
    for name, prompt_ids in zip(names, asked, strict=True):
        run = runner.run("eagle3", False, prompt_ids, args.max_tokens, name)
        results[name]["tokens_per_forward_k4"] = round(run.tokens_per_forward, 3)
    by_type: dict[str, list[float]] = {}
    per_forward: dict[str, list[float]] = {}
    for name, result in results.items():
        by_type.setdefault(name.split("[")[0], []).append(result["serving_first_draft"])
        per_forward.setdefault(name.split("[")[0], []).append(result["tokens_per_forward_k4"])
    report = {
        "host": host(),
        "head": head.describe(),
        "activations": args.activations,
        "training_report": json.loads((Path(head_dir) / "training.json").read_text()).get("held_out_top1_per_step"),
        "max_tokens": args.max_tokens,
        "first_draft_by_type": {kind: round(sum(v) / len(v), 3) for kind, v in by_type.items()},
        "tokens_per_forward_k4_by_type": {kind: round(sum(v) / len(v), 3) for kind, v in per_forward.items()},
        "prompts": results,
    }
    report["unseen_acceptance"] = round(sum(r["serving_first_draft"] for r in results.values()) / len(results), 3)
    if args.record:
        training = Path(head_dir) / "training.json"
        recorded = json.loads(training.read_text())
        recorded["unseen_acceptance"] = report["unseen_acceptance"]
        recorded["unseen_acceptance_from"] = (
            f"bench/studies/eagle3_unseen.py: the mean first-draft agreement over the {len(results)} prompts of "
            f"bench/prompts.yaml, greedy, {args.max_tokens} tokens each, {args.activations} activations"
        )
        training.write_text(json.dumps(recorded, indent=2) + "\n")
    (BENCH / "results").mkdir(exist_ok=True)
    out = BENCH / "results" / f"eagle3_unseen{'-' + args.name if args.name else ''}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    summary = ("head", "training_report", "unseen_acceptance", "first_draft_by_type", "tokens_per_forward_k4_by_type")
    print(json.dumps({key: report[key] for key in summary}, indent=2))


if __name__ == "__main__":
    main()
