"""Fault injection for the reliability tests, installed at the engine's one hook point
(``SpecEngine.logits_hook``); nothing of it is in the production modules.

In-process tests set the hook themselves. A server process under test runs through
``tests/fault_server.py``, which installs ``prompt_faults``: a request whose prompt holds
``fault_marker(kind, step)`` fails in that step's target forward.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

from engine.engine import SpecEngine
from engine.request import Request


class InjectedFault(RuntimeError):
    """Raised inside the target's forward pass."""


class EngineKilled(BaseException):
    """Ends the engine thread: it escapes the engine's per-request error handling."""


def _raise(logits: torch.Tensor) -> torch.Tensor:
    raise InjectedFault("injected fault in the target's forward pass")


def _kill(logits: torch.Tensor) -> torch.Tensor:
    raise EngineKilled("injected engine death")


def _stall(logits: torch.Tensor) -> torch.Tensor:
    time.sleep(STALL_SECONDS)  # a slow step: the reply is still streaming when a client acts on it
    return logits


STALL_SECONDS = 3.0
FAULTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "raise": _raise,
    "nan": lambda logits: torch.full_like(logits, float("nan")),
    "kill": _kill,
    "stall": _stall,
}
MARKER = re.compile(r"<<fault (\w+) at (\d+)>>")


def fault_marker(kind: str, step: int) -> str:
    """Prompt text that makes a request fail with FAULTS[kind] in its step ``step`` (0: the first)."""
    return f"<<fault {kind} at {step}>>"


def every_forward(
    change: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[Request, int, torch.Tensor], torch.Tensor]:
    """A hook applying ``change`` to the logits of every target forward."""
    return lambda request, forwards, logits: change(logits)


def prompt_faults(engine: SpecEngine, decode: Callable[[list[int]], str]) -> None:
    """Install the hook that reads fault markers from each request's prompt."""

    def hook(request: Request, forwards: int, logits: torch.Tensor) -> torch.Tensor:
        found = MARKER.search(decode(request.prompt_ids))
        if found is not None and int(found[2]) == forwards:
            return FAULTS[found[1]](logits)
        return logits

    engine.logits_hook = hook
