"""``specserve chat``: a small terminal client that streams replies from a running server."""

from __future__ import annotations

import json
import sys
import time

import httpx


def chat(
    url: str,
    api_key: str | None,
    system: str | None,
    temperature: float,
    max_tokens: int,
    drafter: str | None,
    lines=sys.stdin,
    out=sys.stdout,
) -> int:
    """Read one message per line until EOF; stream each reply, then a line of speculative stats."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    history: list[dict] = [{"role": "system", "content": system}] if system else []
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
        if out.isatty():
            print(f"{model} at {url}; one message per line, Ctrl-D to quit", file=sys.stderr)
        for line in lines:
            message = line.strip()
            if not message:
                continue
            history.append({"role": "user", "content": message})
            body = {
                "model": model,
                "messages": history,
                "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": temperature,
                "max_tokens": max_tokens,
            }
            if drafter:
                body["speculative"] = {"drafter": drafter}
            reply = _stream(client, body, out)
            if reply is None:
                history.pop()
                continue
            history.append({"role": "assistant", "content": reply})
    return 0


def _stream(client: httpx.Client, body: dict, out) -> str | None:
    pieces, usage, started, first = [], None, time.perf_counter(), None
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
                text = choice["delta"].get("content")
                if text:
                    first = first or time.perf_counter()
                    pieces.append(text)
                    out.write(text)
                    out.flush()
    elapsed = time.perf_counter() - (first or started)
    print(file=out)
    if usage:
        spec = usage.get("speculative") or {}
        tokens = usage["completion_tokens"]
        print(
            f"[{tokens} tokens, {tokens / elapsed if elapsed > 0 else 0:.1f} tok/s, drafter {spec.get('drafter')}, "
            f"accepted {spec.get('accepted_tokens', 0)}/{spec.get('drafted_tokens', 0)} drafts]",
            file=out,
        )
    return "".join(pieces)


def _error(response: httpx.Response) -> str:
    try:
        return f"{response.status_code}: {response.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code}: {response.text[:200]}"
