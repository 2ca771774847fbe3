"""The FastAPI application: thin routes over ``OpenAIServing``.

The model loads in a background thread after the server starts, so ``/health`` can answer 503
while it loads; a load that fails ends the process with a clear message and exit code 2.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.async_engine import AsyncEngine
from engine.engine import SpecEngine
from engine.factory import LoadedEngine

from .errors import EngineUnavailable, ModelNotFound, install_error_handlers
from .metrics import Metrics
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    now,
)
from .serving import OpenAIServing
from .streaming import sse_response

log = logging.getLogger(__name__)
router = APIRouter()


def _serving(request: Request) -> OpenAIServing:
    serving = request.app.state.serving
    if serving is None:
        raise EngineUnavailable("the model is still loading")
    return serving


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    serving = request.app.state.serving
    if serving is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    alive = serving.engine.alive
    return JSONResponse({"status": "ok" if alive else "engine dead"}, status_code=200 if alive else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _card(request: Request) -> ModelCard:
    return ModelCard(id=_serving(request).model_name, created=request.app.state.started)


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    return ModelList(data=[_card(request)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def model(model_id: str, request: Request) -> ModelCard:
    card = _card(request)
    if model_id != card.id:
        raise ModelNotFound(f"the model '{model_id}' does not exist", "model")
    return card


@router.post("/v1/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, request: Request):
    serving = _serving(request)
    if body.stream:
        return sse_response(await serving.completion_stream(body))
    return await serving.completion(body)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    serving = _serving(request)
    if body.stream:
        return sse_response(await serving.chat_stream(body))
    return await serving.chat(body)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    return _serving(request).tokenize(body)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    return _serving(request).detokenize(body)


def create_app(load: Callable[[], LoadedEngine], served_model_name: str | None = None) -> FastAPI:
    """``load`` builds the engine; it runs in a worker thread once the server is up."""
    engines: list[AsyncEngine] = []

    async def load_in_background(app: FastAPI) -> None:
        holder: list[LoadedEngine] = []

        def load_in_engine_thread() -> SpecEngine:
            holder.append(load())
            return holder[0].engine

        engine = AsyncEngine(load_in_engine_thread)
        engines.append(engine)
        try:
            await engine.ready()
        except Exception as exc:  # nothing to serve: say why and exit so a supervisor sees it
            log.exception("loading the model failed")
            print(f"specserve: {exc}", file=sys.stderr, flush=True)
            os._exit(2)
        loaded = holder[0]
        app.state.metrics.queue_depth.set_function(lambda: engine.queue_depth)
        name = served_model_name or loaded.model_name
        app.state.serving = OpenAIServing(engine, loaded.tokenizer, name, app.state.metrics)
        log.info("ready: serving %s", name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(load_in_background(app))
        yield
        task.cancel()
        for engine in engines:
            engine.shutdown(timeout=10)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.serving = None
    app.state.metrics = Metrics(queue_depth=lambda: 0)
    app.state.started = now()
    install_error_handlers(app)
    app.include_router(router)
    return app
