"""A separate draft model with the target's vocabulary, sampling k tokens autoregressively."""

from __future__ import annotations

import torch

from ..config import ConfigError
from ..model import CausalLM
from ..sampling import RequestSampler
from .base import DraftResources, Proposal, register


class ModelDrafter:
    name = "model"

    def __init__(self, draft: CausalLM) -> None:
        self.draft = draft

    def begin(self, prompt_ids: list[int]) -> None:
        self.draft.cache.reuse_prefix(prompt_ids)

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        pending = token_ids[self.draft.cache.length :]  # the last token, plus a fully accepted draft's tail
        logits = self.draft.extend(pending)  # [1, V]
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(num_draft_tokens):
            q = sampler.probs(logits, torch.tensor(drafted, dtype=torch.long, device=logits.device))  # [1, V]
            token = int(torch.multinomial(q[0], 1, generator=sampler.generator))
            drafted.append(token)
            rows.append(q[0])
            if i + 1 < num_draft_tokens:
                logits = self.draft.extend([token])
        device = logits.device
        return Proposal(torch.tensor(drafted, dtype=torch.long, device=device), torch.stack(rows))  # [k], [k, V]

    def accept(self, num_committed: int) -> None:
        self.draft.cache.rollback(min(num_committed, self.draft.cache.length))


@register("model")
def _build(resources: DraftResources) -> ModelDrafter:
    if resources.draft is None:
        raise ConfigError("the 'model' drafter needs a draft model (--draft REF)")
    return ModelDrafter(resources.draft)
