"""The FastAPI application: thin routes over the serving layer (``Serving``).

The model loads in a background thread after the server starts, so ``/health`` can answer 503
while it loads; a load that fails ends the process with a clear message and exit code 2.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.async_engine import AsyncEngine
from engine.config import ConfigError
from engine.cpu.memory import peak_resident_bytes, resident_bytes
from engine.engine import SpecEngine
from engine.factory import LoadedEngine
from engine.request import EngineDescription

from .chat import ChatServing
from .completions import CompletionsServing
from .errors import EngineUnavailable, ModelNotFound, install_error_handlers
from .guard import Guard, GuardState
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses import (
    GENERATION_RESPONSES,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    now,
)
from .serving import ServingCore
from .settings import ServeSettings
from .streaming import sse_response
from .tenants import Tenancy

log = logging.getLogger(__name__)
router = APIRouter()
CHAT_PAGE = Path(__file__).parent / "static" / "index.html"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Serving:
    """What the routes call once the engine has loaded: the core and the two generation endpoints."""

    core: ServingCore
    completions: CompletionsServing
    chat: ChatServing

    @classmethod
    def over(cls, core: ServingCore) -> Serving:
        return cls(core, CompletionsServing(core), ChatServing(core))


def _serving(request: Request) -> Serving:
    serving = request.app.state.serving
    if serving is None:
        raise EngineUnavailable("the model is still loading")
    return serving


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    serving = request.app.state.serving
    if serving is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    if request.app.state.guard.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    alive = serving.core.engine.alive
    return JSONResponse({"status": "ok" if alive else "engine dead"}, status_code=200 if alive else 503)


@router.get("/", include_in_schema=False)
async def chat_page() -> HTMLResponse:
    """The chat page: one static file, no build step, nothing fetched from elsewhere."""
    return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _card(request: Request) -> ModelCard:
    core = _serving(request).core
    described = core.description
    return ModelCard(
        id=core.model_name,
        created=request.app.state.started,
        drafters=[*described.runnable_drafters, "none"],
        default_drafter=described.default_drafter or "none",
        drafter_tokens_per_s=core.engine.drafter_speeds(),
        draft=described.draft,
        drafter_models=described.drafter_models,
        activations=described.activations,
    )


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    return ModelList(data=[_card(request)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def model(model_id: str, request: Request) -> ModelCard:
    card = _card(request)
    if model_id != card.id:
        raise ModelNotFound(f"the model '{model_id}' does not exist", "model")
    return card


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
async def completions(body: CompletionRequest, request: Request):
    return await _respond(_serving(request).completions, body, request)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await _respond(_serving(request).chat, body, request)


async def _respond(
    endpoint: CompletionsServing | ChatServing, body: CompletionRequest | ChatCompletionRequest, request: Request
):
    """A stream of SSE events, or the whole response unless the client leaves first."""
    body.within(request.app.state.tenancy.scope(request.state.tenant, body.user, body.cache_salt))
    if body.stream:
        return sse_response(await endpoint.stream(body))
    return await _unless_disconnected(request, endpoint.create(body))


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (which aborts its engine request) if the client goes away.
    Streams need no such watch: the SSE response stops iterating when the client leaves."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        # Until it takes: cancelling again costs nothing, and an await on the way that drops a cancellation
        # landing as an output arrives (asyncio.wait_for did before Python 3.12) would leave the request running.
        while not task.done():
            task.cancel()
            await asyncio.sleep(0.05)

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    finally:
        watcher.cancel()


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    return _serving(request).core.tokenize(body)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    return _serving(request).core.detokenize(body)


def create_app(load: Callable[[], LoadedEngine], settings: ServeSettings | None = None) -> FastAPI:
    """``load`` builds the engine; it runs in the engine thread once the server is up."""
    settings = settings or ServeSettings()
    engines: list[AsyncEngine] = []

    def on_death(exc: BaseException) -> None:
        # Runs in the dying engine thread: everyone waiting has been failed; /health says 503.
        # Ask the server to stop like SIGTERM would; it then exits non-zero for a supervisor to restart it.
        app.state.exit_code = 3
        os.kill(os.getpid(), signal.SIGTERM)

    async def load_in_background(app: FastAPI) -> None:
        holder: list[LoadedEngine] = []

        def load_in_engine_thread() -> SpecEngine:
            holder.append(load())
            return holder[0].engine

        metrics = app.state.metrics
        engine = AsyncEngine(load_in_engine_thread, metrics.abort_latency.observe, on_death, metrics.queue_wait.observe)
        engines.append(engine)
        try:
            await engine.ready()
        except Exception as exc:  # nothing to serve: say why in a line and exit so a supervisor sees it
            log.debug("loading the model failed", exc_info=True)
            message = str(exc)
            if not isinstance(exc, ConfigError):  # a library's message may span lines: keep it to one
                message = f"{type(exc).__name__}: {' '.join(message.split())} (--log-level debug shows the traceback)"
            for line in message.splitlines():
                print(f"specserve: {line}", file=sys.stderr, flush=True)
            os._exit(2)
        loaded = holder[0]
        app.state.metrics.queue_depth.set_function(lambda: engine.queue_depth)
        app.state.metrics.running.set_function(lambda: engine.running)
        app.state.metrics.watch_memory(engine.memory_stats)
        name = settings.served_model_name or loaded.model_name
        core = ServingCore(
            engine,
            loaded.tokenizer,
            name,
            app.state.metrics,
            request_timeout=settings.request_timeout,
            generation_defaults=settings.generation_config == "auto",
        )
        app.state.serving = Serving.over(core)
        log.info("%s", startup_summary(engine.description, name, settings, app.state.tenancy, core))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(load_in_background(app))
        yield
        task.cancel()
        for engine in engines:
            engine.shutdown(timeout=10)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.serving = None
    app.state.exit_code = 0
    app.state.metrics = Metrics(queue_depth=lambda: 0)
    app.state.started = now()
    app.state.tenancy = Tenancy.from_settings(
        settings.api_key, settings.api_key_file, settings.share_cache, settings.host
    )
    app.state.guard = GuardState(
        app.state.tenancy, settings.max_request_bytes, settings.max_queue, settings.max_num_seqs
    )
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(Guard, state=app.state.guard, metrics=app.state.metrics)
    if settings.cors_origins:  # outermost, so refusals carry CORS headers too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    return app


# the target a GGUF file's blocks with int8 activations make (--activations), named where it is served
INT8_TARGET = (
    " weights with int8 activations (llama.cpp's arithmetic on the file's blocks; --activations float32: exact)"
)


def startup_summary(
    engine: EngineDescription, name: str, settings: ServeSettings, tenancy: Tenancy, core: ServingCore
) -> str:
    """One line saying what runs where: models, device, dtype, drafter, k, memory, URL."""
    peak, now = peak_resident_bytes() / 2**20, resident_bytes()
    drafter = engine.default_drafter or "none (target alone)"
    others = ", ".join(name for name in engine.runnable_drafters if name != engine.default_drafter) or "none"
    k = "adaptive, up to " if engine.adaptive_k else ""
    draft_text = "none" if engine.draft is None else f"{engine.draft} ({engine.draft_dtype})"
    draft_text += "".join(f" | {name}: {model}" for name, model in engine.drafter_models.items())
    return (
        f"ready: serving {name!r} at http://{settings.host}:{settings.port} | target on {engine.device}, "
        f"{engine.dtype}{INT8_TARGET if engine.activations == 'int8' else ''}, {torch.get_num_threads()} threads | draft {draft_text} | "
        f"drafter {drafter}, k={k}{engine.num_draft_tokens} (per request also: {others}) | context {engine.max_model_len} | weights "
        f"{engine.weight_bytes / 2**20:,.0f} MB, KV caches {engine.cache_bytes / 2**20:,.0f} MB a slot, "
        f"{engine.max_num_seqs} slots (allocated on first use), prefix store up to "
        f"{engine.prefix_store_bytes / 2**30:.1f} GB, peak RSS {peak:,.0f} MB"
        + (f", RSS now {now / 2**20:,.0f} MB" if now is not None else "")
        + (f" | {engine.warm_up}" if engine.warm_up else "")
        + f" | {_request_defaults(core.defaults, core.system)}"
        + f" | {tenancy.describe()}"
    )


def _request_defaults(defaults: dict, system: str | None) -> str:
    """What a request that sets nothing gets (``ServingCore.defaults``, ``.system``), and where that comes from."""
    given = [f"{key} {value:g}" for key, value in defaults.items()]
    if system:
        given.append(f"system message {system!r} where a chat request sends none")
    if given:
        return f"request defaults from the model's generation config: {', '.join(given)} (--generation-config none: OpenAI's)"
    return "request defaults: OpenAI's (temperature 1, chat to the end of the context)"
