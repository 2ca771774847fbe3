"""What every request passes before a route sees it: API key, body size, draining, admission.

A pure ASGI middleware, so that the admission slot a generation request takes is released when
its response ends, however it ends (completed, streamed out, client gone, cancelled).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import BadRequest, EngineUnavailable, OpenAIError, Overloaded, Unauthorized
from .metrics import Metrics
from .tenants import Tenancy

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
OPEN_PATHS = frozenset({"/health", "/metrics", "/"})  # the chat page holds no data; the API asks for the key


@dataclass(slots=True)
class GuardState:
    """Shared with the app: ``draining`` flips on SIGTERM; ``admitted`` counts generation requests
    waiting or running; the engine runs ``max_num_seqs`` at once, so capacity is ``max_queue + max_num_seqs``. ``tenancy`` says
    which key is which tenant; the tenant a request's key names goes into its scope's state."""

    tenancy: Tenancy
    max_body_bytes: int
    max_queue: int
    max_num_seqs: int = 1
    retry_after_s: int = 1
    draining: bool = False
    admitted: int = 0


class Guard:
    def __init__(self, app: ASGIApp, state: GuardState, metrics: Metrics | None = None) -> None:
        self.app, self.state, self.metrics = app, state, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, state = scope["path"], self.state
        length = _header(scope, b"content-length")
        tenant = state.tenancy.tenant_of(_header(scope, b"authorization"))  # None: no key of ours
        refusal = self._refusal(path, length, tenant)
        generation = path in GENERATION_PATHS and scope["method"] == "POST"
        if refusal is None and generation and state.admitted >= state.max_queue + state.max_num_seqs:
            refusal = Overloaded(state.max_queue, state.retry_after_s)
        if refusal is not None:
            if self.metrics is not None:
                self.metrics.errors.labels(status=str(refusal.status_code)).inc()
            await _send_error(send, refusal)
            return
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await _buffered(receive, state.max_body_bytes)  # a chunked body: count it as it comes
            if receive is None:
                await _send_error(send, _body_too_large(state.max_body_bytes))
                return
        if scope["method"] == "POST":
            scope = _as_json(scope)
        scope.setdefault("state", {})["tenant"] = tenant or ""  # request.state.tenant for the routes
        if generation:
            state.admitted += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if generation:
                state.admitted -= 1

    def _refusal(self, path: str, length: str | None, tenant: str | None) -> OpenAIError | None:
        state = self.state
        if tenant is None and path not in OPEN_PATHS:
            return Unauthorized()
        if length is not None and (not length.isdigit() or int(length) > state.max_body_bytes):
            return _body_too_large(state.max_body_bytes)
        if state.draining and path not in OPEN_PATHS:
            return EngineUnavailable("the server is shutting down", code="shutting_down")
        return None


def _as_json(scope: Scope) -> Scope:
    """Every POST route takes a JSON body. Read it as JSON whatever Content-Type says, as OpenAI's API
    and vLLM do (``curl -d`` without a header sends application/x-www-form-urlencoded)."""
    content_type = _header(scope, b"content-type") or ""
    if content_type.split(";")[0].strip().lower() == "application/json":
        return scope
    headers = [(name, value) for name, value in scope["headers"] if name.lower() != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


async def _buffered(receive: Receive, limit: int) -> Receive | None:
    """Read the whole body (at most ``limit`` bytes) and return a receive that replays it; None if larger."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client left; the app will see it too
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            break
    pending: list[Message] = [{"type": "http.request", "body": bytes(body), "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def _body_too_large(limit: int) -> BadRequest:
    return BadRequest(f"the request body exceeds {limit} bytes", "body", code="request_too_large")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


async def _send_error(send: Send, error: OpenAIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
