"""Staged speculation: a chain of drafters of increasing cost, built by composition.

The first stage proposes; each later stage verifies that proposal against its own distribution with
the same rejection sampler the target uses, keeps what passes and extends it. The target then
verifies the last stage's tokens against that stage's q. E.g. ``ngram,model``: free n-gram guesses
checked by the draft model in one forward instead of k sequential draft steps.
"""

from __future__ import annotations

from ..config import ConfigError
from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal, build, register


class StagedDrafter:
    name = "staged"

    def __init__(self, stages: list[Drafter]) -> None:
        if len(stages) < 2:
            raise ConfigError("the staged drafter needs at least two stages, e.g. ngram,model")
        for stage in stages[1:]:
            if not hasattr(stage, "refine"):
                raise ConfigError(f"drafter {stage.name!r} cannot verify and extend another stage's tokens")
        self.stages = stages

    def begin(self, prompt_ids: list[int]) -> None:
        for stage in self.stages:
            stage.begin(prompt_ids)

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        proposal = self.stages[0].propose(token_ids, num_draft_tokens, sampler)
        for stage in self.stages[1:]:
            proposal = stage.refine(token_ids, proposal, num_draft_tokens, sampler)
        return proposal

    def accept(self, num_committed: int) -> None:
        for stage in self.stages:
            stage.accept(num_committed)


@register("staged")
def _build(resources: DraftResources) -> StagedDrafter:
    if "staged" in resources.config.stages:
        raise ConfigError("the staged drafter cannot contain itself")
    return StagedDrafter([build(name, resources) for name in resources.config.stages])
