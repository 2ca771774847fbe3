"""The speculative engine: batch size 1, one sequence per step, caches resident across requests.

Several sequences stay resident in slots (``engine/model/slots.py``), and what a reused slot held
goes to the host-memory prefix store (``engine/model/prefix_store.py``); which request steps next
is the scheduler's (``engine/scheduler.py``). Start-up (building the models' wrappers, warm-up,
the report of it) is ``engine/factory.py``'s; the drafters are ``engine/drafters``'; this module
runs one request's steps over the slot bound now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .adaptive import AdaptiveK, StepCosts
from .config import NO_DRAFTER, EngineConfig, dtype_name
from .drafters import Drafter, DrafterSet, DraftResources, Proposal
from .model.loader import default_system, generation_defaults
from .model.model import CausalLM
from .model.prefix_store import BLOCK, PrefixStore, positional
from .model.slots import Slot, SlotTable
from .outputs import OutputCache
from .request import EngineDescription, Request, StepOutput, TokenLogprob, check_fits
from .sampling import RequestSampler, all_finite
from .spec import greedy_verdict, keyed_tokens, rejection_sample
from .stats import DrafterSpeeds, SpecStats, StepRecord

log = logging.getLogger(__name__)
# Called with the request, the number of target forwards it ran so far and a forward's logits
# [k+1, V]; returns the logits to verify against. None in serving: tests install one (tests/faults.py).
LogitsHook = Callable[[Request, int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class _StepResult:
    token_ids: list[int]
    target_logits: torch.Tensor  # [len(token_ids), V] the rows each token was verified or sampled from
    record: StepRecord


@dataclass(slots=True)
class _Sequence:
    request: Request
    token_ids: list[int]  # prompt plus committed output
    prompt_len: int
    sampler: RequestSampler
    drafter: Drafter | None
    policy: AdaptiveK | None  # None: draft a fixed number of tokens
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


class SpecEngine:
    def __init__(
        self,
        config: EngineConfig,
        target: CausalLM,
        draft: CausalLM | None,
        eos_token_ids: set[int],
        tokenizer_size: int | None = None,
        draft_agreement: float | None = None,
    ) -> None:
        """``tokenizer_size``: ids the tokenizer can decode; logit rows past it (padding) are never
        sampled. ``draft_agreement``: the draft's agreement with the target where start-up already
        measured it (``choose_copy``), so that warm-up need not measure it again."""
        self.config = config
        self.target = target
        self.draft = draft
        self.eos_token_ids = eos_token_ids
        # Requests without a seed draw one from here: reproducible runs under --seed, fresh ones otherwise.
        self._seeds = torch.Generator()
        self._seeds.manual_seed(config.seed) if config.seed is not None else self._seeds.seed()
        # Sampling runs over the ids both models share and the tokenizer can decode, in every mode.
        sizes = [model.vocab_size for model in (target, draft) if model is not None]
        self.vocab_size = min(sizes + ([tokenizer_size] if tokenizer_size else []))
        # recent outputs, for drafters that match text across requests: one cache, bounded in total
        self.outputs = OutputCache(config.suffix_cache_requests if config.suffix_global else 0)
        self.drafters = DrafterSet(DraftResources(config, target, draft, draft_agreement, self.outputs))
        # the sequences resident at once: the target, the draft model and every EAGLE-3 head hold one
        # state per slot; the slot bound now is the one the step runs over
        holders = [*self.models, *self.drafters.resources.heads.values()]
        self.slots = SlotTable(holders, config.max_num_seqs, copy=config.forward_mode != "eager")
        self.store = PrefixStore(config.prefix_cache_bytes)
        self._costs: dict[str, StepCosts] = {}  # what each drafter's steps cost here, learned across requests
        self.warm_up_report: str = ""  # how start-up prepared the forwards (engine/factory.py)
        self.system_fingerprint: str = ""  # what decides the logits' bits (engine/model/fingerprint.py)
        self.compiled: int | None = None  # compiled variants and kernels as of warm-up (then as last seen)
        self.speeds = DrafterSpeeds()  # measured tokens/s by drafter, for /v1/models and the chat page
        self.logits_hook: LogitsHook | None = None
        self.default_drafter = None if config.drafter == NO_DRAFTER else config.drafter
        if self.default_drafter is not None:
            self.drafter(self.default_drafter)  # a default that cannot run fails at start-up

    def drafter(self, name: str, stages: tuple[str, ...] | None = None) -> Drafter:
        """The drafter registered as ``name`` (for ``staged``, over ``stages`` or the configured chain);
        drafters share the loaded models. Chains a request names are built here, in the engine thread."""
        return self.drafters.get(name, stages)

    @property
    def description(self) -> EngineDescription:
        """What the serving layer may know of this engine (see ``AsyncEngine.description``)."""
        draft = self.draft
        return EngineDescription(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=frozenset(self.eos_token_ids),
            drafters={
                name: self.drafters.problems.get(name) for name in [*self.drafters.built, *self.drafters.problems]
            },
            default_drafter=self.default_drafter,
            drafter_models={
                name: drafter.own_model for name, drafter in self.drafters.built.items() if drafter.own_model
            },
            num_draft_tokens=self.config.num_draft_tokens,
            adaptive_k=self.config.adaptive_k,
            draft=self.config.draft if draft is not None else None,
            draft_dtype=None if draft is None else dtype_name(draft.dtype),
            device=str(self.target.device),
            dtype=dtype_name(self.target.dtype),
            weight_bytes=self.weight_bytes,
            cache_bytes=self.cache_bytes,
            max_num_seqs=self.config.max_num_seqs,
            prefix_store_bytes=self.store.capacity,
            activations=self.config.activations,
            warm_up=self.warm_up_report,
            system_fingerprint=self.system_fingerprint,
            generation_defaults=generation_defaults(self.target.hf_model, embedded=self.config.target is None),
            default_system=default_system(embedded=self.config.target is None),
        )

    def reset(self) -> None:
        """Forget the bound slot's tokens in every cache (after a failed request, or before another
        scope's request: nothing of one scope's sequence is left for another's)."""
        for holder in self.slots.holders:
            holder.cache.rollback(0)
        self.slots.bound.tenant, self.slots.bound.keep = None, 0

    def admit(self, slot: Slot, tenant: str, prompt: list[int]) -> None:
        """Bind ``slot`` for a new request of ``tenant``. What of its sequence the request would
        overwrite goes to the prefix store first (as far as it may be kept: the prompt and what its
        client received); another scope's leaves nothing behind."""
        self.slots.bind(slot)
        if slot.tenant is not None and self.slots.shared(slot, tenant, prompt) < slot.keep:
            self.store.save(slot.tenant, self.target.cache.token_ids[: slot.keep], positional(self.target))
        if slot.tenant is not None and slot.tenant != tenant:
            self.reset()
        slot.tenant, slot.busy, slot.prompt_len = tenant, True, len(prompt)
        self.slots.touch(slot)

    def remember(self, tenant: str, token_ids: list[int]) -> None:
        """Keep an output that reached its client (only what it received) for the drafters that
        match recent outputs, under its request's scope."""
        self.outputs.add(tenant, token_ids)

    @property
    def max_model_len(self) -> int:
        return self.target.max_len

    @property
    def models(self) -> list[CausalLM]:
        return [self.target] if self.draft is None else [self.target, self.draft]

    @property
    def weight_bytes(self) -> int:
        """Weights of the target and the draft model, if any."""
        return sum(model.weight_bytes for model in self.models)

    @property
    def cache_bytes(self) -> int:
        """One slot's KV caches of the target and the draft model (each slot's allocated on its first use)."""
        return sum(model.cache.nbytes for model in self.models)

    def generate(
        self,
        request: Request,
        should_abort: Callable[[], bool] = lambda: False,
        crowded: Callable[[], bool] = lambda: False,
    ) -> Iterator[StepOutput | None]:
        """Run one request to completion over the bound slot, yielding the tokens of every
        speculative step. While ``crowded()`` (other requests wait for their turn), a long prompt
        is read ``prefill_chunk`` tokens at a time, yielding None after each chunk."""
        params = request.params
        check_fits(self.max_model_len, len(request.prompt_ids), params.max_tokens)
        seq = self._begin(request)  # the slot keeps the longest prefix shared with its last request
        cached = self.target.cache.length
        chunk, cache = self.config.prefill_chunk, self.target.cache
        while params.prompt_logprobs is None and len(seq.token_ids) - 1 - cache.length > chunk and crowded():
            self.target.extend(seq.token_ids[cache.length : cache.length + chunk], num_logits=0)
            yield None
        prompt_logprobs = None
        if params.prompt_logprobs is not None:  # scores the whole prompt again: nothing was reused
            prompt_logprobs, cached = self._prompt_logprobs(seq), 0
        num_draft_tokens = (
            self.config.num_draft_tokens if request.num_draft_tokens is None else request.num_draft_tokens
        )
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        while True:
            if should_abort():
                yield StepOutput([], "abort", seq.prompt_len, cached, seq.stats.copy())
                return
            limit = self._limit(seq, num_draft_tokens)
            result = self.step(seq, seq.policy.choose(limit) if seq.policy is not None else limit)
            new, finish = result.token_ids, None
            for i, token in enumerate(new):
                if token in stop_ids:
                    new, finish = new[: i + 1], "stop"
                    break
            if finish is None and seq.num_generated + len(new) >= params.max_tokens:
                new, finish = new[: params.max_tokens - seq.num_generated], "length"
            seq.token_ids.extend(new)
            seq.sampler.commit(new)
            record = result.record.truncated(len(new))  # count only what the client receives
            seq.stats.record(record)
            self.speeds.add(seq.stats.drafter or "none", record)
            logprobs = None
            if params.logprobs is not None:
                logprobs = self._logprobs(result.target_logits[: len(new)], new, params.logprobs)
            yield StepOutput(new, finish, seq.prompt_len, cached, seq.stats.copy(), record, logprobs, prompt_logprobs)
            prompt_logprobs = None
            if finish is not None:
                return

    @property
    def compilations(self) -> int:
        """How often the models' compiled code (runner variants, kernels) has compiled so far."""
        return sum(model.compilations for model in self.models)

    def _warn_of_recompiles(self) -> None:
        """Compiled code that compiled again after warm-up met a shape warm-up did not prepare: a
        stall while serving, and a step towards dynamo's recompile limit. Say so once per request."""
        if self.compiled is None:
            return
        now = self.compilations
        if now > self.compiled:
            log.warning("%d compilations while serving since warm-up or the last warning", now - self.compiled)
            self.compiled = now

    def _begin(self, request: Request) -> _Sequence:
        self._warn_of_recompiles()
        prompt = list(request.prompt_ids)
        slot = self.slots.bound
        if request.tenant != slot.tenant:  # another scope's tokens: its prefix is not ours to reuse
            self.reset()
            slot.tenant = request.tenant
        shared = self.target.cache.reuse_prefix(prompt)
        stored = self.store.longest(request.tenant, prompt)
        if stored > shared:  # the store holds more of it: copy those blocks in instead of computing them
            start = shared - shared % BLOCK
            self.target.cache.rollback(start)
            self.store.restore(request.tenant, prompt, start, stored, positional(self.target))
            self.target.cache.append(prompt[start:stored])
        name = request.drafter or self.default_drafter
        if name == NO_DRAFTER:  # the request asks for the target alone
            name = None
        drafter = self.drafter(name, request.stages) if name is not None else None
        if drafter is not None:
            drafter.begin(prompt, request.tenant)
        policy = None
        adaptive_k = self.config.adaptive_k if request.adaptive_k is None else request.adaptive_k
        if drafter is not None and adaptive_k:
            policy = AdaptiveK(self._costs.setdefault(name, StepCosts()))  # acceptance starts from the prior
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        constraint = None
        if request.grammar is not None:
            from .grammar import TokenConstraint  # xgrammar loads only when a request brings a grammar

            constraint = TokenConstraint(request.grammar, self.vocab_size)
        sampler = RequestSampler(request.params, self.vocab_size, self.target.device, prompt, seed, constraint)
        return _Sequence(request, prompt, len(prompt), sampler, drafter, policy, SpecStats(drafter=name))

    def _logprobs(self, logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
        """logits [N, V] at the positions that produced ``token_ids`` -> one TokenLogprob each."""
        logprobs = torch.log_softmax(logits[:, : self.vocab_size].float(), dim=-1)  # [N, V]
        chosen = logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
        if top_n > 0:
            values, indices = logprobs.topk(top_n, dim=-1)  # [N, top_n]
            tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
        return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops, strict=True)]

    def _prompt_logprobs(self, seq: _Sequence) -> list[TokenLogprob | None]:
        """Score the whole prompt (no prefix reuse); the cache ends holding all but its last token."""
        prompt = seq.token_ids
        self.target.cache.rollback(0)
        if len(prompt) == 1:
            return [None]
        logits = self.target.extend(prompt[:-1], num_logits=len(prompt) - 1)  # [P-1, V]
        return [None, *self._logprobs(logits, prompt[1:], seq.sampler.params.prompt_logprobs or 0)]

    def _limit(self, seq: _Sequence, num_draft_tokens: int) -> int:
        """Draft no more than the request can still emit (minus the bonus token) or the cache can hold."""
        if seq.drafter is None:
            return 0
        remaining = seq.sampler.params.max_tokens - seq.num_generated
        return max(0, min(num_draft_tokens, remaining - 1, self.max_model_len - len(seq.token_ids)))

    def step(self, seq: _Sequence, num_draft_tokens: int) -> _StepResult:
        """One speculative step: the accepted draft tokens plus one token from the target."""
        tokens, sampler = seq.token_ids, seq.sampler
        started = time.perf_counter()
        # 1. The draft proposes k tokens with the distributions q it drew them from.
        proposal = (
            seq.drafter.propose(tokens, num_draft_tokens, sampler)
            if num_draft_tokens > 0 and seq.drafter is not None
            else Proposal.empty(self.target.device)
        )
        k = proposal.token_ids.shape[0]
        drafted = time.perf_counter()
        # 2. The target scores the pending token(s) and all k drafts in one forward pass. The drafts
        # stay on the device: the verdict below is the step's one transfer to the host.
        scored = self.target.upload(tokens[self.target.cache.length :])  # [P] pending
        scored = torch.cat([scored, proposal.token_ids]) if k else scored  # [P+k]
        logits = self.target.extend(scored, num_logits=k + 1)  # [k+1, V]
        if self.logits_hook is not None:
            logits = self.logits_hook(seq.request, seq.stats.target_forwards, logits)
        # NaN or inf anywhere in the logits poisons all of p, which the sampler then refuses (no extra sync)
        finite = all_finite(logits)  # []
        # 3. Accept a prefix of the drafts, then resample at the first rejection or add a bonus token
        # (at temperature 0, p is one-hot: the same verdict from the target's tokens alone). A seeded
        # request keeps the drafts that equal the target's own draws, each at its position's keyed
        # uniform: its text is the target alone's for that seed, whatever was drafted.
        if sampler.params.greedy:
            target_tokens = sampler.greedy_tokens(logits, proposal.token_ids)  # [k+1]
            verdict = greedy_verdict(proposal.token_ids, target_tokens, finite, proposal.num_proposed)
        elif sampler.params.seed is not None:
            p = sampler.probs(logits, proposal.token_ids)  # [k+1, V]
            usable = finite & (p.sum(-1) > 0).all()  # [] no NaN or inf, and mass in every row
            target_tokens = keyed_tokens(p, sampler.params.seed, sampler.num_output)  # [k+1]
            verdict = greedy_verdict(proposal.token_ids, target_tokens, usable, proposal.num_proposed)
        else:
            p = torch.where(finite, sampler.probs(logits, proposal.token_ids), torch.nan)  # [k+1, V]
            verdict = rejection_sample(proposal.token_ids, proposal.probs, p, sampler.generator, proposal.num_proposed)
        # 4. Both caches roll back to the accepted length.
        n = verdict.num_accepted
        num_committed = len(tokens) + n
        self.target.cache.rollback(num_committed, tokens + verdict.token_ids[:n])
        if seq.drafter is not None:
            seq.drafter.accept(num_committed)
        k = verdict.num_proposed
        by = (proposal.drafter or seq.stats.drafter or "none") if k else "none"
        record = StepRecord(k, n, drafted - started, time.perf_counter() - drafted, num_emitted=n + 1, drafter=by)
        if seq.policy is not None:
            seq.policy.observe(k, n, record.draft_seconds, record.verify_seconds, timed=seq.num_generated > 0)
        return _StepResult(verdict.token_ids, logits[: n + 1], record)
