"""Graceful shutdown: drain, then stop listening.

On SIGTERM or Ctrl-C the server keeps listening while it drains: ``/health`` and new requests get
503 at once (the Guard's ``draining`` flag), and running and queued requests get
``shutdown_timeout`` seconds to finish. Those still running then end the way any engine failure
ends for a client: a stream with an error event (code ``shutting_down``) and ``[DONE]``, a whole
response with a 503. Only then does uvicorn stop listening and close its connections, so nothing
is cut mid-token and no task is left to cancel. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn
from sse_starlette.sse import AppStatus

log = logging.getLogger(__name__)
SETTLE_SECONDS = 5.0  # after the requests were told to end: time for their last events to go out


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        super().__init__(config)
        # sse-starlette would end every stream at the signal; the drain below ends them instead.
        AppStatus.disable_automatic_graceful_drain()
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        state = self.config.app.state
        if state.guard.draining or self._loop is None:  # a second signal, or before serving: stop now
            super().handle_exit(sig, frame)
        else:
            state.guard.draining = True
            self._loop.call_soon_threadsafe(self._start_drain, sig)
        self._keep_exit_code()

    def _start_drain(self, sig: int) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        state = self.config.app.state
        guard = state.guard
        log.info("shutting down: waiting up to %g s for %d request(s)", self.shutdown_timeout, guard.admitted)
        await _until(lambda: not guard.admitted, self.shutdown_timeout)
        if guard.admitted and state.serving is not None:
            log.warning("shutting down: ending %d request(s) that did not finish in time", guard.admitted)
            state.serving.core.engine.close(
                f"the server is shutting down; the request did not finish within {self.shutdown_timeout:g} s"
            )
            await _until(lambda: not guard.admitted, SETTLE_SECONDS)
        super().handle_exit(sig, None)
        self._keep_exit_code()

    def _keep_exit_code(self) -> None:
        """uvicorn raises the signals it caught again once it has stopped, which would end the
        process "killed by SIGTERM" (or in a KeyboardInterrupt traceback); a shutdown that was asked
        for exits with the app's code instead (0, or 3 after the engine died)."""
        self._captured_signals = [s for s in self._captured_signals if s not in (signal.SIGTERM, signal.SIGINT)]


async def _until(done, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
