"""The drafter lifecycle every strategy implements, and the registry that names them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..config import ConfigError
from ..spec import sample_one

if TYPE_CHECKING:
    from ..config import EngineConfig  # noqa: F401
    from ..model import CausalLM
    from ..sampling import RequestSampler


@dataclass(frozen=True, slots=True)
class Proposal:
    token_ids: torch.Tensor  # [k] int64
    probs: torch.Tensor | None  # [k, V] the distributions the tokens were drawn from; None for deterministic drafts
    drafter: str | None = None  # who proposed, when a drafter delegates (auto); None: the drafter asked

    @staticmethod
    def empty(device: torch.device) -> Proposal:
        return Proposal(torch.empty(0, dtype=torch.long, device=device), None)


class Drafter(Protocol):
    """begin once per request, then propose / accept once per speculative step."""

    name: str

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        """A new request starts with ``prompt_ids``; reuse whatever state still matches. ``tenant``
        (API key and user) scopes anything a drafter keeps across requests."""

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        """Propose up to ``num_draft_tokens`` tokens to follow ``token_ids`` (the committed sequence)."""

    def accept(self, num_committed: int) -> None:
        """The first ``num_committed`` tokens of the sequence are final; drop state beyond them."""


def sample_chain(
    logits: torch.Tensor,
    advance: Callable[[int], torch.Tensor],
    num_draft_tokens: int,
    sampler: RequestSampler,
    drafted: list[int] | None = None,
    rows: list[torch.Tensor] | None = None,
    min_confidence: float = 0.0,
) -> Proposal:
    """Sample draft tokens one at a time until there are ``num_draft_tokens``.

    ``logits`` [1, V] follow the last token so far; ``advance(token)`` feeds a sampled token to the
    drafting model and returns the next [1, V] logits. ``drafted``/``rows`` continue an existing
    draft (tokens with the distributions they came from). Drafting stops early when q's top
    probability falls below ``min_confidence``: a decision from q alone, so verification stays exact.
    """
    drafted, rows = list(drafted or []), list(rows or [])
    while len(drafted) < num_draft_tokens:
        q = sampler.probs(logits, torch.tensor(drafted, dtype=torch.long, device=logits.device))  # [1, V]
        if min_confidence and float(q[0].max()) < min_confidence:
            break
        drafted.append(int(sample_one(q[0], sampler.generator)))
        rows.append(q[0])
        if len(drafted) < num_draft_tokens:
            logits = advance(drafted[-1])
    if not drafted:
        return Proposal.empty(logits.device)
    token_ids = torch.tensor(drafted[:num_draft_tokens], dtype=torch.long, device=logits.device)  # [k]
    return Proposal(token_ids, torch.stack(rows[:num_draft_tokens]))  # [k], [k, V]


@dataclass(frozen=True, slots=True)
class DraftResources:
    """What a drafter may be built from."""

    config: EngineConfig
    target: CausalLM
    draft: CausalLM | None


DrafterFactory = Callable[[DraftResources], Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}
_REFINERS: set[str] = set()  # drafters with ``refine``: they can check and extend another stage's tokens


def register(name: str, refines: bool = False) -> Callable[[DrafterFactory], DrafterFactory]:
    def add(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        if refines:
            _REFINERS.add(name)
        return factory

    return add


def available() -> list[str]:
    return sorted(_REGISTRY)


def can_refine(name: str) -> bool:
    return name in _REFINERS


def build(name: str, resources: DraftResources) -> Drafter:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown drafter {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name](resources)
