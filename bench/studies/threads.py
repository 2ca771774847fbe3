"""Study: how do two specserve processes share one machine's cores? Answer: docs/deployment.md#threads.

Two specserve processes sharing one machine's cores: how long the README request takes.

Scenarios, each with fresh `specserve serve` processes on the embedded default:
- alone: one process, default threads;
- two: two processes, default threads each, one request to each at the same time;
- two, --threads 1: the same with one thread each;
and with ``--before REV``, "alone" and "two" again with the code of commit REV (a git worktree).

    .venv/bin/python bench/studies/threads.py [--before REV] [--max-tokens 105]

Writes bench/results/threads.json with the host it ran on (keeping the entries other studies wrote
there: bench/studies/serving_cpu.py's "serving").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
from bench.host import host  # noqa: E402

REQUEST = {  # the README's first curl, with a fixed length
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "ignore_eos": True,
}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(code: Path, extra: list[str], log: Path, more_env: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--max-model-len", "1024", *extra]
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("OMP_", "KMP_", "GOMP_", "SPECSERVE_"))
    }
    env.update(more_env)
    process = subprocess.Popen(command, cwd=code, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not come up")


def timed_request(url: str, max_tokens: int, results: list, timeout: float) -> None:
    started = time.perf_counter()
    try:
        response = httpx.post(f"{url}/v1/chat/completions", json={**REQUEST, "max_tokens": max_tokens}, timeout=timeout)
        tokens = response.json()["usage"]["completion_tokens"]
        results.append({"seconds": round(time.perf_counter() - started, 2), "tokens": tokens})
    except httpx.TimeoutException:
        results.append({"seconds": None, "tokens": 0, "timed_out_after_s": timeout})


def scenario(
    code: Path, processes: int, extra: list[str], max_tokens: int, timeout: float, logs: Path, env: dict
) -> dict:
    servers = [start(code, extra, logs / f"server-{index}.log", env) for index in range(processes)]
    try:
        for process, url in servers:
            wait_ready(url, process)
        for _, url in servers:  # warm up one at a time: first-request costs stay out of the figure
            httpx.post(f"{url}/v1/chat/completions", json={**REQUEST, "max_tokens": 4}, timeout=timeout)
        results: list = []
        workers = [
            threading.Thread(target=timed_request, args=(url, max_tokens, results, timeout)) for _, url in servers
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return {"processes": processes, "args": extra, "env": env, "requests": results}
    finally:
        for process, _ in servers:
            process.terminate()
        for process, _ in servers:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="also run 'alone' and 'two' with the code of this commit")
    parser.add_argument("--max-tokens", type=int, default=105)
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds one request may take")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the servers (repeatable)")
    parser.add_argument("--only", help="run only the scenarios whose name contains this")
    parser.add_argument("--out", default=str(BENCH / "results" / "threads.json"))
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    logs = Path(tempfile.mkdtemp(prefix="specserve-threads-"))
    plan = [("alone", REPO, 1, []), ("two", REPO, 2, []), ("two, --threads 1", REPO, 2, ["--threads", "1"])]
    worktree = None
    if args.before:
        worktree = Path(tempfile.mkdtemp(prefix="specserve-before-")) / "code"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.before], cwd=REPO, check=True)
        plan = [
            (f"before {args.before}: alone", worktree, 1, []),
            (f"before {args.before}: two", worktree, 2, []),
        ] + plan
    report = {"host": host(), "max_tokens": args.max_tokens, "date": time.strftime("%Y-%m-%d"), "scenarios": {}}
    try:
        for name, code, processes, extra in plan:
            if args.only and args.only not in name:
                continue
            print(f"{name} ...", file=sys.stderr, flush=True)
            result = scenario(code, processes, extra, args.max_tokens, args.timeout, logs, env)
            report["scenarios"][name] = result
            print(f"  {json.dumps(result['requests'])}", file=sys.stderr, flush=True)
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
        shutil.rmtree(logs, ignore_errors=True)
    out = Path(args.out)
    kept = json.loads(out.read_text()) if out.exists() else {}  # entries other studies wrote ("serving")
    out.write_text(json.dumps({**kept, **report}, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
