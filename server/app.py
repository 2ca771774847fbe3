"""The FastAPI application: thin routes over ``OpenAIServing``."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from transformers import PreTrainedTokenizerBase

from engine.async_engine import AsyncEngine

from .errors import install_error_handlers
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    now,
)
from .serving import OpenAIServing
from .streaming import sse_response

router = APIRouter()


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    alive = _serving(request).engine.alive
    return JSONResponse({"status": "ok" if alive else "engine dead"}, status_code=200 if alive else 503)


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    return ModelList(data=[ModelCard(id=_serving(request).model_name, created=request.app.state.started)])


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


def create_app(engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, model_name: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown(timeout=10)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.serving = OpenAIServing(engine, tokenizer, model_name)
    app.state.started = now()
    install_error_handlers(app)
    app.include_router(router)
    return app
