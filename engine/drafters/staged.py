"""Staged speculation: a chain of drafters of increasing cost, built by composition.

The first stage proposes; each later stage verifies that proposal against its own distribution with
the same rejection sampler the target uses, keeps what passes and extends it. The target then
verifies the last stage's tokens against that stage's q. E.g. ``ngram,model``: free n-gram guesses
checked by the draft model in one forward instead of k sequential draft steps.
"""

from __future__ import annotations

from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal
from .registry import build, check_stages, register


class StagedDrafter(Drafter):
    name = "staged"

    def __init__(self, stages: list[Drafter]) -> None:
        check_stages(tuple(stage.name for stage in stages))
        self.stages = stages

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        for stage in self.stages:
            stage.begin(prompt_ids, tenant)

    def parts(self) -> list[Drafter]:
        return list(self.stages)

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        proposal = self.stages[0].propose(token_ids, num_draft_tokens, sampler)
        for stage in self.stages[1:]:
            proposal = stage.refine(token_ids, proposal, num_draft_tokens, sampler)
        return proposal

    @property
    def runs_model(self) -> bool:
        return any(stage.runs_model for stage in self.stages)

    @property
    def reads_target_cache(self) -> bool:
        """Every stage that runs a model reads the target's cache (none catches up on a prompt)."""
        return self.runs_model and all(stage.reads_target_cache for stage in self.stages if stage.runs_model)

    def lag(self, token_ids: list[int]) -> int:
        """The most any stage must read before proposing (see ModelDrafter.lag); 0 for host-side stages."""
        return max(stage.lag(token_ids) for stage in self.stages)

    def target_layer_sets(self) -> list[tuple[int, ...]]:
        return [layers for stage in self.stages for layers in stage.target_layer_sets()]

    def accept(self, num_committed: int) -> None:
        for stage in self.stages:
            stage.accept(num_committed)


@register("staged", StagedDrafter)
def _build(resources: DraftResources) -> StagedDrafter:
    return StagedDrafter([build(name, resources) for name in resources.config.stages])
