"""The drafter lifecycle every strategy implements, and the chain sampler model drafters share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from ..spec import keyed_tokens, sample_one

if TYPE_CHECKING:
    from ..config import EngineConfig  # noqa: F401
    from ..model.model import CausalLM
    from ..outputs import OutputCache
    from ..sampling import RequestSampler
    from .eagle3_head import Eagle3Head


@dataclass(frozen=True, slots=True)
class Proposal:
    token_ids: torch.Tensor  # [k] int64
    probs: torch.Tensor | None  # [k, V] the distributions the tokens were drawn from; None for deterministic drafts
    drafter: str | None = None  # who proposed, when a drafter delegates (auto); None: the drafter asked
    # [] how many leading drafts count, when a confidence cutoff was decided on the device (the
    # rest were drafted anyway, so the host never waited); None: all of them
    num_proposed: torch.Tensor | None = None

    @staticmethod
    @cache  # one per device: nothing writes to a proposal's tensors, and a step need not allocate one
    def empty(device: torch.device) -> Proposal:
        return Proposal(torch.empty(0, dtype=torch.long, device=device), None)


@dataclass(frozen=True, slots=True)
class OwnCosts:
    """What a drafter's own model costs, timed at start-up (``Drafter.own_costs``)."""

    step_seconds: float  # one drafted token
    seconds_per_token: float  # per token of a long catch-up (a prompt)
    acceptance: float | None = None  # its expected acceptance, where known; None: the usual prior


class Drafter(Protocol):
    """begin once per request, then propose / accept once per speculative step.

    The optional abilities below are declared here with the value a drafter without them has; a
    drafter that has one subclasses this protocol and overrides it. Nothing looks for them by name
    or by ``hasattr``."""

    name: str
    # It runs a draft model that must read the committed tokens before it proposes (``lag``).
    runs_model: bool = False
    # Its model takes the committed tokens' keys and values from the target's cache, so it never
    # catches up on a prompt: it reads one token a step.
    reads_target_cache: bool = False
    # It can check and extend another stage's proposal (``refine``): a later stage of a chain.
    can_refine: ClassVar[bool] = False
    # A model of its own it drafts with (an EAGLE-3 head), described for the start-up line and
    # /v1/models; None: none, or the shared draft model.
    own_model: str | None = None
    # A text matcher's last ``offer``: how many tokens of the sequence the match it continues spans,
    # and whether its first token was one of several seen after that match (not the only one).
    match_length: int = 0
    match_split: bool = False
    # The attributes that belong to the sequence being drafted (reset by ``begin``): what ``park``
    # keeps while another sequence uses this drafter, and ``resume`` puts back.
    per_sequence: ClassVar[tuple[str, ...]] = ()

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        """A new request starts with ``prompt_ids``; reuse whatever state still matches. ``tenant``
        (API key and user) scopes anything a drafter keeps across requests."""

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        """Propose up to ``num_draft_tokens`` tokens to follow ``token_ids`` (the committed sequence)."""

    def accept(self, num_committed: int) -> None:
        """The first ``num_committed`` tokens of the sequence are final; drop state beyond them."""

    def offer(self, token_ids: list[int], limit: int) -> list[int]:
        """A text matcher's proposal, as ``propose``'s tokens on the host, and the length of the match
        it continues in ``match_length`` (``auto`` asks every step before choosing, and uploads only
        what it takes); none from a drafter that runs a model."""
        return []

    def parts(self) -> list[Drafter]:
        """The drafters it drafts through (a chain's stages, auto's candidates), for ``park``."""
        return []

    def park(self) -> tuple:
        """Its sequence's state, while another sequence's steps run (``engine/scheduler.py``);
        ``begin`` makes new objects for a new sequence, so what is parked stays as it was."""
        return tuple(getattr(self, name) for name in self.per_sequence), [part.park() for part in self.parts()]

    def resume(self, parked: tuple) -> None:
        own, parts = parked
        for name, value in zip(self.per_sequence, own, strict=True):
            setattr(self, name, value)
        for part, state in zip(self.parts(), parts, strict=True):
            part.resume(state)

    def lag(self, token_ids: list[int]) -> int:
        """Tokens its model must read before it can propose (``runs_model``); 0 without one."""
        return 0

    def refine(
        self, token_ids: list[int], cheaper: Proposal, num_draft_tokens: int, sampler: RequestSampler
    ) -> Proposal:
        """As a later stage (``can_refine``): check ``cheaper``'s tokens against this drafter's q,
        keep what passes and extend it to ``num_draft_tokens``."""
        raise NotImplementedError(f"the {self.name!r} drafter cannot refine another stage's tokens")

    def target_layer_sets(self) -> list[tuple[int, ...]]:
        """Subsets of the target's layers it runs as forwards of their own, which start-up prepares
        (captures or compiles) beside the whole model's."""
        return []

    def own_costs(self) -> OwnCosts | None:
        """Start-up's timing of a model this drafter runs that is not the shared draft model (an
        EAGLE-3 head); None: it runs the draft model, or none. ``auto`` prices it by these."""
        return None

    def warm_up(self) -> str | None:
        """Start-up's hook, after the forwards are prepared: measure what the drafter needs to know
        before the first request (step costs, say); what it decided from them, for the start-up line."""


def draw(q: torch.Tensor, sampler: RequestSampler, offset: int) -> torch.Tensor:
    """A draft token [] from ``q`` [V] for the output position ``offset`` past the next one. For a
    seeded request, the target's own draw there uses the same keyed uniform (``spec.keyed_tokens``),
    so a draft close to the target lands on the same token (coupled); otherwise the generator's."""
    if sampler.params.seed is None:
        return sample_one(q, sampler.generator)
    return keyed_tokens(q.unsqueeze(0), sampler.params.seed, sampler.num_output + offset)[0]


def sample_chain(
    logits: torch.Tensor,
    advance: Callable[[torch.Tensor], torch.Tensor],
    num_draft_tokens: int,
    sampler: RequestSampler,
    drafted: torch.Tensor | None = None,
    rows: list[torch.Tensor] | None = None,
    min_confidence: float = 0.0,
    stop_early: bool | None = None,
) -> Proposal:
    """Sample draft tokens one at a time until there are ``num_draft_tokens``, on the device.

    ``logits`` [1, V] follow the last token so far; ``advance(token)`` feeds a sampled token [1] to
    the drafting model and returns the next [1, V] logits. ``drafted`` [m] / ``rows`` continue an
    existing draft (tokens with the distributions they came from). No token is read back: the host
    never waits for the device while drafting.

    Drafting ends at the first position where q's top probability falls below ``min_confidence``, a
    decision from q alone, so verification stays exact. It is made on the device (a count of leading
    confident drafts, ``Proposal.num_proposed``). With ``stop_early`` (default: on CPU, where reading
    it back costs nothing) the loop also stops there and saves the remaining draft forwards.
    """
    device = logits.device
    tokens = list(drafted.unbind(0)) if drafted is not None else []  # each [] int64
    rows = list(rows or [])
    # filled on the device: torch.tensor(value, device=...) would copy from the host and wait for the device
    num_proposed = torch.full((), len(tokens), dtype=torch.long, device=device)  # [] leading drafts past the cutoff
    confident = torch.ones((), dtype=torch.bool, device=device)  # [] every draft so far passed
    stops_early = device.type == "cpu" if stop_early is None else stop_early
    while len(tokens) < num_draft_tokens:
        appended = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long, device=device)
        q = sampler.probs(logits, appended)[0]  # [V]
        if min_confidence:
            confident = confident & (q.max() >= min_confidence)
            if stops_early and not bool(confident):
                break
            num_proposed = num_proposed + confident.long()
        tokens.append(draw(q, sampler, len(tokens)))
        rows.append(q)
        if len(tokens) < num_draft_tokens:
            logits = advance(tokens[-1].view(1))
    if not tokens:
        return Proposal.empty(device)
    cut = num_proposed if min_confidence and not stops_early else None
    return Proposal(torch.stack(tokens[:num_draft_tokens]), torch.stack(rows[:num_draft_tokens]), num_proposed=cut)


@dataclass(frozen=True, slots=True)
class DraftResources:
    """What a drafter may be built from."""

    config: EngineConfig
    target: CausalLM
    draft: CausalLM | None
    draft_agreement: float | None = None  # the draft's agreement with the target, where start-up measured it
    outputs: OutputCache | None = None  # the engine's recent outputs, one cache whichever drafters read it
    # EAGLE-3 heads loaded, by ref: the eagle3 drafter and auto's candidate share one (weights and cache)
    heads: dict[str, Eagle3Head] = field(default_factory=dict)
