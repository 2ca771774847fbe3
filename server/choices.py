"""One generation to run (a ``Choice``), and what running it yields: text deltas with their
token pieces, and the usage totals they add up to."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request, StepOutput, TokenLogprob
from engine.sampling import SamplingParams
from engine.stats import SpecStats

from .responses import PromptTokensDetails, SpeculativeUsage, Usage
from .tools import ToolPlan


@dataclass(slots=True)
class TokenPiece:
    """One generated token: the text it released (joined pieces equal the output) and its logprob."""

    text: str
    logprob: TokenLogprob | None


@dataclass(slots=True)
class TextDelta:
    text: str
    pieces: list[TokenPiece] | None = None  # when logprobs were asked for
    finish_reason: str | None = None
    final: StepOutput | None = None  # the engine's last output, on the last delta
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first delta, when asked for
    draft: bool = False  # the text came from a draft token the target accepted

    def speculative(self) -> SpeculativeUsage | None:
        """The choice's speculation counters, on its last delta."""
        return None if self.final is None else SpeculativeUsage(**self.final.stats.to_dict())


@dataclass(slots=True)
class UsageTotals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)

    def add(self, delta: TextDelta, count_prompt: bool) -> None:
        output = delta.final
        if count_prompt:
            self.prompt_tokens += output.prompt_tokens
            self.cached_tokens += output.cached_tokens
        self.completion_tokens += delta.completion_tokens
        self.stats.add(output.stats)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
            speculative=SpeculativeUsage(**self.stats.to_dict()),
        )


@dataclass(slots=True)
class Choice:
    """One generation to run: choices run one after another at batch size 1."""

    index: int
    request: Request  # what the engine runs: prompt, sampling params, drafter options, grammar
    first_of_prompt: bool  # usage counts each prompt once, however many choices it has
    echo: str = ""
    tools: ToolPlan | None = None
    deadline: float | None = None  # time.monotonic() by which the request must be done
    warnings: list[str] = field(default_factory=list)  # told to the client (e.g. tools the template leaves out)

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params
