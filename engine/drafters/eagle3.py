"""EAGLE-3 (Li et al., 2025): one decoder layer, fed by the target's own residual streams, drafts.

The head reads the residual stream entering three of the target's layers (by default 2, L/2 and
L-3, as vLLM and SGLang take them) at every position the target scored. For committed position t it
runs one layer over concat(input_layernorm(embed(x[t+1])), hidden_norm(g[t])), where g[t] =
fc(concat(low, mid, high)) from the target; a drafted position feeds back the head's own pre-norm
output instead. Logits over its reduced vocabulary map to target ids (target = i + d2t[i]).

Exactness: each proposal carries q over the whole target vocabulary, zero outside the head's
vocabulary, through the request's own sampling transforms (``RequestSampler.probs``), so the
rejection sampler keeps the output the target's at every temperature.

The head keeps its own KV cache: entries for committed positions, computed from the target's
features, stay; entries for drafted positions (computed from the head's own output) go at every
``accept``. Checkpoints in the EAGLE repository's and SpecForge's layout (``midlayer.*``) and in the
``speculators`` layout (``layers.0.*``) load alike (``engine/eagle3_head.py``).
"""

from __future__ import annotations

import torch

from ..eagle3_head import Eagle3Head, load_head
from ..errors import ConfigError
from ..model import CausalLM
from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal, sample_chain
from .registry import register


class Eagle3Drafter(Drafter):
    name = "eagle3"
    reads_target_cache = True  # the features are the target's: the head never reads a prompt alone

    def __init__(self, target: CausalLM, head: Eagle3Head) -> None:
        if target.runner is not None:
            raise ConfigError("the eagle3 drafter needs eager target forwards for now; use --enforce-eager")
        self.target = target
        self.head = head
        target.aux_layers = head.aux_layers
        self._committed = 0  # head cache entries computed from the target's features
        self._feature: torch.Tensor | None = None  # [1, H] the head's last pre-norm output, fed back

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        """Keep the head's entries for a shared prefix where the target kept its own; the target
        then reads again from the first position the head needs features for."""
        cache = self.head.cache
        shared = cache.reuse_prefix(prompt_ids)
        cache.rollback(max(0, min(shared - 1, self.target.cache.length - 1)))
        if self.target.cache.length > cache.length:
            self.target.cache.rollback(cache.length)
        self._committed = cache.length

    @torch.inference_mode()
    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        if sampler.constraint is not None:  # a grammar may forbid the whole draft vocabulary: no q then
            return Proposal.empty(self.target.device)
        start, newest = self.head.cache.length, len(token_ids) - 1
        features = self.target.aux_rows(start, newest)  # [T, A*E] of positions [start, newest)
        if features is None:  # not from the last forward (a request's first step): the target reads them
            self.target.cache.rollback(min(start, self.target.cache.length))
            self.target.extend(token_ids[self.target.cache.length : newest], num_logits=0)
            features = self.target.aux_rows(start, newest)
        # committed position t reads token t + 1 with the target's features of t
        logits, self._feature = self.head.step(token_ids[start + 1 : newest + 1], self.head.fuse(features))
        self.head.cache.append(token_ids[start:newest])
        self._committed = self.head.cache.length
        return sample_chain(logits, self._advance, num_draft_tokens, sampler)

    def _advance(self, token: torch.Tensor) -> torch.Tensor:
        """A drafted token [1] -> the next full-vocabulary logits [1, V], from the head's own output."""
        logits, self._feature = self.head.step(token, self._feature)
        self.head.cache.append(1)
        return logits

    def accept(self, num_committed: int) -> None:
        """Entries computed from the head's own outputs go; the next proposal recomputes the
        accepted positions from the target's features."""
        self.head.cache.rollback(min(self._committed, num_committed))


@register("eagle3", Eagle3Drafter)
def _build(resources: DraftResources) -> Eagle3Drafter:
    ref = resources.config.draft_head
    if ref is None:
        raise ConfigError("the 'eagle3' drafter needs an EAGLE-3 head (--draft-head DIR)")
    return Eagle3Drafter(resources.target, load_head(ref, resources.target))
