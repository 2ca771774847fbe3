"""Study: does auto lose to target-only, or to its best single candidate, where nothing repeats? Answer: docs/drafters.md#auto-where-nothing-repeats.

The embedded default in this process (no HTTP), each request its own scope, so no request learns
from another: target-only, ``suffix``, ``eagle3``, ``model`` (when a draft copy is kept) and
``auto``, taking turns request by request, on a chat answer, open prose and a summary that reuses
its passage's wording, greedy and at temperature 0.8 (seeded, a new seed each round), 96 tokens.
Reports decode tokens/s (after the first arrival: ``Run.decode_tokens_per_s``) by configuration, each over target-only,
auto's steps by drafter, and what auto itself spends a step (``OwnTime``): asking the text
matchers for their offers (which ``suffix`` alone pays too), choosing, and its bookkeeping after
the verify (its candidates' own ``accept`` left out); and per case its steps' wall time
(``StepTimes``): target-only's mean step, and ``auto``'s by who drafted, with what they came to
over the same tokens at target-only's step (``step_costs``).

    .venv/bin/python bench/studies/auto_overhead.py [--draft copy:int8] [--rounds 2] [--prompts bench [--one-scope]]
    .venv/bin/python bench/studies/auto_overhead.py --priced [--prices 4.4,5.53,6.39,7.43,8.73] [--more-prompts]
        [--head-step 0.7]

``--priced``: auto's choices alone, free of the host's noise. Its prices are held at ``PRICES`` (a
plain step 4.4 ms; a verify 0.9 ms more for the first draft, 0.5 for each further; a head's step
0.7 ms) and each step is costed at them, on this study's prompts and the bench's, greedy and at 0.8
under two seeds: the text is the target's for the seed whatever drafts it, so two versions of auto
compare exactly (the int8 target, pinned). Reports ``suffix`` and ``auto`` over target-only, as
modeled seconds, under the entry "priced choices", and beside them ``hindsight``: the cheapest split
of the same text into plain steps and ``suffix``'s offers cut to any k, chosen knowing which drafts
pass (a bound no policy that chooses before the verify reaches with that drafter). ``--prices``: a
verify's milliseconds by drafts (0 to 4) instead, such as a host's own (its entry named by them);
``--more-prompts``: also the prompts of bench/studies/priced_prompts.yaml, a second sample of the
bench's kinds (types ``more-*``), so what two prompts of a type show can be checked on others;
``--head-step``: a head's step in ms instead of HEAD_STEP. A head's step is also charged HEAD_READ a
token it read beyond a step's two (catching up on what it missed), at which ``auto`` prices it too.

``--draft``: the draft the engine keeps (default: as the server would, ``copy:auto``, which keeps
none where the target alone is faster). ``--prompts bench``: the first turn of every prompt of
bench/prompts.yaml instead, by type (code, summaries, long documents, where text repeats);
``--one-scope``: each configuration's requests share one scope per round, as one user's traffic
mixing the types would (auto's priors then carry from one type to the next). Writes
bench/results/auto_overhead.json, one entry per ``--draft`` and prompt set (a run replaces its own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from bench.runners import Conversation, EngineRunner, chat_ids  # noqa: E402
from engine.adaptive import StepCosts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cpu.int8_blocks import held_activations  # noqa: E402
from engine.drafters.suffix import SuffixDrafter  # noqa: E402
from engine.factory import load_engine  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
PROMPTS = {
    "chat": "What do you like most about autumn? Answer in a friendly, conversational way.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "summary": (
        "Summarise this in two sentences, reusing its wording: The river Thames flows through London. It is the "
        "longest river entirely in England. The Thames has been an important trade route for centuries, and many "
        "of London's landmarks stand on its banks, including the Houses of Parliament and the Tower of London."
    ),
}
TEMPERATURES = (0.0, 0.8)
PRICES = {0: 4.4e-3, 1: 5.3e-3, 2: 5.8e-3, 3: 6.3e-3, 4: 6.8e-3}  # --priced: a verify by drafts, seconds
HEAD_STEP = 0.7e-3  # --priced: a head's (or draft model's) step, seconds
HEAD_READ = 0.08e-3  # --priced: each token it reads beyond a step's two (catching up), seconds
BENCH_PROMPTS = Path(__file__).resolve().parents[1] / "prompts.yaml"
MORE_PROMPTS = Path(__file__).resolve().parent / "priced_prompts.yaml"


def bench_prompts() -> list[tuple[str, list[dict]]]:
    """(type, first request's messages) for every prompt of bench/prompts.yaml."""
    kinds = yaml.safe_load(BENCH_PROMPTS.read_text())
    return [(kind, Conversation.of(item).first_request()) for kind, items in kinds.items() for item in items]


class OwnTime:
    """Wall time auto spends in its own parts, per step, by wrapping the instance's methods."""

    PARTS = ("offers", "choose", "books")

    def __init__(self, auto) -> None:
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.steps = 0
        self.auto = auto
        auto._offers = self._timed("offers", auto._offers)
        auto._choose = self._timed("choose", auto._choose)
        for candidate in auto.candidates.values():
            candidate.accept = self._timed("books", candidate.accept, sign=-1.0)  # not auto's own
        auto.accept = self._timed("books", auto.accept, count=True)

    def _timed(self, part: str, method, sign: float = 1.0, count: bool = False):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = method(*args, **kwargs)
            self.seconds[part] += sign * (time.perf_counter() - started)
            self.steps += count
            return result

        return timed

    def per_step_ms(self) -> dict[str, float]:
        return {part: round(1e3 * seconds / max(self.steps, 1), 3) for part, seconds in self.seconds.items()}


class StepTimes:
    """Every step's wall time (its drafting and its verify) by configuration, a request's first step
    (which reads the prompt) left out, by wrapping the engine's ``step``: where ``auto`` loses time
    against target-only, its plain steps' own cost apart from its drafting steps'."""

    def __init__(self, engine) -> None:
        self.records: list = []
        self.by_config: dict[str, list] = {}
        step = engine.step

        def recorded(seq, num_draft_tokens):
            result = step(seq, num_draft_tokens)
            self.records.append(result.record)
            return result

        engine.step = recorded

    def keep(self, config: str) -> None:
        """The steps of the request just run, under ``config``."""
        self.by_config.setdefault(config, []).extend(self.records[1:])
        self.records = []

    def losses(self, plain: str = "none", auto: str = "auto") -> dict:
        """Mean ms of target-only's steps and of ``auto``'s by who drafted, and what ``auto``'s time
        came to over its tokens at target-only's step: its plain steps' extra, and its drafting steps'."""
        plain_steps = self.by_config.get(plain, [])
        if not plain_steps:
            return {}
        per_step = statistics.mean(r.draft_seconds + r.verify_seconds for r in plain_steps)
        by: dict[str, list] = {}
        for record in self.by_config.get(auto, []):
            by.setdefault(record.drafter if record.num_drafted else "none", []).append(record)
        out = {"target_only_step_ms": round(1e3 * per_step, 3)}
        for name, records in by.items():
            seconds = sum(r.draft_seconds + r.verify_seconds for r in records)
            tokens = sum(r.num_emitted for r in records)
            out[name] = {
                "steps": len(records),
                "drafted": sum(r.num_drafted for r in records),
                "accepted": sum(r.num_accepted for r in records),
                "step_ms": round(1e3 * seconds / len(records), 3),
                "ms_over_target_only": round(1e3 * (seconds - tokens * per_step), 1),
            }
        return out


class HeldReads(dict):
    """Catch-up prices as set, whatever the catch-ups take (``--priced``)."""

    def __setitem__(self, name: str, seconds: float) -> None:
        pass


class HeldCosts(StepCosts):
    """Prices as set, whatever the steps take (``--priced``)."""

    def observe(self, k: int, draft_seconds: float, verify_seconds: float) -> None:
        pass


def priced(
    engine, tokenizer, max_tokens: int, prices: dict[int, float], more: bool = False, head_step: float = HEAD_STEP
) -> dict:
    """``--priced``: each case's speed under ``suffix`` and ``auto`` over target-only's, modeled at ``prices``."""
    auto = engine.drafter("auto")
    auto.verify = HeldCosts()
    auto.verify.expect(verify=prices)
    for name in auto.draft_costs:
        auto.draft_costs[name] = HeldCosts()
        auto.draft_costs[name].expect(draft=head_step)
    auto.catch_up, auto.extra_row = HeldReads(dict.fromkeys(auto.draft_costs, HEAD_READ)), {}
    runner, times, scopes = EngineRunner(engine), StepTimes(engine), iter(range(10**9))
    lags: dict[int, int] = {}  # by step of the request: what a model candidate read before drafting

    def lagged(candidate):
        propose = candidate.propose

        def timed(token_ids, num_draft_tokens, sampler):
            lags[len(times.records)] = candidate.lag(token_ids)
            return propose(token_ids, num_draft_tokens, sampler)

        return timed

    for name in auto.draft_costs:
        auto.candidates[name].propose = lagged(auto.candidates[name])
    texts: dict[str, list[int]] = {}  # the last run's output by drafter: the target's text for its seed

    def modeled(drafter: str, prompt: list[int], sampling: dict | None) -> tuple[float, int]:
        """(the request's steps at ``prices``, the output tokens they made), the first step (the prompt's)
        left out (a last step's tokens past a stop are not output)."""
        run = runner.run(drafter, False, prompt, max_tokens, f"priced{next(scopes)}", sampling)
        texts[drafter] = run.token_ids
        first, *steps = times.records
        times.records = []
        drafting = sum(
            head_step * r.num_drafted + HEAD_READ * max(lags.get(index, 0) - 2, 0)
            for index, r in enumerate(steps, start=1)
            if r.drafter in auto.draft_costs
        )
        lags.clear()
        cost = sum(prices[min(r.num_drafted, max(prices))] for r in steps) + drafting
        return cost, max(len(run.token_ids) - first.num_emitted, 0)

    prompts = [(kind, [{"role": "user", "content": text}]) for kind, text in PROMPTS.items()] + bench_prompts()
    if more:
        more_kinds = yaml.safe_load(MORE_PROMPTS.read_text())
        prompts += [
            (f"more-{kind}", [{"role": "user", "content": text}])
            for kind, items in more_kinds.items()
            for text in items
        ]
    totals: dict[str, dict[str, list[float]]] = {}  # case -> drafter -> [modeled seconds, tokens]
    for kind, messages in prompts:
        prompt = chat_ids(tokenizer, messages)
        for temperature in TEMPERATURES:
            for seed in (11, 12) if temperature else (None,):
                sampling = {"temperature": temperature, "seed": seed} if temperature else None
                case = totals.setdefault(f"{kind}@{temperature}", {})
                for drafter in ("suffix", "auto"):
                    cost, tokens = modeled(drafter, prompt, sampling)
                    total = case.setdefault(drafter, [0.0, 0])
                    total[0], total[1] = total[0] + cost, total[1] + tokens
                assert texts["suffix"] == texts["auto"], "a seed's text is the target's whatever drafts"
                most = min(max(prices), engine.config.num_draft_tokens)
                cost, tokens = hindsight(prompt, texts["suffix"], prices, most, max_tokens)
                total = case.setdefault("hindsight", [0.0, 0])
                total[0], total[1] = total[0] + cost, total[1] + tokens
    # over target-only: a plain step for each of the same tokens
    return {
        case: {name: round(prices[0] * tokens / cost, 3) for name, (cost, tokens) in by.items()}
        for case, by in totals.items()
    }


def hindsight(
    prompt: list[int], output: list[int], prices: dict[int, float], most: int, max_tokens: int
) -> tuple[float, int]:
    """(the cheapest split of ``output`` into steps at ``prices``, the tokens after the first step's one):
    each step plain or ``suffix``'s offer there (as it runs alone, on the text so far) cut to any k,
    chosen knowing how many of its drafts the text then matches: what no policy that must choose
    before the verify can beat with this drafter. The first step (the prompt's) makes one token."""
    suffix = SuffixDrafter(torch.device("cpu"), None)
    suffix.begin(prompt)
    text, start, end = prompt + output, len(prompt) + 1, len(prompt) + len(output)
    cheapest = {end: 0.0}  # from each position to the end
    offers = []
    for position in range(start, end):
        made = position - len(prompt)  # tokens output before this step (the engine's limit)
        drafts = suffix.offer(text[:position], min(most, max_tokens - made - 1))
        passed = [token == (text[position + i] if position + i < end else None) for i, token in enumerate(drafts)]
        offers.append((len(drafts), passed.index(False) if False in passed else len(drafts)))
    for position in range(end - 1, start - 1, -1):
        offered, matched = offers[position - start]
        cheapest[position] = min(
            prices[k] + cheapest[min(position + 1 + min(matched, k), end)] for k in range(offered + 1)
        )
    return cheapest[start], max(end - start, 0)


def write_entry(entry: str, result: dict) -> None:
    """bench/results/auto_overhead.json's ``entry`` (a run replaces its own), with the host."""
    path = RESULTS / "auto_overhead.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    report[entry] = {"host": host(), **result}
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="copy:auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", choices=("own", "bench"), default="own", help="this study's three, or the bench's")
    parser.add_argument("--one-scope", action="store_true", help="one scope per configuration and round")
    parser.add_argument("--priced", action="store_true", help="auto's choices costed at fixed prices")
    parser.add_argument("--prices", help="--priced: a verify's ms by drafts 0-4, comma-separated (default: PRICES)")
    parser.add_argument("--more-prompts", action="store_true", help="--priced: also bench/studies/priced_prompts.yaml")
    parser.add_argument("--head-step", type=float, help="--priced: a head's step in ms (default: HEAD_STEP)")
    args = parser.parse_args()
    if args.priced:
        loaded = load_engine(EngineConfig(activations="int8"), show_progress=False)
        prices = PRICES if args.prices is None else dict(enumerate(float(ms) / 1e3 for ms in args.prices.split(",")))
        head_step = HEAD_STEP if args.head_step is None else args.head_step / 1e3
        table = priced(loaded.engine, loaded.tokenizer, args.max_tokens, prices, args.more_prompts, head_step)
        ratios = [row["auto"] for row in table.values()]
        worst = min(table, key=lambda case: table[case]["auto"] / table[case]["suffix"])
        summary = {
            "auto_over_target_only": {"geomean": round(statistics.geometric_mean(ratios), 4), "least": min(ratios)},
            "auto_over_suffix_least": {worst: round(table[worst]["auto"] / table[worst]["suffix"], 3)},
            **{
                f"{name}_over_hindsight_geomean": round(
                    statistics.geometric_mean(row[name] / row["hindsight"] for row in table.values()), 4
                )
                for name in ("suffix", "auto")
            },
        }
        candidates = list(loaded.engine.drafter("auto").candidates)  # a head start-up left out is not one
        entry = (
            "priced choices"
            + (f" at {args.prices} ms" if args.prices else "")
            + (", more prompts" if args.more_prompts else "")
            + (f", head step {args.head_step} ms" if args.head_step and "eagle3" in candidates else "")
            + ("" if "eagle3" in candidates else ", no head")
        )
        head = {"head_step_s": head_step} if "eagle3" in candidates else {}
        write_entry(entry, {"prices_s": prices, "candidates": candidates, **head, **summary, "results": table})
        for case, row in table.items():
            print(case, row, "auto over suffix %.3f" % (row["auto"] / row["suffix"]))
        print(summary)
        return
    if args.prompts == "bench":
        prompts = bench_prompts()
    else:
        prompts = [(kind, [{"role": "user", "content": text}]) for kind, text in PROMPTS.items()]
    loaded = load_engine(EngineConfig(draft=None if args.draft == "none" else args.draft), show_progress=False)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    drafters = ["none", "suffix", "eagle3", *(["model"] if engine.draft is not None else []), "auto"]
    runner = EngineRunner(engine)
    own = OwnTime(engine.drafter("auto"))
    times = StepTimes(engine)
    rates: dict[str, dict[str, list[float]]] = {}
    steps: dict[str, dict[str, int]] = {}
    for round_index in range(args.rounds):
        for index, (kind, messages) in enumerate(prompts):
            prompt = chat_ids(tokenizer, messages)
            for temperature in TEMPERATURES:
                case = f"{kind}@{temperature}"
                sampling = {"temperature": temperature, "seed": 11 + round_index} if temperature else None
                for drafter in drafters:  # taking turns, request by request
                    scope = f"{drafter}{round_index}" if args.one_scope else f"{index}{case}{drafter}{round_index}"
                    run = runner.run(drafter, False, prompt, args.max_tokens, scope, sampling)
                    times.keep(f"{case} {drafter}")
                    rates.setdefault(case, {}).setdefault(drafter, []).append(run.decode_tokens_per_s)
                    if drafter == "auto":
                        for name, count in run.steps_by_drafter.items():
                            steps.setdefault(case, {})[name] = steps.get(case, {}).get(name, 0) + count
    table = {}
    for case, by_drafter in rates.items():
        plain = statistics.median(by_drafter["none"])
        singles = {
            name: statistics.median(values) for name, values in by_drafter.items() if name not in ("none", "auto")
        }
        auto = statistics.median(by_drafter["auto"])
        best = max(singles, key=singles.__getitem__)
        table[case] = {
            "tokens_per_s": {name: round(statistics.median(values), 1) for name, values in by_drafter.items()},
            "over_target_only": {
                name: round(statistics.median(values) / plain, 3) for name, values in by_drafter.items()
            },
            "auto_over_best_single": round(auto / singles[best], 3),
            "best_single": best,
            "auto_steps": steps.get(case, {}),
            "step_costs": times.losses(f"{case} none", f"{case} auto"),
        }
    entry = (
        f"draft {args.draft}" + ("" if args.prompts == "own" else ", bench prompts") + ", one scope" * args.one_scope
    )
    write_entry(
        entry,
        {
            "model": f"embedded SmolLM2-135M-Instruct on its GGUF blocks, {held_activations(engine.target)} activations,"
            " in process",
            "kept_draft": engine.config.draft,
            "rounds": args.rounds,
            "scopes": "one per configuration and round" if args.one_scope else "one per request",
            "max_tokens": args.max_tokens,
            "results": table,
            "auto_own_ms_per_step": own.per_step_ms(),
            "auto_steps": own.steps,
        },
    )
    for case, row in table.items():
        print(case, row["over_target_only"], "auto/best single", row["auto_over_best_single"], row["auto_steps"])
    print("auto's own ms per step:", own.per_step_ms(), "over", own.steps, "steps")


if __name__ == "__main__":
    main()
