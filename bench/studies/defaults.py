"""Study: which request defaults give the embedded model short, right answers that end by themselves? Answer: docs/api.md#defaults.

Samples the embedded target alone (the output law every drafter keeps) over the README's first
question and a few plain ones, for candidate defaults (temperature, top_p, a mild repetition penalty
as llama.cpp and Ollama apply, a length cap), each sample seeded so the run repeats. An answer counts
as good when it names the expected word and ends by itself (end of sequence) within 64 tokens.

    .venv/bin/python bench/studies/defaults.py [--samples 20]    # writes bench/results/defaults.json

``--activations int8 --questions 1``: the int8 target (docs/internals.md#int8-activations) on the
README's question alone, written to bench/results/defaults-int8.json.

``--first-seed 1000 --candidates chosen,frequency [--system TEXT]``: other seeds than the table's,
a few candidates, a system message of the request's own (else the template's): written as a section
named after them in the same file, beside the table's run.

    .venv/bin/python bench/studies/defaults.py --activations int8 --questions 1 --samples 60 --first-seed 1000 --candidates chosen,frequency
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for bench.host
from bench.host import host  # noqa: E402
from bench.runners import chat_ids  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
QUESTIONS = [  # (question, a word a right answer names)
    ("What is the capital of France?", "paris"),
    ("What is the capital of Japan?", "tokyo"),
    ("How many legs does a spider have?", "eight|8"),
    ("Who wrote Romeo and Juliet?", "shakespeare"),
    ("What is the largest planet in the solar system?", "jupiter"),
    ("What colour is the sky on a clear day?", "blue"),
    # a copy from the prompt, which a repetition penalty (prompt tokens included, as in transformers) works against
    (
        "Repeat this sentence exactly: The old lighthouse keeper climbed the stairs every night.",
        "climbed the stairs every night",
    ),
]
CANDIDATES = {  # name: sampling fields
    "model card (t 0.2, top_p 0.9)": {"temperature": 0.2, "top_p": 0.9},
    "t 0.2, top_p 0.9, repetition 1.05": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.05},
    "t 0.1, top_p 0.9": {"temperature": 0.1, "top_p": 0.9},
    "t 0.1, top_p 0.9, repetition 1.05": {"temperature": 0.1, "top_p": 0.9, "repetition_penalty": 1.05},
    "t 0.1, top_p 0.9, repetition 1.1": {"temperature": 0.1, "top_p": 0.9, "repetition_penalty": 1.1},
    "greedy": {"temperature": 0.0},
    "greedy, repetition 1.1": {"temperature": 0.0, "repetition_penalty": 1.1},
}
CHOSEN = "t 0.1, top_p 0.9, repetition 1.1"  # engine/model/loader.py's EMBEDDED_GENERATION
MORE = {  # asked by name only (--candidates): the chosen defaults with a penalty on the output's own repeats
    "frequency": {"temperature": 0.1, "top_p": 0.9, "repetition_penalty": 1.1, "frequency_penalty": 0.6},
}
WITHIN = 64  # tokens an answer must end within
CAP = 256  # how far a sample may run, to see how long the ramblers go
OPENING = 40  # characters of an answer's opening counted alike


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20, help="seeded samples per question and candidate")
    parser.add_argument("--activations", default="float32", help="the target's activations (float32, int8)")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), help="the first N questions (1: the README's)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + samples - 1")
    parser.add_argument(
        "--candidates", default="", help="comma-separated: 'chosen', names of MORE (default: the table's)"
    )
    parser.add_argument("--system", default=None, help="a system message sent before each question")
    args = parser.parse_args()
    named = {"chosen": (CHOSEN, CANDIDATES[CHOSEN]), **{name: (name, fields) for name, fields in MORE.items()}}
    candidates = dict(named[name] for name in args.candidates.split(",")) if args.candidates else CANDIDATES
    opening = [{"role": "system", "content": args.system}] if args.system else []
    section = args.candidates or args.first_seed or args.system  # a run beside the table's, not the table
    config = EngineConfig(drafter="none", draft=None, max_model_len=2048, activations=args.activations)
    loaded = load_engine(config, show_progress=False)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    rows, started = {}, time.time()
    for name, fields in candidates.items():
        per_question = {}
        for question, expected in QUESTIONS[: args.questions]:
            prompt = chat_ids(tokenizer, [*opening, {"role": "user", "content": question}])
            counts = {"good": 0, "right": 0, "ended": 0, "ended_within_cap": 0, "tokens": []}
            openings = Counter()  # how answers begin: a count can be good by naming the word in nonsense
            samples = 1 if fields["temperature"] == 0 else args.samples
            for seed in range(args.first_seed, args.first_seed + samples):
                params = SamplingParams(max_tokens=CAP, seed=seed, **fields)
                ids, finish = [], None
                for out in engine.generate(Request(f"{name}-{seed}", prompt, params)):
                    ids += out.token_ids
                    finish = out.finish_reason or finish
                text = tokenizer.decode(ids, skip_special_tokens=True).lower()
                right = any(word in text for word in expected.split("|"))
                ended = finish == "stop" and len(ids) <= WITHIN
                counts["right"] += right
                counts["ended"] += ended
                counts["ended_within_cap"] += finish == "stop"
                counts["good"] += right and ended
                counts["tokens"].append(len(ids))
                openings[text[:OPENING]] += 1
            counts["samples"] = samples
            counts["openings"] = dict(openings.most_common(3))
            counts["example"] = text[:160]
            per_question[question] = counts
        total = sum(q["samples"] for q in per_question.values())
        good = sum(q["good"] for q in per_question.values())
        readme = per_question[QUESTIONS[0][0]]
        shares = {
            key: round(sum(q[key] for q in per_question.values()) / total, 3)
            for key in ("right", "ended", "ended_within_cap")
        }
        rows[name] = {
            "fields": fields,
            "good_share": round(good / total, 3),
            **{f"{key}_share": value for key, value in shares.items()},
            "readme_good_share": round(readme["good"] / readme["samples"], 3),
            "questions": per_question,
        }
        print(f"{name}: good {good}/{total}, README question {readme['good']}/{readme['samples']}", flush=True)
        RESULTS.mkdir(exist_ok=True)  # written after each candidate: a stopped run keeps what it measured
        report = {
            "host": host(),
            "samples": args.samples,
            "first_seed": args.first_seed,
            "system": args.system,
            "activations": loaded.engine.config.activations,
            "within_tokens": WITHIN,
            "cap": CAP,
            "seconds": round(time.time() - started),
            "candidates": rows,
        }
        name = "defaults" if args.activations == "float32" else f"defaults-{args.activations}"
        path = RESULTS / f"{name}.json"
        if section:  # beside the table's run, under what it asked
            title = (
                f"{args.questions} of {len(QUESTIONS)} questions, seeds {args.first_seed}+, {args.candidates or 'the table'}"
                + (f", system {args.system!r}" if args.system else "")
            )
            report = {**json.loads(path.read_text()), title: report} if path.exists() else {title: report}
        path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
