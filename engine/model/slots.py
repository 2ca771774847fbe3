"""Sequence slots: several sequences resident at once, each with its own KV caches.

A *holder* is anything that keeps per-sequence state beside its weights: the target and the draft
model (their KV cache, the target's kept features and last hidden states) and an EAGLE-3 head (its
KV cache). It names that state in ``sequence_fields``. A slot holds one copy of every holder's
state; binding a slot installs its copy in the holders, so the forwards, the drafters and the
engine's step run over that slot's sequence without knowing there are others.

Binding swaps the holders' attributes (no copy), unless a forward was captured with the addresses
of the holders' tensors (CUDA graphs, a compiled static forward): then the live tensors stay, and
binding copies the outgoing sequence's positions out to its slot and the incoming one's in.
A slot's state is allocated on its first use, so memory grows with the slots actually used.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from .kv import KVCache, lazy_zeros

CONTINUES = 0.5  # a slot is taken for a prompt sharing at least this share of the prompt and of what it holds


def _fresh(value: Any) -> Any:
    """An empty counterpart of one state field: an empty cache, zeroed rows, or nothing (ordinary
    tensors even inside inference mode: ``lazy_zeros``)."""
    if isinstance(value, KVCache):
        return value.empty_like()
    if isinstance(value, torch.Tensor) and value.dim() == 3:  # kept features [A, S, E]
        return lazy_zeros(value.shape, value.dtype, value.device)
    return None if not isinstance(value, int) else 0


def _copy_into(live: Any, stored: Any) -> Any:
    """Copy ``stored`` into ``live``'s own tensors where addresses must stay; returns what the
    holder's field holds afterwards."""
    if isinstance(live, KVCache):
        live.copy_all_from(stored)
        return live
    if isinstance(live, torch.Tensor) and isinstance(stored, torch.Tensor) and live.shape == stored.shape:
        live.copy_(stored)
        return live
    return stored


@dataclass(eq=False)
class Slot:
    index: int
    states: list[dict[str, Any]] | None = None  # per holder, its fields; None until first used
    tenant: str | None = None  # whose tokens it holds; None: nobody's
    busy: bool = False  # a request runs in it now
    last_used: int = 0  # a tick of the table's clock, for least-recently-used choice
    keep: int = 0  # how many of its tokens may go to the prefix store (the prompt and what was delivered)
    prompt_len: int = 0  # its last request's prompt
    request_id: str = ""  # its last request


@dataclass(eq=False)
class SlotTable:
    holders: list[Any]
    count: int
    copy: bool = False  # bind by copying (captured forwards keep their tensors' addresses)
    slots: list[Slot] = field(init=False)
    bound: Slot | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.slots = [Slot(i) for i in range(self.count)]
        self._clock = itertools.count(1)
        self.bound = self.slots[0]  # what the holders hold now is slot 0's
        self.bound.states = [self._current(holder) for holder in self.holders]
        if self.copy:  # slot 0 keeps a stored copy like the others; the live tensors belong to nobody
            self.bound.states = [{name: _fresh(v) for name, v in state.items()} for state in self.bound.states]

    @staticmethod
    def _current(holder: Any) -> dict[str, Any]:
        return {name: getattr(holder, name) for name in holder.sequence_fields}

    def _target_cache(self, slot: Slot) -> KVCache | None:
        """The slot's target cache (the first holder is the target); None before its first use."""
        if slot.states is None:
            return None
        return self.holders[0].cache if slot is self.bound and self.copy else slot.states[0]["cache"]

    @torch.inference_mode()
    def bind(self, slot: Slot) -> None:
        """Install ``slot``'s sequence in every holder."""
        if slot is self.bound:
            return
        previous = self.bound
        if previous is not None and self.copy:  # copy the live sequence out to its slot first
            for holder, state in zip(self.holders, previous.states, strict=True):
                for name in holder.sequence_fields:
                    state[name] = _copy_into(state[name], getattr(holder, name))
        if slot.states is None:
            slot.states = [{name: _fresh(v) for name, v in self._current(h).items()} for h in self.holders]
        for holder, state in zip(self.holders, slot.states, strict=True):
            if self.copy:
                for name in holder.sequence_fields:
                    setattr(holder, name, _copy_into(getattr(holder, name), state[name]))
            else:
                if previous is not None:
                    previous.states[self.holders.index(holder)] = self._current(holder)
                for name in holder.sequence_fields:
                    setattr(holder, name, state[name])
        self.bound = slot

    def touch(self, slot: Slot) -> None:
        slot.last_used = next(self._clock)

    def shared(self, slot: Slot, tenant: str, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` the slot holds for ``tenant`` (at most all but the last)."""
        cache = self._target_cache(slot)
        if slot.tenant != tenant or cache is None:
            return 0
        return cache.matching(prompt, 0, min(cache.length, len(prompt) - 1))

    def choose(self, tenant: str, prompt: list[int]) -> Slot | None:
        """A free slot for a request of ``tenant``: of those holding their last request's whole
        prompt, or at least ``CONTINUES`` of this prompt and of what they hold, the one holding the
        most; else the least recently used (one never used first). So a next turn, a regenerated
        answer or an agent's next call finds its slot, and a side request (a chat front end's title
        request, whose prompt shares only the template's opening with the conversation, however
        much of its own short prompt that is) does not displace the conversation. None when every
        slot is busy."""
        free = [slot for slot in self.slots if not slot.busy]
        if not free:
            return None
        continued = [
            (shared, slot)
            for slot in free
            if (shared := self.shared(slot, tenant, prompt)) > 0
            and (shared >= slot.prompt_len or shared >= CONTINUES * max(len(prompt), self._target_cache(slot).length))
        ]
        if continued:
            return max(continued, key=lambda pair: (pair[0], pair[1].last_used))[1]
        return min(free, key=lambda slot: slot.last_used)

    @property
    def in_use(self) -> int:
        return sum(slot.busy for slot in self.slots)

    @property
    def allocated(self) -> int:
        return sum(slot.states is not None for slot in self.slots)
