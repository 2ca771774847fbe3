"""Study: where does a served token's CPU go beyond the engine's? Answer: docs/internals.md#the-event-loops-share.

One ``specserve serve`` of the embedded default (one sequence slot), streamed to by this process as
an SDK would (httpx, one JSON parse per event): the README's chat question with ``ignore_eos``,
target-only and the default (``auto``) taking turns request by request, each request its own
``user`` (so the default's suffix cache replays no earlier request's output). Around each configuration's
requests it reads every server thread's user and system CPU (/proc/PID/task/TID/stat) and this
client thread's own, and reports each per streamed event (one token each): the event loop (the
main thread: SSE framing, chunk building, the socket writes), the compute threads (the engine's
thread and torch's pool: the forward passes, the drafter, the sampler), the server's other
threads, and the client. Where a step commits several tokens their events go out in one wake-up
of the loop; target-only wakes it once a token.

    .venv/bin/python bench/studies/serving_cpu.py [--max-tokens 300] [--rounds 3]

Writes its entry "serving" of bench/results/threads.json (the other entries are threads.py's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from bench.runners import sse_events  # noqa: E402
from bench.studies.threads import REQUEST, free_port, wait_ready  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "results" / "threads.json"
CONFIGURATIONS = {"target-only": {"speculative": {"drafter": "none"}}, "default": {}}
TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread of ``pid``: (user, system) CPU seconds so far."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        times[int(tid)] = (int(fields[11]) / TICK, int(fields[12]) / TICK)
    return times


def stream(client: httpx.Client, body: dict) -> tuple[int, dict]:
    """(events that carried a token, the usage) of one streamed chat completion."""
    events, usage = 0, {}
    for event in sse_events(client, "/v1/chat/completions", body):
        events += bool(event["choices"] and event["choices"][0]["delta"].get("content"))
        usage = event.get("usage") or usage
    return events, usage


def split(before: dict, after: dict, pid: int) -> dict[str, list[float]]:
    """CPU (user, system) the threads spent between two readings: the event loop (the main thread),
    the compute threads (the two busiest others: the engine's and torch's pool), the rest."""
    spent = {
        tid: [a - b for a, b in zip(times, before.get(tid, (0.0, 0.0)), strict=True)] for tid, times in after.items()
    }
    loop = spent.pop(pid, [0.0, 0.0])
    busiest = sorted(spent, key=lambda tid: -sum(spent[tid]))
    compute = [sum(spent[tid][part] for tid in busiest[:2]) for part in (0, 1)]
    rest = [sum(spent[tid][part] for tid in busiest[2:]) for part in (0, 1)]
    return {"event_loop": loop, "compute": compute, "other_threads": rest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="specserve-serving-cpu-")) / "server.log"
    command = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--max-num-seqs", "1"]
    process = subprocess.Popen(command, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    totals = {name: {"events": 0, "steps": 0, "wall": 0.0, "client": 0.0, "server": {}} for name in CONFIGURATIONS}
    try:
        wait_ready(url, process)
        with httpx.Client(base_url=url, timeout=600) as client:
            for name, extra in CONFIGURATIONS.items():  # warm-up: first-request costs stay out
                stream(client, {**REQUEST, **extra, "max_tokens": 16, "stream": True, "user": f"warm-up {name}"})
            for round_ in range(args.rounds):
                order = list(CONFIGURATIONS) if round_ % 2 == 0 else list(CONFIGURATIONS)[::-1]
                for name in order:
                    body = {**REQUEST, **CONFIGURATIONS[name], "max_tokens": args.max_tokens, "stream": True}
                    # each request its own scope: the suffix cache replays nothing an earlier round wrote
                    body |= {"stream_options": {"include_usage": True}, "user": f"{name} {round_}"}
                    before, client_before, started = thread_cpu(process.pid), time.thread_time(), time.perf_counter()
                    events, usage = stream(client, body)
                    total = totals[name]
                    total["wall"] += time.perf_counter() - started
                    total["client"] += time.thread_time() - client_before
                    total["events"] += events
                    total["steps"] += usage.get("speculative", {}).get("target_forwards", 0)
                    for part, cpu in split(before, thread_cpu(process.pid), process.pid).items():
                        kept = total["server"].setdefault(part, [0.0, 0.0])
                        kept[0], kept[1] = kept[0] + cpu[0], kept[1] + cpu[1]
    finally:
        process.terminate()
        process.wait(30)
    per_event = {}
    for name, total in totals.items():
        count = max(total["events"], 1)
        per_event[name] = {
            "events": total["events"],
            "tokens_per_step": round(total["events"] / total["steps"], 2) if total["steps"] else None,
            "wall_ms": round(1e3 * total["wall"] / count, 3),
            "client_us": round(1e6 * total["client"] / count),
            **{
                f"{part}_us": {"user": round(1e6 * user / count), "system": round(1e6 * system / count)}
                for part, (user, system) in total["server"].items()
            },
        }
        print(name, json.dumps(per_event[name]), file=sys.stderr)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    results["serving"] = {
        "host": host(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["bench/studies/serving_cpu.py", *sys.argv[1:]]),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "per_event": per_event,
    }
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote its entry of {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
