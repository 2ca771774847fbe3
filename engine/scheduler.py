"""Which request steps next: admission into sequence slots, turns of one step each, chunked prefill.

The engine thread runs ``Scheduler.run``. Requests wait in arrival order and are admitted while a
slot is free: the slot holding the longest prefix of the prompt within the request's scope, else
the least recently used (``SlotTable.choose``). Admitted requests take turns, round robin, one
speculative step each, or one chunk of a long prompt while others wait (``SpecEngine.generate``),
so a new request's first token comes after at most a step of each running request plus its own
prefill, never after a whole answer. A turn binds the request's slot and puts back its drafters'
state; the step itself stays ``SpecEngine.step``, over one sequence at batch size 1.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .engine import SpecEngine
from .model.slots import Slot
from .request import StepOutput

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Run:
    job: Any  # async_engine's job: request, send(), aborted, queued_at
    slot: Slot
    outputs: Iterator[StepOutput | None]
    parked: dict[int, tuple] | None = None  # its drafters' state while another run steps
    started: bool = False  # its drafters have begun (at its first turn)


class Scheduler:
    def __init__(
        self,
        engine: SpecEngine,
        jobs: queue.Queue,
        before_admitting: Callable[[], None],
        finished: Callable[[Any], None],
        on_admit: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        """``jobs``: arrivals (None: stop); ``before_admitting``: hands the engine what clients
        received, so a new request sees it; ``finished(job)``: a job left the engine; ``on_admit``:
        the seconds a job waited for its slot."""
        self.engine, self.jobs = engine, jobs
        self.before_admitting, self.finished, self.on_admit = before_admitting, finished, on_admit
        self.waiting: deque[Any] = deque()  # arrived, not yet in a slot
        self.active: deque[Run] = deque()  # in a slot, waiting for their turn
        self.current: Run | None = None  # whose slot and drafter state are installed now
        self.stopping = False  # told to stop: admit nothing more, let the running requests end

    @property
    def running(self) -> int:
        return len(self.active) + (self.current is not None and self.current not in self.active)

    def run(self) -> None:
        while self._take():
            if not self.stopping:
                self._admit()
            if self.active:
                self._turn()

    def jobs_in_engine(self) -> list[Any]:
        """Every job admitted or waiting here (to fail them all if the loop dies)."""
        runs = list(self.active) + ([self.current] if self.current and self.current not in self.active else [])
        return [run.job for run in runs] + list(self.waiting)

    def delivered(self, request_id: str, num_output: int) -> None:
        """A client received ``num_output`` tokens of a finished request: that much of its output
        may go to the prefix store with its prompt, if its slot still holds it."""
        for slot in self.engine.slots.slots:
            if slot.request_id == request_id and not slot.busy and slot.tenant is not None:
                slot.keep = slot.prompt_len + num_output

    def _take(self) -> bool:
        """Move arrivals to the waiting line, blocking while there is nothing to do. False: stop,
        once the requests running when told to (aborted by then) have ended."""
        if self.stopping:
            return bool(self.active)
        block = not self.active and not self.waiting
        while True:
            try:
                job = self.jobs.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                self.stopping = True
                for waiting in self.waiting:
                    waiting.send(StepOutput([], "abort"))
                    self.finished(waiting)
                self.waiting.clear()
                return bool(self.active)
            self.waiting.append(job)
            block = False

    def _admit(self) -> None:
        self.before_admitting()
        while self.waiting:
            job = self.waiting[0]
            if job.aborted.is_set():  # its client left while it waited
                self.waiting.popleft()
                job.send(StepOutput([], "abort"))
                self.finished(job)
                continue
            slot = self.engine.slots.choose(job.request.tenant, list(job.request.prompt_ids))
            if slot is None:
                return
            self.waiting.popleft()
            self._switch(None)
            self.engine.admit(slot, job.request.tenant, list(job.request.prompt_ids))
            slot.request_id = job.request.request_id
            outputs = self.engine.generate(job.request, job.aborted.is_set, self._crowded)
            run = Run(job, slot, outputs)
            self.active.append(run)
            self.current = run  # its slot is bound; its drafters begin at its first turn
            self.on_admit(time.monotonic() - job.queued_at)

    def _crowded(self) -> bool:
        return bool(self.active or self.waiting or not self.jobs.empty())

    def _turn(self) -> None:
        run = self.active.popleft()
        self._switch(run)
        run.started = True
        try:
            output = next(run.outputs, StepOutput([], "abort"))
        except Exception as exc:  # one request failed: report it, reset its slot, keep serving
            log.exception("request %s failed", run.job.request.request_id)
            self.engine.reset()
            run.job.send(exc)
            self._close(run)
            return
        if output is None:  # a chunk of its prompt was read
            self.active.append(run)
            return
        run.job.send(output)
        if output.finish_reason is None:
            self.active.append(run)
        else:
            self._close(run)

    def _switch(self, run: Run | None) -> None:
        """Install ``run``'s slot and drafter state, parking the current run's."""
        if self.current is run:
            return
        if self.current is not None and self.current.started:
            self.current.parked = self.engine.drafters.park()
        if run is not None:
            self.engine.slots.bind(run.slot)
            if run.parked is not None:
                self.engine.drafters.resume(run.parked)
        self.current = run

    def _close(self, run: Run) -> None:
        if self.current is run:
            self.current = None
        slot = run.slot
        slot.busy = False
        if slot.tenant is not None:  # its prompt may be stored; its output once its client received it
            slot.keep = slot.prompt_len
        self.engine.slots.touch(slot)
        self.finished(run.job)
