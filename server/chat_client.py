"""``specserve chat``: a small terminal client that streams replies from a running server.

It sends no sampling field the user did not set, so replies come at the server's defaults (the
embedded model's are chosen by measurement: docs/api.md#defaults). Ctrl-C during a reply stops that
reply and returns to the prompt; Ctrl-C at the prompt, or Ctrl-D, ends the chat. No traceback either way.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass

import httpx

PROMPT = "> "


@dataclass(slots=True)
class Reply:
    text: str
    finish_reason: str | None = None
    stopped: bool = False  # Ctrl-C ended it


def chat(
    url: str,
    api_key: str | None,
    system: str | None,
    temperature: float | None,
    max_tokens: int | None,
    drafter: str | None,
    lines=sys.stdin,
    out=sys.stdout,
) -> int:
    """Read one message per line until EOF or Ctrl-C at the prompt; stream each reply, then a line
    of speculative stats (and whether the reply was cut at its length limit)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    interactive = lines.isatty()
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(600, connect=10)) as client:
        try:
            models = client.get("/v1/models")
        except httpx.TransportError as exc:
            print(f"specserve chat: cannot reach {url}: {exc}", file=sys.stderr)
            return 1
        if models.status_code != 200:
            print(f"specserve chat: {_error(models)}", file=sys.stderr)
            return 1
        model = models.json()["data"][0]["id"]
        if interactive:
            # Ctrl-C is the chat's own key even where it started with SIGINT ignored (a shell's
            # background job, nohup, a test runner's child), which would leave it dead
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print(f"{model} at {url}; one message per line. Ctrl-C stops a reply; Ctrl-D quits", file=sys.stderr)
        while True:
            try:
                line = _read(lines, interactive)
            except KeyboardInterrupt:  # at the prompt: the user is done
                print(file=out)
                return 0
            if not line:  # EOF
                if interactive:
                    print(file=out)
                return 0
            message = line.strip()
            if not message:
                continue
            history.append({"role": "user", "content": message})
            body = {"model": model, "messages": history, "stream": True, "stream_options": {"include_usage": True}}
            # only what the user set: the rest is the server's defaults
            options = {"temperature": temperature, "max_tokens": max_tokens}
            body.update({name: value for name, value in options.items() if value is not None})
            if drafter:
                body["speculative"] = {"drafter": drafter}
            reply = _stream(client, body, out)
            if reply is None:
                history.pop()
                continue
            history.append({"role": "assistant", "content": reply.text})


def _read(lines, interactive: bool) -> str:
    """The next line, '' at EOF; at a terminal with the prompt and line editing (``input``)."""
    if not interactive:
        return lines.readline()
    try:
        return input(PROMPT) + "\n"
    except EOFError:
        return ""


def _stream(client: httpx.Client, body: dict, out) -> Reply | None:
    """One reply streamed to ``out``; None where the server refused it. Ctrl-C closes the stream
    (the server frees the request) and keeps what had arrived."""
    reply, usage, started, first = Reply(""), None, time.perf_counter(), None
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                print(f"error: {_error(response)}", file=out)
                return None
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    print(f"\nerror: {chunk['error']['message']}", file=out)
                    return None
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
                    text = choice["delta"].get("content")
                    if text:
                        first = first or time.perf_counter()
                        reply.text += text
                        out.write(text)
                        out.flush()
    except KeyboardInterrupt:
        reply.stopped = True
    except httpx.TransportError as exc:
        print(f"\nerror: the connection failed: {exc}", file=out)
        return None
    elapsed = time.perf_counter() - (first or started)
    print(file=out)
    if summary := _summary(reply, usage, elapsed):
        print(summary, file=out)
    return reply


def _summary(reply: Reply, usage: dict | None, elapsed: float) -> str:
    if reply.stopped:
        return "[stopped]"
    parts = []
    if usage:
        spec = usage.get("speculative") or {}
        tokens = usage["completion_tokens"]
        parts.append(
            f"{tokens} tokens, {tokens / elapsed if elapsed > 0 else 0:.1f} tok/s, drafter {spec.get('drafter')}, "
            f"accepted {spec.get('accepted_tokens', 0)}/{spec.get('drafted_tokens', 0)} drafts"
        )
    if reply.finish_reason == "length":
        parts.append("cut at the length limit (--max-tokens sets it)")
    return f"[{'; '.join(parts)}]" if parts else ""


def _error(response: httpx.Response) -> str:
    try:
        return f"{response.status_code}: {response.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code}: {response.text[:200]}"
