"""Study: does cutting the EAGLE-3 head's draft where it is unsure make it pay? Answer: docs/drafters.md.

Would stopping the EAGLE-3 head's draft where it is unsure make it pay? Counted, not timed.

The embedded target serves every first request of bench/prompts.yaml with the shipped head alone
(greedy, 96 tokens, k = 4), its chain cut at the first position where the head's own top
probability (softmax of its logits, before the request's transforms: at temperature 0 those make q
one-hot) falls below a threshold. Every step's drafted and accepted tokens are recorded, then
priced by the target's forward over 1 to 8 rows and the head's step as bench/results/int8.json
measured them on a Zen 4 host (float32 and int8 activations), the head's steps counted as the ones
that drafted and the one that stopped the chain. Output per threshold and prompt type: tokens per
target forward, and modelled speed against target-only (a one-row forward a token).

    .venv/bin/python bench/studies/eagle3_gate.py [--thresholds 0,0.3,0.5,0.7,0.9]

Writes bench/results/eagle3_gate.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine.drafters.eagle3 as eagle3_module  # noqa: E402
from bench.host import host  # noqa: E402
from bench.runners import Conversation, EngineRunner, chat_ids  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.drafters.base import Proposal  # noqa: E402
from engine.engine import SpecEngine  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.spec import sample_one  # noqa: E402

BENCH = Path(__file__).resolve().parents[1]
# by activations: ms of a forward by rows and of a head step, as bench/studies/int8.py measured them
COSTS = {
    name: ({int(rows): ms for rows, ms in served["ms_by_rows"].items()}, served["head_step_ms"])
    for name, served in json.loads((BENCH / "results" / "int8.json").read_text())["served_rows"].items()
}


def gated_chain(logits, advance, num_draft_tokens, sampler, threshold: float) -> Proposal:
    """sample_chain's draft, stopped before the first position whose top probability (the head's
    own, at temperature 1) is below ``threshold``; q stays the request's, so verification is exact."""
    tokens, rows = [], []
    while len(tokens) < num_draft_tokens:
        if threshold and float(torch.softmax(logits[0].float(), -1).max()) < threshold:
            break
        appended = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)
        q = sampler.probs(logits, appended)[0]  # [V]
        tokens.append(sample_one(q, sampler.generator))
        rows.append(q)
        if len(tokens) < num_draft_tokens:
            logits = advance(tokens[-1].view(1))
    if not tokens:
        return Proposal.empty(logits.device)
    return Proposal(torch.stack(tokens), torch.stack(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--thresholds", default="0,0.3,0.5,0.6,0.7,0.8,0.9")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    args = parser.parse_args()
    steps: list[tuple[int, int, int]] = []  # (asked, drafted, accepted) per step
    step = SpecEngine.step

    def recording_step(self, seq, num_draft_tokens):
        result = step(self, seq, num_draft_tokens)
        steps.append((num_draft_tokens, result.record.num_drafted, result.record.num_accepted))
        return result

    SpecEngine.step = recording_step
    loaded = load_engine(EngineConfig(max_model_len=4096, num_draft_tokens=args.num_draft_tokens), show_progress=False)
    runner = EngineRunner(loaded.engine)
    prompts = yaml.safe_load((BENCH / "prompts.yaml").read_text())
    results = {}
    for threshold in (float(value) for value in args.thresholds.split(",")):
        eagle3_module.sample_chain = functools.partial(gated_chain, threshold=threshold)
        by_type = {}
        for kind, entries in prompts.items():
            tokens = forwards = 0
            ms = dict.fromkeys(COSTS, 0.0)
            for index, entry in enumerate(entries):
                prompt_ids = chat_ids(loaded.tokenizer, Conversation.of(entry).first_request())
                steps.clear()
                runner.run("eagle3", False, prompt_ids, args.max_tokens, f"{kind}{index}@{threshold}")
                for asked, drafted, accepted in steps[1:]:  # the first also read the prompt
                    head_steps = min(asked, drafted + 1)  # the drafts, and the look that stopped the chain
                    tokens, forwards = tokens + accepted + 1, forwards + 1
                    for name, (forward_ms, head_ms) in COSTS.items():
                        ms[name] += forward_ms[1 + drafted] + head_ms * head_steps
            by_type[kind] = {"tokens_per_forward": round(tokens / forwards, 3)} | {
                f"vs_target_only_{name}": round(forward_ms[1] * tokens / ms[name], 3)
                for name, (forward_ms, _) in COSTS.items()
            }
        geomeans = {
            name: round(statistics.geometric_mean(row[f"vs_target_only_{name}"] for row in by_type.values()), 3)
            for name in COSTS
        }
        results[str(threshold)] = {"by_type": by_type, "geomean_vs_target_only": geomeans}
        print(threshold, json.dumps(results[str(threshold)]), flush=True)
    out = BENCH / "results" / "eagle3_gate.json"
    report = {"host": host(bandwidth=False), "settings": vars(args) | {"costs_ms": COSTS}}
    out.write_text(json.dumps(report | {"by_threshold": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
