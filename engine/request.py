"""What a request asks of the engine, what the engine hands back per step, and how the engine
describes itself to its clients."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .sampling import SamplingParams
from .stats import SpecStats, StepRecord


class PromptTooLong(ValueError):
    pass


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    num_draft_tokens: int | None = None  # None: the engine's default
    drafter: str | None = None  # None: the engine's default drafter; "none": the target alone
    adaptive_k: bool | None = None  # None: the engine's default; True: num_draft_tokens is only the cap
    stages: tuple[str, ...] | None = None  # the staged drafter's chain for this request; None: the engine's
    # the scope it may share cross-request state within (the KV prefix, recent outputs): the API
    # key's tenant, user and cache_salt, as the server issues it (server/tenants.py)
    tenant: str = ""
    grammar: object | None = None  # an xgrammar CompiledGrammar constraining the output


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
class EngineDescription:
    """What the serving layer may know of a running engine, fixed at start-up."""

    vocab_size: int  # ids requests may use: both models and the tokenizer know them
    max_model_len: int
    eos_token_ids: frozenset[int]
    drafters: dict[str, str | None]  # every registered drafter -> None if it can run here, else why not
    default_drafter: str | None  # None: the target alone unless a request asks
    num_draft_tokens: int
    adaptive_k: bool
    draft: str | None  # the draft model's ref ("copy:bfloat16", a folder, ...); None: no draft model
    draft_dtype: str | None
    device: str
    dtype: str
    weight_bytes: int
    cache_bytes: int  # one slot's KV caches
    warm_up: str  # how the forwards were prepared at start-up (empty if they were not)
    system_fingerprint: str = ""  # a digest of what decides the logits' bits ("": not computed)
    max_num_seqs: int = 1
    prefix_store_bytes: int = 0
    activations: str = "float32"  # what a GGUF target's block products multiply (ACTIVATIONS, once decided)
    # models drafters run of their own (an EAGLE-3 head), described, by drafter name
    drafter_models: dict[str, str] = field(default_factory=dict)
    # request defaults the model's generation config sets, by request field ("temperature", "max_tokens", ...)
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    # the system message a chat request that sends none is given (None: the chat template's own)
    default_system: str | None = None

    @property
    def runnable_drafters(self) -> list[str]:
        """The drafters a request may ask for, besides "none" (the target alone)."""
        return sorted(name for name, problem in self.drafters.items() if problem is None)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        check_fits(self.max_model_len, num_prompt_tokens, max_tokens)


def check_fits(max_model_len: int, num_prompt_tokens: int, max_tokens: int) -> None:
    """Raise PromptTooLong unless a prompt and ``max_tokens`` new tokens fit the context."""
    if num_prompt_tokens < 1:
        raise PromptTooLong("the prompt is empty")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLong(
            f"this model's maximum context length is {max_model_len} tokens; the request asks for "
            f"{num_prompt_tokens} prompt tokens plus {max_tokens} new tokens"
        )
