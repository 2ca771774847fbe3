"""A separate draft model with the target's vocabulary, sampling k tokens autoregressively.

With ``draft_kv`` "target" (the default for a ``copy:DTYPE`` draft) the draft does not compute keys
and values for committed tokens: it copies the target's, cast to its dtype, so it never reads a
prompt and each step feeds it one token. Its q changes a little (the context's keys come from the
target's weights); q is still what the tokens are drawn from, so verification stays exact.
"""

from __future__ import annotations

import torch

from ..config import ConfigError
from ..model.model import CausalLM, upload
from ..sampling import RequestSampler
from ..spec import rejection_sample
from .base import Drafter, DraftResources, Proposal, sample_chain
from .registry import register


class ModelDrafter(Drafter):
    name = "model"
    runs_model = True
    can_refine = True

    def __init__(self, draft: CausalLM, min_confidence: float = 0.0, target: CausalLM | None = None) -> None:
        self.draft = draft
        self.target = target  # set when the draft reads the target's keys and values (a copy of it)
        self.min_confidence = min_confidence  # stop drafting once q's top probability falls below this
        self.stop_early = draft.device.type == "cpu"  # read the cutoff back each step (free only on CPU)

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        self.draft.cache.reuse_prefix(prompt_ids)

    @property
    def reads_target_cache(self) -> bool:
        return self.target is not None

    def lag(self, token_ids: list[int]) -> int:
        """Tokens the draft must read before it can propose: a prefill when it has not run lately.
        A draft reading the target's keys and values reads only the newest token, ever."""
        return 1 if self.target is not None else len(token_ids) - self.draft.cache.length

    def _sync(self, token_ids: list[int]) -> None:
        """Before a proposal: the draft's cache names the committed tokens it holds (drafts fed as
        device tensors get their ids back, for prefix reuse), and a draft reading the target's keys
        and values copies those of every committed token but the newest, which the target has not
        read yet. If the target has not read the prompt (a request's first step), it reads it
        here rather than in its verify pass, so neither model reads it twice."""
        cache = self.draft.cache
        cache.rollback(cache.length, token_ids)
        if self.target is None:
            return
        end = len(token_ids) - 1
        target_cache = self.target.cache
        if target_cache.length < end:
            self.target.extend(token_ids[target_cache.length : end], num_logits=0)
        cache.copy_from(target_cache, end, token_ids)

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        # drafts fed as device tensors and since committed get their ids back (for prefix reuse)
        self._sync(token_ids)
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
        self._sync(token_ids)
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


@register("model", ModelDrafter)
def _build(resources: DraftResources) -> ModelDrafter:
    if resources.draft is None:
        config = resources.config
        why = (
            f"copy:auto reads none where the start-up drafter ({config.drafter!r}) never drafts with one"
            if config.drafts_with_model == "never"
            else "copy:auto keeps none where the start-up line says the target alone decodes faster"
        )
        raise ConfigError(f"the 'model' drafter needs a draft model (--draft REF or copy:FORM; {why})")
    target = None
    if resources.config.draft_reads_target_kv:
        draft_shape, target_shape = resources.draft.cache.keys.shape, resources.target.cache.keys.shape
        if draft_shape != target_shape:
            raise ConfigError(
                f"draft_kv 'target': the draft's cache {tuple(draft_shape)} differs from the target's "
                f"{tuple(target_shape)} ([layers, 1, KV heads, length, head dim]); use draft_kv 'own'"
            )
        target = resources.target
    return ModelDrafter(resources.draft, resources.config.min_draft_confidence, target)
