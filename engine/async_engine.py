"""The engine thread and the async client the server talks to.

One thread owns the models. Requests arrive through a queue; the thread's scheduler admits them
into sequence slots and lets them take turns step by step (``engine/scheduler.py``); each request's
outputs travel back to its event loop through its own asyncio queue. The server sees the engine
only through this client: its frozen ``description`` and the calls below.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from .engine import SpecEngine
from .errors import ConfigError
from .request import EngineDescription, Request, StepOutput
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


class DeadlinePassed(TimeoutError):
    """The request's deadline came before its last output."""


class EngineClosed(RuntimeError):
    """The engine's client ended this request: the server is shutting down."""


@dataclass(eq=False)
class _Job:
    request: Request
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    aborted: threading.Event = field(default_factory=threading.Event)
    aborted_at: float | None = None  # time.monotonic() of the abort, to measure how fast the engine let go
    queued_at: float = field(default_factory=time.monotonic)

    def abort(self) -> None:
        if not self.aborted.is_set():
            self.aborted_at = time.monotonic()
            self.aborted.set()

    def send(self, item: StepOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone (shutdown): nobody is listening
            pass


class AsyncEngine:
    """``load`` runs in the engine thread itself, so the thread that runs every forward pass is also
    the one that first touched the weights and the only one that ever starts CPU thread teams
    (a model loaded in one thread and run in another decodes measurably slower on CPU)."""

    def __init__(
        self,
        load: Callable[[], SpecEngine],
        on_abort: Callable[[float], None] = lambda seconds: None,
        on_death: Callable[[BaseException], None] = lambda exc: None,
        on_admit: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self._engine: SpecEngine | None = None  # touched from the engine thread only, but for the calls below
        self.description: EngineDescription | None = None  # set once the engine has loaded
        self._on_abort, self._on_death, self._on_admit = on_abort, on_death, on_admit  # called from the engine thread
        self._loaded: concurrent.futures.Future[SpecEngine] = concurrent.futures.Future()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._jobs: dict[str, _Job] = {}
        # outputs to remember (scope, the tokens its client received, request id), handed to the engine
        # thread before it admits its next request, so that request already sees them
        self._outputs: list[tuple[str, list[int], str]] = []
        self._outputs_lock = threading.Lock()
        self._scheduler: Scheduler | None = None
        self._dead = False
        self._thread = threading.Thread(target=self._main, args=(load,), name="specserve-engine", daemon=True)
        self._thread.start()

    async def ready(self) -> EngineDescription:
        """Wait for the load; raises what it raised."""
        await asyncio.wrap_future(self._loaded)
        return self.description

    def check_drafter(self, name: str, stages: tuple[str, ...] | None = None) -> None:
        """Raise a ConfigError unless a request may ask for drafter ``name`` (over ``stages``): it
        builds nothing, so the serving thread may call it while the engine runs."""
        if self._engine is None:
            raise ConfigError("the engine has not loaded")
        self._engine.drafters.check(name, stages)

    def drafter_speeds(self) -> dict[str, float]:
        """Tokens per second each drafter has made so far, for /v1/models and the chat page."""
        return {} if self._engine is None else self._engine.speeds.tokens_per_second()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    @property
    def running(self) -> int:
        """Requests in a slot now, taking turns."""
        return 0 if self._scheduler is None else self._scheduler.running

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        return self._queue.qsize() + (0 if self._scheduler is None else len(self._scheduler.waiting))

    def memory_stats(self) -> dict[str, int]:
        """Slots in use and allocated, and the prefix store's bytes, hits and restored tokens."""
        if self._engine is None:
            return {}
        slots, store = self._engine.slots, self._engine.store
        return {
            "slots_in_use": slots.in_use,
            "slots_allocated": slots.allocated,
            "store_bytes": store.nbytes,
            "store_hits": store.hits,
            "store_restored_tokens": store.restored_tokens,
        }

    async def generate(self, request: Request, deadline: float | None = None) -> AsyncIterator[StepOutput]:
        """Queue ``request`` and yield its outputs; leaving early aborts it. Past ``deadline``
        (``time.monotonic()``, waiting for a slot included), ``DeadlinePassed`` is raised instead."""
        if not self.alive:
            raise EngineDead("the engine thread is not running")
        job = _Job(request, asyncio.get_running_loop())
        self._jobs[request.request_id] = job
        self._queue.put(job)
        if self._dead:  # it died between the check above and the put: nobody will take the job
            self._jobs.pop(request.request_id, None)
            raise EngineDead("the engine thread is not running")
        # One timer a request puts the deadline into its queue, where the outputs arrive: wrapping each
        # awaited output in asyncio.wait_for instead starts a task per output, 23-27 us of the event loop's
        # time each on a 2-core host, which it takes from the decoding threads (docs/internals.md#the-event-loops-share).
        timer = None
        if deadline is not None:
            expired = DeadlinePassed("the request's deadline passed")
            timer = job.loop.call_later(max(0.0, deadline - time.monotonic()), job.outputs.put_nowait, expired)
        finished = False
        try:
            while not finished:
                item = await job.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            if not finished:
                job.abort()
            self._jobs.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            job.abort()

    def remember(self, tenant: str, token_ids: list[int], request_id: str = "") -> None:
        """Hand the engine an output as far as its client received it (``SpecEngine.remember``; and
        the prefix store may keep that much of it with its prompt)."""
        with self._outputs_lock:
            self._outputs.append((tenant, list(token_ids), request_id))

    def close(self, reason: str) -> None:
        """Fail every queued and running request now with ``EngineClosed(reason)``, and abort each
        in the engine: a shutdown's last word to requests that did not finish in time."""
        for job in list(self._jobs.values()):
            job.send(EngineClosed(reason))
            job.abort()

    def shutdown(self, timeout: float | None = None) -> None:
        for job in list(self._jobs.values()):
            job.abort()
        self._queue.put(None)
        self._thread.join(timeout)

    def _main(self, load: Callable[[], SpecEngine]) -> None:
        try:
            self._engine = load()
            self.description = self._engine.description
        except BaseException as exc:
            self._loaded.set_exception(exc)
            return
        self._loaded.set_result(self._engine)
        try:
            self._run()
        except BaseException as exc:  # the loop itself died: fail everyone now, let the process go
            log.critical("the engine thread died: %r", exc)
            self._dead = True
            self._fail_all(EngineDead(f"the engine thread died: {type(exc).__name__}"))
            self._on_death(exc)

    def _run(self) -> None:
        self._scheduler = Scheduler(
            self._engine, self._queue, self._hand_over_outputs, self._report_abort, self._on_admit
        )
        self._scheduler.run()

    def _hand_over_outputs(self) -> None:
        with self._outputs_lock:
            outputs, self._outputs = self._outputs, []
        for tenant, token_ids, request_id in outputs:
            self._engine.remember(tenant, token_ids)
            if request_id:
                self._scheduler.delivered(request_id, len(token_ids))

    def _report_abort(self, job: _Job) -> None:
        if job.aborted_at is not None:
            self._on_abort(time.monotonic() - job.aborted_at)

    def _fail_all(self, error: EngineDead) -> None:
        for job in [] if self._scheduler is None else self._scheduler.jobs_in_engine():
            job.send(error)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.send(error)
