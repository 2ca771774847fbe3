"""Server-sent events: one JSON chunk per event, errors as events, then [DONE]."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from .errors import InternalError, OpenAIError

log = logging.getLogger(__name__)

DONE = "[DONE]"


async def _events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[dict]:
    try:
        async for chunk in chunks:
            yield {"data": chunk.model_dump_json()}
    except OpenAIError as exc:  # the stream has started: the error goes out as an event
        yield {"data": json.dumps(exc.body())}
    except Exception as exc:
        log.exception("stream failed")
        yield {"data": json.dumps(InternalError(f"internal error: {type(exc).__name__}").body())}
    yield {"data": DONE}


def sse_response(chunks: AsyncIterator[BaseModel]) -> EventSourceResponse:
    return EventSourceResponse(_events(chunks), sep="\n")
