"""A separate draft model with the target's vocabulary, sampling k tokens autoregressively."""

from __future__ import annotations

import torch

from ..config import ConfigError
from ..model import CausalLM, upload
from ..sampling import RequestSampler
from ..spec import rejection_sample
from .base import DraftResources, Proposal, register, sample_chain


class ModelDrafter:
    name = "model"

    def __init__(self, draft: CausalLM, min_confidence: float = 0.0) -> None:
        self.draft = draft
        self.min_confidence = min_confidence  # stop drafting once q's top probability falls below this
        self.stop_early = draft.device.type == "cpu"  # read the cutoff back each step (free only on CPU)

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        self.draft.cache.reuse_prefix(prompt_ids)

    def lag(self, token_ids: list[int]) -> int:
        """Tokens the draft must read before it can propose: a prefill when it has not run lately."""
        return len(token_ids) - self.draft.cache.length

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        # drafts fed as device tensors and since committed get their ids back (for prefix reuse)
        self.draft.cache.rollback(self.draft.cache.length, token_ids)
        pending = token_ids[self.draft.cache.length :]  # the last token, plus a fully accepted draft's tail
        logits = self.draft.extend(pending)  # [1, V]
        return sample_chain(
            logits,
            self._advance,
            num_draft_tokens,
            sampler,
            min_confidence=self.min_confidence,
            stop_early=self.stop_early,
        )

    def refine(
        self, token_ids: list[int], cheaper: Proposal, num_draft_tokens: int, sampler: RequestSampler
    ) -> Proposal:
        """As a middle stage: verify a cheaper drafter's tokens against this model's q (one forward),
        keep the accepted prefix plus one resampled or bonus token, then extend to k tokens.

        Rejection sampling makes every kept token distributed as this model's q given its prefix, so
        the returned probabilities are q's rows and the target's verification stays exact."""
        self.draft.cache.rollback(self.draft.cache.length, token_ids)
        guesses = cheaper.token_ids.tolist()  # cheap stages draft on the host
        pending = token_ids[self.draft.cache.length :]
        logits = self.draft.extend(pending + guesses, num_logits=len(guesses) + 1)  # [m+1, V]
        q = sampler.probs(logits, cheaper.token_ids)  # [m+1, V]
        verdict = rejection_sample(cheaper.token_ids, cheaper.probs, q, sampler.generator)
        kept = verdict.num_accepted
        self.draft.cache.rollback(len(token_ids) + kept)
        drafted = upload(verdict.token_ids, q.device)  # [kept+1]
        rows = [q[i] for i in range(kept + 1)]
        if len(drafted) < num_draft_tokens:  # the cache holds all but the newest drafted token: feed it
            logits = self._advance(drafted[-1:])
            return sample_chain(logits, self._advance, num_draft_tokens, sampler, drafted, rows)
        return Proposal(drafted[:num_draft_tokens], torch.stack(rows[:num_draft_tokens]))  # [k], [k, V]

    def _advance(self, token: torch.Tensor) -> torch.Tensor:
        return self.draft.extend(token)  # [1] -> [1, V]

    def accept(self, num_committed: int) -> None:
        self.draft.cache.rollback(min(num_committed, self.draft.cache.length))


@register("model", refines=True)
def _build(resources: DraftResources) -> ModelDrafter:
    if resources.draft is None:
        raise ConfigError("the 'model' drafter needs a draft model (--draft REF)")
    return ModelDrafter(resources.draft, resources.config.min_draft_confidence)
