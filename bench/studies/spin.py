"""Study: what does the OpenMP spin count give one server alone? Answer: docs/deployment.md#threads.

What the OpenMP spin count gives one server alone: servers side by side, requests in turn.

One ``specserve serve`` per ``GOMP_SPINCOUNT`` value (the embedded default, every other setting its
own default), all started first, then the first chat, code and summarise prompts of
bench/prompts.yaml sent to each in turn, greedy, 96 tokens, target-only and the default drafter,
the order of the servers reversed every other round so host noise hits all alike. Decode tokens/s
as ``make bench`` counts them. And, in a fresh process per count, what a gap between two parallel
regions costs: an add over 256k floats (a parallel region on every thread), then the main thread
busy for a set time, repeated; the time each round takes beyond the gap is what the region costs,
and it jumps where the workers stopped spinning and must be woken. What two processes sharing the
cores cost at each count is bench/studies/threads.py's (``--env GOMP_SPINCOUNT=N``).

    .venv/bin/python bench/studies/spin.py [--spins 1000,3000,300000] [--rounds 4]

Writes bench/results/spin.json with the host it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from bench.runners import ServerRunner, chat_ids, close_servers_on_terminate  # noqa: E402
from engine.model.loader import load_tokenizer  # noqa: E402

BENCH = Path(__file__).resolve().parents[1]
KINDS = ("chat", "code", "summarise")
GAP_PROBE = """
import json, statistics, sys, time, torch
values = torch.randn(1 << 18)
def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
costs = {}
for gap_us in (0, 10, 20, 40, 80, 160):
    rounds = []
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(200):
            values.add_(1.0)
            busy(gap_us * 1e-6)
        rounds.append((time.perf_counter() - started) / 200 * 1e6 - gap_us)
    costs[gap_us] = round(statistics.median(rounds), 1)
print(json.dumps(costs))
"""


def gap_costs(spin: str) -> dict[str, float]:
    """Microseconds a parallel region costs after a gap of 0..160 us, at this spin count."""
    env = {**os.environ, "GOMP_SPINCOUNT": spin}
    done = subprocess.run([sys.executable, "-c", GAP_PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spins", default="1000,3000,300000")
    parser.add_argument("--drafters", default="none,default")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    spins, drafters = args.spins.split(","), args.drafters.split(",")
    tokenizer = load_tokenizer(None)
    prompts = yaml.safe_load((BENCH / "prompts.yaml").read_text())
    prompt_ids = {}
    for kind in KINDS:
        prompt_ids[kind] = chat_ids(tokenizer, [{"role": "user", "content": prompts[kind][0]}])
    servers: dict[str, ServerRunner] = {}
    close_servers_on_terminate()
    speeds: dict[str, dict[str, dict[str, list[float]]]] = {
        spin: {drafter: {kind: [] for kind in KINDS} for drafter in drafters} for spin in spins
    }
    try:
        for spin in spins:  # each server reads the variable when it starts
            os.environ["GOMP_SPINCOUNT"] = spin
            servers[spin] = ServerRunner([], BENCH / "out" / f"spin-{spin}.log")
            servers[spin].wait_ready()
        for round_index in range(args.rounds):
            for kind in KINDS:
                for drafter in drafters:
                    for spin in spins if round_index % 2 == 0 else spins[::-1]:
                        user = f"spin-{spin}-{drafter}-{kind}-{round_index}"  # one tenant per run
                        run = servers[spin].run(drafter, False, prompt_ids[kind], args.max_tokens, user)
                        speeds[spin][drafter][kind].append(round(run.decode_tokens_per_s, 1))
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.close()
    medians = {
        spin: {
            drafter: {kind: round(statistics.median(v), 1) for kind, v in by_kind.items()}
            for drafter, by_kind in by.items()
        }
        for spin, by in speeds.items()
    }
    report = {
        "host": host(),
        "max_tokens": args.max_tokens,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "decode_tokens_per_s_median": medians,
        "over_first": {  # each spin count's median over the first's, per drafter and prompt type
            spin: {
                drafter: {kind: round(v / medians[spins[0]][drafter][kind], 2) for kind, v in by_kind.items()}
                for drafter, by_kind in by.items()
            }
            for spin, by in medians.items()
        },
        "region_us_after_a_gap_of_us": {spin: gap_costs(spin) for spin in spins},
        "rounds": speeds,
    }
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / "spin.json").write_text(json.dumps(report, indent=2) + "\n")
    shown = ("decode_tokens_per_s_median", "over_first", "region_us_after_a_gap_of_us")
    print(json.dumps({key: report[key] for key in shown}, indent=1))


if __name__ == "__main__":
    main()
