"""Study: what does top_p cost a step, full sort against partial top-k and the floor? Answer: docs/internals.md#the-speculative-step.

What top_p costs a step, by a full sort of the vocabulary, by the partial top-k that replaced it, and
by the tokens above a floor that the top-k now backs (engine/sampling.py, _top_p).

Loads the embedded model and takes the first chat and the first code prompt of bench/prompts.yaml.
For each sampling setting (the embedded model's own defaults, temperature 0.1, top_p 0.9 and a
repetition penalty of 1.1, which every request that sets none of them gets; temperature 0.8 with
top_p 0.95; and temperature 0.8 alone, where top_p does nothing and the forms must match):
1. decodes 96 tokens in-process per prompt and drafter (target-only and the default ``auto``), the
   two forms alternating round by round with the same seeds, each request its own tenant (so no run
   drafts from another's output in the suffix cache), and checks that target-only writes the
   same tokens with every form (``auto`` asked for by name chooses by timings, so its draws, and
   with them its tokens, differ between any two runs: docs/api.md, Seeds);
2. times ``RequestSampler.probs`` over one row and over a verify's k + 1 = 5 rows of the target's
   own logits on the answer it wrote.
The forms: ``sort`` (no floor, TOP_P_CANDIDATES empty: the full sort every step ran before),
``candidates`` (no floor, the top-k ladder) and ``floor`` (as shipped). Writes
bench/results/sampling.json.

    .venv/bin/python bench/studies/sampling.py [--rounds 3]
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

import engine.sampling as sampling  # noqa: E402
from bench.host import host  # noqa: E402
from bench.runners import EngineRunner, chat_ids  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.factory import load_engine  # noqa: E402
from engine.sampling import RequestSampler, SamplingParams  # noqa: E402

BENCH = Path(__file__).resolve().parents[1]
FORMS = {  # (floor, top-k ladder); a floor of infinity: no token is above it
    "sort": (float("inf"), ()),
    "candidates": (float("inf"), sampling.TOP_P_CANDIDATES),
    "floor": (sampling.TOP_P_FLOOR, sampling.TOP_P_CANDIDATES),
}
SETTINGS = {
    "model defaults (temperature 0.1, top_p 0.9, repetition penalty 1.1)": {
        "temperature": 0.1,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
    },
    "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature 0.8": {"temperature": 0.8},
}
DRAFTERS = ("none", "auto")


def use(form: str) -> None:
    sampling.TOP_P_FLOOR, sampling.TOP_P_CANDIDATES = FORMS[form]


def probs_ms(
    engine, prompt_ids: list[int], answer: list[int], params: dict, rows: int, repeats: int = 50
) -> dict[str, float]:
    """Milliseconds of RequestSampler.probs over ``rows`` rows of the target's logits on its answer, per form."""
    engine.reset()
    target = engine.target
    target.cache.rollback(0)
    logits = target.extend(prompt_ids + answer[:rows], num_logits=rows)  # [R, V]
    sampler = RequestSampler(SamplingParams(**params), target.vocab_size, logits.device, prompt_ids, seed=0)
    drafts = torch.tensor(answer[1:rows])  # [R - 1]
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(5):
        for form in FORMS:
            use(form)
            started = time.perf_counter()
            for _ in range(repeats):
                sampler.probs(logits, drafts)
            times[form].append((time.perf_counter() - started) / repeats)
    use("floor")
    return {form: round(1000 * statistics.median(values), 3) for form, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    loaded = load_engine(EngineConfig(max_model_len=2048), show_progress=False)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    runner = EngineRunner(engine)
    prompts = yaml.safe_load((BENCH / "prompts.yaml").read_text())
    results = []
    for kind in ("chat", "code"):
        prompt_ids = chat_ids(tokenizer, [{"role": "user", "content": prompts[kind][0]}])
        for setting, params in SETTINGS.items():
            for drafter in DRAFTERS:
                speeds: dict[str, list[float]] = {form: [] for form in FORMS}
                same = True
                for round_index in range(args.rounds):
                    order = list(FORMS) if round_index % 2 == 0 else list(FORMS)[::-1]
                    written = {}
                    for form in order:
                        use(form)
                        user = f"{kind}-{setting}-{drafter}-{form}-{round_index}"  # nothing replayed from another run
                        run = runner.run(
                            drafter, False, prompt_ids, args.max_tokens, user, {"seed": round_index, **params}
                        )
                        written[form] = run.token_ids
                        speeds[form].append(round(run.decode_tokens_per_s, 1))
                    same = same and written["sort"] == written["candidates"] == written["floor"]
                use("floor")
                medians = {form: round(statistics.median(values), 1) for form, values in speeds.items()}
                entry = {"prompt": kind, "setting": setting, "drafter": drafter, "tokens_per_s": medians}
                entry["speedup"] = {form: round(medians[form] / medians["sort"], 2) for form in ("candidates", "floor")}
                entry["same_tokens"] = same if drafter == "none" else None
                entry["rounds"] = speeds
                if drafter == "none":
                    entry["probs_ms_1_row"] = probs_ms(engine, prompt_ids, written["sort"], params, rows=1)
                    entry["probs_ms_5_rows"] = probs_ms(engine, prompt_ids, written["sort"], params, rows=5)
                results.append(entry)
                print(json.dumps({key: value for key, value in entry.items() if key != "rounds"}), flush=True)
    report = {
        "host": host(),
        "model": "embedded SmolLM2-135M-Instruct",
        "candidates": list(sampling.TOP_P_CANDIDATES),
        "floor": sampling.TOP_P_FLOOR,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "results": results,
    }
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / "sampling.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
