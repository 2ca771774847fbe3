"""Many conversations at once: sequence slots and the prefix store against the FIFO engine.

Two servers on the embedded default, up together: the default (``--max-num-seqs 4`` and the prefix
store) and the FIFO engine as it was (``--max-num-seqs 1 --prefix-cache-gb 0``: one sequence's
cache, one request at a time). Each pattern runs on both, the servers taking turns:

- a chat front end: four turns, each answer followed by a title and a tags request whose prompts
  hold the chat history as text (as Open WebUI sends them);
- 1, 2 and 4 people taking turns, three turns each, each their own ``user``;
- an agent: one long system prompt, short requests, another user's request between each two;
- head of line: a short request's time to first token while 1 and 3 long answers stream;
- aggregate decode tokens/s with 1, 2 and 4 streams at once.

For the conversation patterns: the cached share of later turns' prompts (``cached_tokens`` over
prompt tokens) and their time to first token against the same prompt sent cold (a fresh scope).

    .venv/bin/python bench/conversations.py           # about 8 minutes on 2 cores

Writes bench/results/conversations.json; docs/benchmarks.md#many-conversations has the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import mean

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host import host  # noqa: E402
from bench.runners import ServerRunner, close_servers_on_terminate, sse_events  # noqa: E402

BENCH = Path(__file__).resolve().parent
QUESTIONS = [
    "What is a binary search tree? Answer in two sentences.",
    "How do I keep it balanced?",
    "Show the rotation in Python.",
    "What does that cost per insert?",
]
SYSTEM = (
    "You are a build assistant for a large C++ monorepo. Rules: answer with one shell command when "
    "one command does it; name the target explicitly; never run a clean build unless asked; prefer "
    "incremental builds with ninja; tests live under //tests and run with the test runner script; "
    "the cache server is at cache.internal:9092; flaky tests are listed in tests/flaky.txt and are "
    "retried twice; sanitizer builds use the asan and tsan configurations; release builds strip "
    "symbols into a separate debug archive; every change needs a changelog line. "
) * 4
ANSWER_TOKENS = 96  # the longest answer of a conversation's turn
CONFIGS = {"slots": [], "fifo": ["--max-num-seqs", "1", "--prefix-cache-gb", "0"]}


def chat(server: ServerRunner, messages: list[dict], user: str, max_tokens: int, ignore_eos: bool = False) -> dict:
    """One streamed chat request: its first token's time, its tokens, text and prompt usage."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "user": user,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    started, first, pieces, usage = time.perf_counter(), None, [], {}
    for event in sse_events(server.client, "/v1/chat/completions", body):
        if event.get("choices") and event["choices"][0]["delta"].get("content"):
            first = first or time.perf_counter()
            pieces.append(event["choices"][0]["delta"]["content"])
        usage = event.get("usage") or usage
    ended = time.perf_counter()
    return {
        "ttft_s": (first or ended) - started,
        "seconds": ended - started,
        "text": "".join(pieces),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def history_text(messages: list[dict]) -> str:
    return "\n".join(f"{m['role'].upper()}: {m['content']}" for m in messages)


def side_request(server: ServerRunner, task: str, messages: list[dict], user: str) -> None:
    prompt = f"### Task:\n{task}\n### Chat History:\n<chat_history>\n{history_text(messages)}\n</chat_history>"
    chat(server, [{"role": "user", "content": prompt}], user, 16)


def later_turns(server: ServerRunner, turns: list[tuple[list[dict], dict, dict | None]], tag: str) -> dict:
    """Cached share and time to first token of turns after each person's first, against the same
    prompts sent cold. A turn's prompt holds its new message too, which no cache can hold:
    ``reusable_share`` is the share an ideal cache would hold (the turn before's prompt and answer),
    ``cached_of_reusable`` how much of that was cached."""
    shares = [r["cached_tokens"] / r["prompt_tokens"] for _, r, _ in turns]
    cold = [chat(server, messages, f"cold-{tag}-{i}", 1)["ttft_s"] for i, (messages, _, _) in enumerate(turns)]
    prompts = sum(r["prompt_tokens"] for _, r, _ in turns)
    reusable = [min(p["prompt_tokens"] + p["completion_tokens"] - 1, r["prompt_tokens"] - 1) for _, r, p in turns if p]
    return {
        "cached_share": round(sum(r["cached_tokens"] for _, r, _ in turns) / prompts, 3),
        "reusable_share": round(sum(reusable) / prompts, 3) if len(reusable) == len(turns) else None,
        "cached_of_reusable": round(sum(r["cached_tokens"] for _, r, _ in turns) / sum(reusable), 3)
        if len(reusable) == len(turns)
        else None,
        "min_cached_share": round(min(shares), 3),
        "ttft_s": round(mean(r["ttft_s"] for _, r, _ in turns), 3),
        "cold_ttft_s": round(mean(cold), 3),
        "turns": len(turns),
    }


def front_end(server: ServerRunner, tag: str) -> dict:
    user, messages, later, previous = f"fe-{tag}", [], [], None
    for i, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        reply = chat(server, list(messages), user, ANSWER_TOKENS)
        if i:
            later.append((list(messages), reply, previous))
        previous = reply
        messages.append({"role": "assistant", "content": reply["text"]})
        side_request(server, "Generate a concise, 3-5 word title with an emoji for the chat.", messages, user)
        side_request(server, "Generate 1-3 broad tags categorizing the chat's main themes.", messages, user)
    return later_turns(server, later, f"fe-{tag}")


def people(server: ServerRunner, count: int, tag: str) -> dict:
    histories = {f"p{count}-{i}-{tag}": [] for i in range(count)}
    later, previous = [], {}
    for turn in range(3):
        for n, (user, messages) in enumerate(histories.items()):
            messages.append({"role": "user", "content": f"{QUESTIONS[(turn + n) % len(QUESTIONS)]} (person {n})"})
            reply = chat(server, list(messages), user, ANSWER_TOKENS)
            if turn:
                later.append((list(messages), reply, previous[user]))
            previous[user] = reply
            messages.append({"role": "assistant", "content": reply["text"]})
    return later_turns(server, later, f"p{count}-{tag}")


def agent(server: ServerRunner, tag: str) -> dict:
    later = []
    for i in range(5):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Build target number {i}."}]
        reply = chat(server, messages, f"agent-{tag}", 24)
        if i:
            later.append((messages, reply, None))
        chat(server, [{"role": "user", "content": f"Say hello {i}."}], f"other-{tag}", 8)
    return later_turns(server, later, f"agent-{tag}")


def concurrently(server: ServerRunner, requests: list[tuple[list[dict], str, int, float]]) -> list[dict]:
    """Requests sent from threads, each after its delay: (messages, user, max_tokens, delay)."""
    results: list[dict | None] = [None] * len(requests)

    def send(i: int, messages, user, max_tokens, delay) -> None:
        time.sleep(delay)
        results[i] = chat(server, messages, user, max_tokens, ignore_eos=True)

    threads = [threading.Thread(target=send, args=(i, *r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def head_of_line(server: ServerRunner, streams: int, tag: str) -> dict:
    long = [
        ([{"role": "user", "content": f"Write a long story about ship {i}."}], f"hol-{tag}-{i}", 300, 0.0)
        for i in range(streams)
    ]
    short = ([{"role": "user", "content": "Say yes."}], f"hol-{tag}-short", 8, 1.5)
    results = concurrently(server, [*long, short])
    return {
        "short_ttft_s": round(results[-1]["ttft_s"], 3),
        "long_seconds": round(max(r["seconds"] for r in results[:-1]), 2),
    }


def throughput(server: ServerRunner, streams: int, tag: str) -> dict:
    requests = [
        ([{"role": "user", "content": f"Describe city {i} in detail."}], f"tp-{tag}-{i}", 128, 0.0)
        for i in range(streams)
    ]
    started = time.perf_counter()
    results = concurrently(server, requests)
    seconds = time.perf_counter() - started
    return {
        "tokens_per_s": round(sum(r["completion_tokens"] for r in results) / seconds, 1),
        "seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(BENCH / "results" / "conversations.json"))
    parser.add_argument("--args", default="", help="more serve flags for both servers")
    options = parser.parse_args()
    close_servers_on_terminate()
    started = time.perf_counter()
    servers = {
        name: ServerRunner(
            [*flags, *options.args.split()], Path(tempfile.gettempdir()) / f"conversations-{name}.log", one_slot=False
        )
        for name, flags in CONFIGS.items()
    }
    report: dict = {"host": host(), "configs": CONFIGS, "patterns": {name: {} for name in CONFIGS}}
    try:
        for server in servers.values():
            server.wait_ready()
        patterns = [
            ("front_end", front_end),
            *[(f"people_{n}", lambda s, tag, n=n: people(s, n, tag)) for n in (1, 2, 4)],
            ("agent", agent),
            *[(f"head_of_line_{n}", lambda s, tag, n=n: head_of_line(s, n, tag)) for n in (1, 3)],
            *[(f"throughput_{n}", lambda s, tag, n=n: throughput(s, n, tag)) for n in (1, 2, 4)],
        ]
        for pattern, run in patterns:
            for name, server in servers.items():  # the servers take turns, pattern by pattern
                report["patterns"][name][pattern] = run(server, name)
                print(pattern, name, report["patterns"][name][pattern], flush=True)
        for n in (1, 2, 4):
            slots, fifo = (report["patterns"][c][f"throughput_{n}"]["tokens_per_s"] for c in CONFIGS)
            report.setdefault("throughput_ratio", {})[n] = round(slots / fifo, 3)
        metrics = servers["slots"].client.get("/metrics").text
        report["slots_metrics"] = [
            line for line in metrics.splitlines() if line.startswith(("specserve_slots", "specserve_store"))
        ]
    finally:
        for server in servers.values():
            server.close()
    report["seconds"] = round(time.perf_counter() - started)
    out = Path(options.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
