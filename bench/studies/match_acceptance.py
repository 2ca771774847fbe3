"""Study: how often does a text match's first draft pass, by match length and sampling? Answer: docs/drafters.md#damped-requests, docs/drafters.md#a-split-continuation, docs/drafters.md#a-damped-head.

Where ``auto``'s text-match priors come from (engine/drafters/auto_state.py, MATCH_PRIORS and
DAMPED_MATCH_PRIORS). ``suffix`` alone drafts the first turn of every chat, prose, code and summarise
prompt of bench/prompts.yaml, 96 tokens, each request its own scope, under each sampling setting
(temperatures 0 to 1 with no penalty; greedy, 0.1 and 0.8 under the embedded model's repetition
penalty of 1.1 and top_p of 0.9; sampled ones seeded 0 and 1). Every drafted step's first draft is
filed by the length of the match it continues (1, 2-3, 4-7, 8 or more tokens: ``suffix@1`` ...; a
match of 1 to 3 whose first draft was one of several continuations seen after it apart: ``suffix@1?``,
``suffix@2?``) and by type (chat and prose; code and summaries): how many passed of how many were drafted.

    .venv/bin/python bench/studies/match_acceptance.py [--max-tokens 96] [--head]

Writes the "match acceptance" entry of bench/results/auto_choices.json. ``--head``: the shipped EAGLE-3
head's one-draft steps instead (``eagle3`` alone at k = 1), whose first drafts passed, by type and
sampling, where ``auto``'s prior for a damped request comes from (DAMPED_MODEL_FACTOR): the entry
"head acceptance".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from bench.runners import chat_ids  # noqa: E402
from bench.studies.auto_overhead import bench_prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.drafters.auto_state import match_track  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

BENCH = Path(__file__).resolve().parents[1]
GROUPS = {
    "chat": "chat and prose",
    "prose": "chat and prose",
    "code": "code and summaries",
    "summarise": "code and summaries",
}
PENALISED = {"repetition_penalty": 1.1, "top_p": 0.9}
SETTINGS = {
    **{f"temperature {t}": {"temperature": t} for t in (0.0, 0.1, 0.3, 0.5, 0.8, 1.0)},
    **{f"temperature {t}, repetition penalty 1.1, top_p 0.9": {"temperature": t, **PENALISED} for t in (0.0, 0.1, 0.8)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--head", action="store_true", help="the EAGLE-3 head's first drafts, not suffix's")
    args = parser.parse_args()
    if args.head:
        return head_acceptance(args.max_tokens)
    loaded = load_engine(EngineConfig(drafter="suffix", draft=None, max_model_len=4096), show_progress=False)
    suffix = loaded.engine.drafter("suffix")
    drafted: list[tuple[int, bool, int]] = []  # (match length, split, first draft passed) per drafted step
    offer, accept, pending = suffix.offer, suffix.accept, {}

    def offering(token_ids: list[int], limit: int) -> list[int]:
        tokens = offer(token_ids, limit)
        pending["step"] = (len(token_ids), suffix.match_length, suffix.match_split) if tokens else None
        return tokens

    def accepting(num_committed: int) -> None:
        if (step := pending.pop("step", None)) is not None:
            drafted.append((step[1], step[2], int(num_committed > step[0])))
        accept(num_committed)

    suffix.offer, suffix.accept = offering, accepting
    prompts = first_turns(loaded.tokenizer)
    results: dict = {}
    for setting, sampling in SETTINGS.items():
        counts: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # group -> track -> [passed, drafted]
        for group, _ in requests(loaded.engine, prompts, "suffix", args.max_tokens, setting, sampling):
            for length, split, passed in drafted:
                tally = counts[group][match_track("suffix", length, split=split)]
                tally[0] += passed
                tally[1] += 1
            drafted.clear()
        results[setting] = {
            group: {track: f"{p}/{n}" for track, (p, n) in sorted(by.items())} for group, by in counts.items()
        }
        print(setting, results[setting], flush=True)
    write("match acceptance", "first drafts of suffix alone that passed, of those drafted", args.max_tokens, results)


def head_acceptance(max_tokens: int) -> None:
    """``--head``: the head drafting one token a step, alone, on the same prompts and settings."""
    config = EngineConfig(drafter="eagle3", draft=None, num_draft_tokens=1, max_model_len=4096)
    loaded = load_engine(config, show_progress=False)
    prompts = first_turns(loaded.tokenizer)
    results: dict = {}
    for setting, sampling in SETTINGS.items():
        counts: dict = defaultdict(lambda: [0, 0])  # group -> [passed, drafted]
        for group, last in requests(loaded.engine, prompts, "eagle3", max_tokens, setting, sampling):
            counts[group][0] += last.stats.accepted_tokens
            counts[group][1] += last.stats.drafted_tokens
        results[setting] = {group: f"{p}/{n} = {p / max(n, 1):.3f}" for group, (p, n) in counts.items()}
        print(setting, results[setting], flush=True)
    write(
        "head acceptance", "the EAGLE-3 head's drafts (one a step) that passed, of those drafted", max_tokens, results
    )


def first_turns(tokenizer) -> list[tuple[str, list[int]]]:
    """(type, token ids) of the first turn of every prompt of bench/prompts.yaml of GROUPS' types."""
    return [(kind, chat_ids(tokenizer, messages)) for kind, messages in bench_prompts() if kind in GROUPS]


def requests(engine, prompts: list[tuple[str, list[int]]], drafter: str, max_tokens: int, setting: str, sampling: dict):
    """``drafter`` alone on ``prompts`` under one setting, seeded 0 and 1 where sampled, each request its
    own scope: (its group, its last output) as each ends."""
    for index, (kind, prompt_ids) in enumerate(prompts):
        for seed in (0, 1) if sampling["temperature"] else (0,):
            params = SamplingParams(max_tokens=max_tokens, seed=seed, **{"repetition_penalty": 1.0, **sampling})
            scope = f"{setting}/{kind}{index}/{seed}"
            *_, last = engine.generate(Request(scope, prompt_ids, params, drafter=drafter, tenant=scope))
            yield GROUPS[kind], last


def write(entry: str, study: str, max_tokens: int, results: dict) -> None:
    out = BENCH / "results" / "auto_choices.json"
    report = json.loads(out.read_text()) if out.is_file() else {}
    report[entry] = {
        "host": host(bandwidth=False),
        "study": f"bench/studies/match_acceptance.py: {study}",
        "max_tokens": max_tokens,
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
