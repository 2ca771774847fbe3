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
``speculators`` layout (``layers.0.*``) load alike (``engine/drafters/eagle3_head.py``).
"""

from __future__ import annotations

import logging
import time

import torch

from .. import measure
from ..config import EngineConfig
from ..errors import ConfigError
from ..model.loader import EMBEDDED_NAME
from ..model.model import CausalLM
from ..sampling import RequestSampler, SamplingParams
from .base import Drafter, DraftResources, OwnCosts, Proposal, sample_chain
from .eagle3_head import Eagle3Head, load_head, shipped_head
from .registry import register

log = logging.getLogger(__name__)


class Eagle3Drafter(Drafter):
    name = "eagle3"
    per_sequence = ("_committed", "_feature")
    runs_model = True  # its own layer, over its own cache: it catches up on what it missed
    reads_target_cache = True  # from the target's kept features: it never runs a model over a prompt

    def __init__(self, target: CausalLM, head: Eagle3Head) -> None:
        self.target = target
        self.head = head
        target.keep_features(head.aux_layers)
        self.own_model = head.describe()
        self._committed = 0  # head cache entries computed from the target's features
        self._feature: torch.Tensor | None = None  # [1, H] the head's last pre-norm output, fed back

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        """Keep the head's entries for a prefix the target kept too (in this request's scope): entry
        t also read token t + 1, so one fewer than the tokens shared."""
        cache = self.head.cache
        shared = cache.reuse_prefix(prompt_ids)
        cache.rollback(max(0, min(shared - 1, self.target.cache.length - 1)))
        self._committed = cache.length

    def lag(self, token_ids: list[int]) -> int:
        return len(token_ids) - self.head.cache.length

    @torch.inference_mode()
    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        if sampler.constraint is not None:  # a grammar may forbid the whole draft vocabulary: no q then
            return Proposal.empty(self.target.device)
        start, newest = self.head.cache.length, len(token_ids) - 1
        if newest <= start:  # a one-token prompt: no committed position to draft from yet
            return Proposal.empty(self.target.device)
        if self.target.cache.length < newest:  # a request's first step: the target reads the prompt now
            self.target.extend(token_ids[self.target.cache.length : newest], num_logits=0)
        features = self.target.feature_rows(start, newest)  # [T, A*E] of committed positions [start, newest)
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

    @torch.inference_mode()
    def own_costs(self) -> OwnCosts:
        """A step drafting one token as ``propose`` makes it (the head's layer over the newest token,
        then the draft drawn from q over the target's vocabulary: the head alone read 0.69 ms where a
        proposal of one took 1.1-1.3 on a Zen 4 host) and its read of a prompt (per token, over 64),
        best of three each, on scratch entries of its cache, each right after a target step as it runs
        live (one timed after another read 0.92-1.05 ms where after a target step it read 1.30-1.56, on
        a Zen 4 host, 2026-12-07); acceptance as recorded beside it (load_head)."""
        device = self.target.device
        features = torch.zeros(64, self.head.fc.in_features, dtype=self.target.dtype, device=device)
        sampler = RequestSampler(SamplingParams(max_tokens=2, temperature=0.0), self.target.vocab_size, device, [0], 0)
        kept = self.target.cache.length

        def timed(count: int) -> float:
            best = float("inf")
            for _ in range(3):
                measure.read_seconds(self.target, 1, repeats=1, start=kept)  # a target decode step, undone
                self.head.cache.rollback(0)
                started = time.perf_counter()
                logits = self.head.step([0] * count, self.head.fuse(features[:count]))[0]
                if count == 1:
                    sample_chain(logits, self._advance, 1, sampler).token_ids.cpu()
                else:
                    logits.cpu()
                best = min(best, time.perf_counter() - started)
            return best

        step, prompt = timed(1), timed(64)
        self.head.cache.rollback(0)
        self._committed = 0
        return OwnCosts(step, prompt / 64, self.head.acceptance)

    def accept(self, num_committed: int) -> None:
        """Entries computed from the head's own outputs go; the next proposal recomputes the
        accepted positions from the target's features."""
        self.head.cache.rollback(min(self._committed, num_committed))


@register("eagle3", Eagle3Drafter)
def _build(resources: DraftResources) -> Eagle3Drafter:
    ref = head_ref(resources.config)
    if ref is None:
        raise ConfigError("the 'eagle3' drafter needs an EAGLE-3 head (--draft-head DIR); none ships for this target")
    if ref not in resources.heads:
        resources.heads[ref] = load_head(ref, resources.target)
    return Eagle3Drafter(resources.target, resources.heads[ref])


def head_ref(config: EngineConfig) -> str | None:
    """The head the configuration names, else the one shipped for its target, if any."""
    if config.draft_head is not None:
        return config.draft_head
    shipped = shipped_head(config.target or EMBEDDED_NAME)
    return str(shipped) if (shipped / "config.json").is_file() else None


def head_drafter(resources: DraftResources) -> Eagle3Drafter | None:
    """``auto``'s eagle3 candidate: the head the configuration names (which must fit), else the one
    shipped for the target if it fits, else none."""
    if head_ref(resources.config) is None:
        return None
    try:
        return _build(resources)
    except ConfigError as exc:
        if resources.config.draft_head is not None:
            raise
        log.info("auto: the shipped EAGLE-3 head does not fit this target (%s)", exc)
        return None
