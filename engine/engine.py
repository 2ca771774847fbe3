"""The speculative engine: one request at a time, batch size 1, caches resident across requests."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from .adaptive import AdaptiveK, StepCosts
from .config import COPY_AUTO, COPY_INT8, COPY_PREFIX, NO_DRAFTER, ConfigError, EngineConfig, check_stages
from .drafters import Drafter, DraftResources, Proposal, available, build
from .measure import agreement, choose_copy, extra_row_seconds, prefill_seconds_per_token, read_seconds
from .model import CausalLM
from .runner import GraphRunner
from .sampling import RequestSampler, SamplingParams
from .spec import rejection_sample
from .stats import DrafterSpeeds, SpecStats, StepRecord

log = logging.getLogger(__name__)

MAX_CHAINS = 16  # staged chains built for requests' own "stages", kept for reuse


class PromptTooLong(ValueError):
    pass


class InjectedFault(RuntimeError):
    """Raised by the fault-injection test hook inside the target's forward pass."""


class EngineKilled(BaseException):
    """The fault-injection hook's way to end the engine thread: it escapes per-request error handling."""


def _raise_fault(logits: torch.Tensor) -> torch.Tensor:
    raise InjectedFault("injected fault in the target's forward pass")


def _kill_engine(logits: torch.Tensor) -> torch.Tensor:
    raise EngineKilled("injected engine death")


FAULTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "raise": _raise_fault,
    "nan": lambda logits: torch.full_like(logits, float("nan")),
    "kill": _kill_engine,
}


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    num_draft_tokens: int | None = None  # None: the engine's default
    drafter: str | None = None  # None: the engine's default drafter; "none": the target alone
    adaptive_k: bool | None = None  # None: the engine's default; True: num_draft_tokens is only the cap
    stages: tuple[str, ...] | None = None  # the staged drafter's chain for this request; None: the engine's
    tenant: str = ""  # who sent it (API key and user): what drafters keep across requests stays within it
    grammar: object | None = None  # an xgrammar CompiledGrammar constraining the output
    fail_at_step: int | None = None  # test hook (EngineConfig.fault_injection): a fault in this step's forward
    fault_kind: str = "raise"  # which of FAULTS


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float  # log-softmax of the target's raw logits, before any sampling transform
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), when N > 0


@dataclass(slots=True)
class StepOutput:
    token_ids: list[int]  # new tokens from this step (at least one unless finished by abort)
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last output
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused from the previous request
    stats: SpecStats = field(default_factory=SpecStats)
    step: StepRecord | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output; the first token has none

    def truncated(self, kept: int) -> StepOutput:
        """This output when only its first ``kept`` tokens reach the client (a stop string ended
        the text inside the step): tokens, logprobs, the step record and the counters all shrink."""
        if kept >= len(self.token_ids) or self.step is None:
            return self
        step = self.step.truncated(kept)
        stats = self.stats.copy()
        stats.retract(self.step)
        stats.record(step)
        logprobs = None if self.logprobs is None else self.logprobs[:kept]
        return replace(
            self, token_ids=self.token_ids[:kept], finish_reason="stop", stats=stats, step=step, logprobs=logprobs
        )


@dataclass(frozen=True, slots=True)
class _StepResult:
    token_ids: list[int]
    target_logits: torch.Tensor  # [len(token_ids), V] the rows each token was verified or sampled from
    record: StepRecord


@dataclass(slots=True)
class _Sequence:
    token_ids: list[int]  # prompt plus committed output
    prompt_len: int
    sampler: RequestSampler
    drafter: Drafter | None
    policy: AdaptiveK | None  # None: draft a fixed number of tokens
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass(frozen=True, slots=True)
class WarmUp:
    forward: str  # eager, cuda-graphs or compile
    variants: int  # captured graphs
    seconds: float
    graph_bytes: int  # device memory the captures reserved
    matmuls: str = ""  # eager CPU: what the measured MatmulPlans chose, per model
    kernels: str = ""  # how the pointwise kernels run, where they were compiled (or failed to be)
    attention: str = ""  # the windows whose attention runs split (runner.choose_attention), per model

    def describe(self) -> str:
        kernels = "".join(f"; {part}" for part in (self.kernels, self.attention) if part)
        if self.forward == "cuda-graphs":
            captured = f"{self.variants} captured in {self.seconds:.1f} s, {self.graph_bytes / 2**20:,.0f} MiB"
            return f"CUDA graphs: {captured}{kernels}"
        if self.forward == "compile":
            return f"torch.compile: {self.variants} variants compiled in {self.seconds:.1f} s{kernels}"
        chosen = f" (matmuls measured: {self.matmuls})" if self.matmuls else ""
        return f"forward {self.forward}{chosen}, warmed up in {self.seconds:.1f} s{kernels}"


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
        self.draft_agreement = draft_agreement
        self.target = target
        self.draft = draft
        self.eos_token_ids = eos_token_ids
        # Requests without a seed draw one from here: reproducible runs under --seed, fresh ones otherwise.
        self._seeds = torch.Generator()
        self._seeds.manual_seed(config.seed) if config.seed is not None else self._seeds.seed()
        # Sampling runs over the ids both models share and the tokenizer can decode, in every mode.
        sizes = [model.vocab_size for model in (target, draft) if model is not None]
        self.vocab_size = min(sizes + ([tokenizer_size] if tokenizer_size else []))
        self._resources = DraftResources(config=config, target=target, draft=draft)
        self._drafters: dict[str, Drafter] = {}
        self._chains: OrderedDict[tuple[str, ...], Drafter] = (
            OrderedDict()
        )  # per-request staged chains, recent first out
        self._costs: dict[str, StepCosts] = {}  # what each drafter's steps cost here, learned across requests
        # Every registered drafter is built now; what cannot run here (no draft model, no heads) is
        # remembered with its reason, so requests can still pick any of the others.
        self.drafter_problems: dict[str, str] = {}
        for name in available():
            try:
                self._drafters[name] = build(name, self._resources)
            except ConfigError as exc:
                self.drafter_problems[name] = str(exc)
        self.warm_up_report: WarmUp | None = None
        self._compilations: int | None = None  # compiled variants and kernels as of warm-up (then as last seen)
        self.speeds = DrafterSpeeds()  # measured tokens/s by drafter, for /v1/models and the chat page
        # NO_DRAFTER, or with no draft model the default "model" drafter, means the target alone.
        target_alone = config.drafter == NO_DRAFTER or (draft is None and config.drafter == "model")
        self.default_drafter = None if target_alone else config.drafter
        if self.default_drafter is not None:
            self.drafter(self.default_drafter)  # a default that cannot run fails at start-up

    @property
    def runnable_drafters(self) -> list[str]:
        """The drafters a request may ask for here, besides "none" (the target alone)."""
        return sorted(self._drafters.keys() - self.drafter_problems.keys())

    def check_drafter(self, name: str, stages: tuple[str, ...] | None = None) -> None:
        """Raise a ConfigError, naming ``name`` and what can run instead, unless a request may use it.
        Builds nothing, so the serving thread may call it while the engine runs."""
        runnable = ", ".join([*self.runnable_drafters, "none"])
        if name not in available():
            raise ConfigError(f"unknown drafter {name!r}; drafters that can run here: {runnable}")
        if stages is not None:
            try:
                check_stages(stages)
            except ConfigError as exc:
                raise ConfigError(f"drafter {name!r}: {exc}") from None
            problems = [
                f"{stage!r}: {self.drafter_problems[stage]}" for stage in stages if stage in self.drafter_problems
            ]
            if problems:
                raise ConfigError(f"drafter {name!r} with stages {','.join(stages)} cannot run here: {problems[0]}")
        elif name in self.drafter_problems:
            raise ConfigError(
                f"drafter {name!r} cannot run here: {self.drafter_problems[name]}; drafters that can run here: {runnable}"
            )

    def drafter(self, name: str, stages: tuple[str, ...] | None = None) -> Drafter:
        """The drafter registered as ``name`` (for ``staged``, over ``stages`` or the configured chain);
        drafters share the loaded models. Chains a request names are built here, in the engine thread."""
        self.check_drafter(name, stages)
        if stages is None:
            return self._drafters[name]
        if stages not in self._chains:
            self._chains[stages] = build(name, replace(self._resources, config=replace(self.config, stages=stages)))
            if len(self._chains) > MAX_CHAINS:  # requests choose chains: keep a bounded few
                self._chains.popitem(last=False)
        self._chains.move_to_end(stages)
        return self._chains[stages]

    def warm_up(self) -> WarmUp:
        """Run every decode shape before the first request. CUDA graphs are captured here; eager
        kernels pay their first-call costs here instead of in the first request, whose step costs
        the auto drafter learns from. Compiled forwards (the CPU proof) compile here, every variant once."""
        started = time.perf_counter()
        device = self.target.device
        reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        kernels = self.compile_kernels(required=self.config.kernels == "compiled")  # before any capture
        max_query = self.config.num_draft_tokens + 2
        variants = 0
        matmuls, attention = [], []
        self_drafter = self._drafters.get("self")
        for model in self.models:
            role = "target" if model is self.target else "draft"
            layer_sets = [model.all_layers]
            if model is self.target and self_drafter is not None:
                layer_sets.append(self_drafter.layers)
            if model.runner is None:
                if model.device.type == "cpu":
                    model.plan_matmuls(min(max_query, model.max_len))
                    matmuls.append(f"{role} {model.describe_products()}")
                for num_tokens in range(1, min(max_query, model.max_len) + 1):
                    model.cache.rollback(0)
                    model.extend([0] * num_tokens, num_logits=num_tokens)
            else:
                try:
                    model.runner.warm_up(layer_sets)
                except Exception as error:  # whatever capturing or compiling raised: say what to turn off
                    hint = (
                        "--kernels eager, or --enforce-eager" if model.kernels.mode == "compiled" else "--enforce-eager"
                    )
                    raise ConfigError(
                        f"preparing the {self.config.forward_mode} forwards failed ({_root_cause(error)}); try {hint}"
                    ) from error
                variants += model.runner.num_variants
                split = model.runner.describe_attention()
                if split:
                    attention.append(f"{role} {split}")
            model.cache.rollback(0)
        auto = self._drafters.get("auto")
        if auto is not None:
            # a forward over k + 1 tokens, k = 0..K, best of two each, fitted by a line: single
            # readings scatter by 10-15% here, and a high one would keep its k from ever being tried
            timed = [read_seconds(self.target, k + 1, repeats=2) for k in range(max_query - 1)]
            verify = dict(enumerate(_fitted_line(timed)))
            draft_step = None
            if self.draft is not None:
                draft_step = read_seconds(self.draft, 1, repeats=3)
                if not self.config.draft_reads_target_kv:  # one reading the target's cache has no catch-up
                    auto.expect_catch_up(
                        prefill_seconds_per_token(self.draft), extra_row_seconds(self.draft, max_query, draft_step)
                    )
                if self.draft_agreement is None:
                    self.draft_agreement = agreement(self.draft, self.target)
                auto.expect_agreement(self.draft_agreement)
            auto.expect_step_costs(verify, draft_step)
        graph_bytes = torch.cuda.memory_reserved(device) - reserved if device.type == "cuda" else 0
        seconds = time.perf_counter() - started
        self._compilations = self.compilations
        self.warm_up_report = WarmUp(
            self.config.forward_mode, variants, seconds, graph_bytes, "; ".join(matmuls), kernels, "; ".join(attention)
        )
        return self.warm_up_report

    def compile_kernels(self, required: bool) -> str:
        """Compile each model's pointwise kernels, where they are compiled, and say how it went.
        Where compiling fails (no C compiler for inductor's code, say), every model runs eager
        kernels instead, unless ``required``: then the failure is a ConfigError."""
        compiled = [model for model in self.models if model.kernels.mode == "compiled"]
        if not compiled:
            return ""
        started = time.perf_counter()
        try:
            for model in compiled:
                model.warm_up_kernels()
        except Exception as error:  # whatever torch.compile or its backend raised
            reason = _root_cause(error)
            if required:
                raise ConfigError(f"compiling the pointwise kernels failed ({reason}); use --kernels eager") from error
            for model in compiled:
                model.use_kernels("eager")
            log.warning("compiling the pointwise kernels failed (%s); they run eagerly (slower on a GPU)", reason)
            return f"pointwise kernels eager: compiling them failed ({reason})"
        count = sum(sum(model.kernels.compilations.values()) for model in compiled)
        return f"pointwise kernels compiled: {count} compilations in {time.perf_counter() - started:.1f} s"

    def reset(self) -> None:
        """Forget all cached tokens (after a failed request, the caches' contents are not trusted)."""
        self.target.cache.rollback(0)
        if self.draft is not None:
            self.draft.cache.rollback(0)

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
        """KV caches of the target and the draft model, allocated once at start-up."""
        return sum(model.cache.nbytes for model in self.models)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens < 1:
            raise PromptTooLong("the prompt is empty")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise PromptTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{num_prompt_tokens} prompt tokens plus {max_tokens} new tokens"
            )

    def generate(self, request: Request, should_abort: Callable[[], bool] = lambda: False) -> Iterator[StepOutput]:
        """Run one request to completion, yielding the tokens of every speculative step."""
        params = request.params
        self.check_fits(len(request.prompt_ids), params.max_tokens)
        seq = self._begin(request)  # the caches keep the longest prefix shared with the last request
        cached = self.target.cache.length
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
            if request.fail_at_step is not None and seq.stats.target_forwards == request.fail_at_step:
                self.target.fault = FAULTS[request.fault_kind]
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
        if self._compilations is None:
            return
        now = self.compilations
        if now > self._compilations:
            log.warning("%d compilations while serving since warm-up or the last warning", now - self._compilations)
            self._compilations = now

    def _begin(self, request: Request) -> _Sequence:
        self._warn_of_recompiles()
        prompt = list(request.prompt_ids)
        self.target.cache.reuse_prefix(prompt)
        name = request.drafter or self.default_drafter
        if name == NO_DRAFTER:  # the request asks for the target alone
            name = None
        if name == "auto" and request.drafter is None and request.params.seed is not None:
            name = self.drafter("auto").fixed_choice  # a seeded request must repeat: no timing-driven choices
        drafter = self.drafter(name, request.stages) if name is not None else None
        if drafter is not None:
            drafter.begin(prompt, request.tenant)
        policy = None
        adaptive_k = request.adaptive_k
        if adaptive_k is None:  # k decides how many random draws a step takes: a seed needs a fixed k to repeat
            adaptive_k = self.config.adaptive_k and request.params.seed is None
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
        return _Sequence(prompt, len(prompt), sampler, drafter, policy, SpecStats(drafter=name))

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
        pending = self.target.upload(tokens[self.target.cache.length :])  # [P]
        logits = self.target.extend(torch.cat([pending, proposal.token_ids]), num_logits=k + 1)  # [k+1, V]
        # NaN or inf anywhere in the logits poisons all of p, which the sampler then refuses (no extra
        # sync). isfinite, not a sum: summing 49k half-precision logits overflows to inf on its own.
        p = sampler.probs(logits, proposal.token_ids)  # [k+1, V]
        p = torch.where(torch.isfinite(logits).all(), p, torch.nan)
        # 3. Accept a prefix of the drafts, then resample at the first rejection or add a bonus token.
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


def _fitted_line(values: list[float]) -> list[float]:
    """The least-squares line through ``values`` (at x = 0, 1, ...), its slope at least 0."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    spread = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / spread if spread else 0.0
    slope = max(slope, 0.0)
    return [mean_y + slope * (x - mean_x) for x in range(n)]


def _root_cause(error: BaseException) -> str:
    """The innermost error under dynamo's wrapping, as "Type: first line of its message"."""
    while getattr(error, "inner_exception", None) or error.__cause__:
        error = getattr(error, "inner_exception", None) or error.__cause__
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def build_engine(
    config: EngineConfig,
    target_model: torch.nn.Module,
    draft_model: torch.nn.Module | None,
    eos_token_ids: set[int],
    tokenizer_size: int | None = None,
) -> SpecEngine:
    """Wrap loaded Hugging Face models: caches are sized once, here, and reused for every request.
    The engine owns them from now on: on CPU its warm-up may hold their weights in another form and
    free the modules' own (``CausalLM.use_plan``), so they are not for calling elsewhere after."""
    limit = getattr(target_model.config, "max_position_embeddings", 4096)
    max_len = config.max_model_len or min(limit, 4096)
    target = CausalLM(target_model, max_len)
    draft = CausalLM(draft_model, max_len) if draft_model is not None else None
    measured_agreement = None
    if draft is not None and config.draft_copy == COPY_INT8:
        draft.quantize_int8()
    elif draft is not None and config.draft_copy == COPY_AUTO:  # measured here: bfloat16 or int8 rows
        draft, form, measured_agreement = choose_copy(target, draft, config.num_draft_tokens)
        config = replace(config, draft=COPY_PREFIX + form)
    for model in filter(None, (target, draft)):
        model.use_kernels(config.kernel_mode, config.compile_backend)
    mode = config.forward_mode
    if mode != "eager":  # decode-shaped forwards: up to k drafts, a pending token, and a bonus row
        for model in filter(None, (target, draft)):
            model.runner = GraphRunner(model, mode, config.num_draft_tokens + 2, config.compile_backend)
    return SpecEngine(config, target, draft, eos_token_ids, tokenizer_size, measured_agreement)
