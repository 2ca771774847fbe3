"""The drafter lifecycle every strategy implements, and the registry that names them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..config import ConfigError

if TYPE_CHECKING:
    from ..config import EngineConfig  # noqa: F401
    from ..model import CausalLM
    from ..sampling import RequestSampler


@dataclass(frozen=True, slots=True)
class Proposal:
    token_ids: torch.Tensor  # [k] int64
    probs: torch.Tensor | None  # [k, V] the distributions the tokens were drawn from; None for deterministic drafts

    @staticmethod
    def empty(device: torch.device) -> Proposal:
        return Proposal(torch.empty(0, dtype=torch.long, device=device), None)


class Drafter(Protocol):
    """begin once per request, then propose / accept once per speculative step."""

    name: str

    def begin(self, prompt_ids: list[int]) -> None:
        """A new request starts with ``prompt_ids``; reuse whatever state still matches."""

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        """Propose up to ``num_draft_tokens`` tokens to follow ``token_ids`` (the committed sequence)."""

    def accept(self, num_committed: int) -> None:
        """The first ``num_committed`` tokens of the sequence are final; drop state beyond them."""


@dataclass(frozen=True, slots=True)
class DraftResources:
    """What a drafter may be built from."""

    config: EngineConfig
    target: CausalLM
    draft: CausalLM | None


DrafterFactory = Callable[[DraftResources], Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def add(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        return factory

    return add


def available() -> list[str]:
    return sorted(_REGISTRY)


def build(name: str, resources: DraftResources) -> Drafter:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown drafter {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name](resources)
