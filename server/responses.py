"""The OpenAI response shapes that specserve sends: plain models, so the OpenAPI schema describes them."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from .protocol import ToolCallModel


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class SpeculativeUsage(BaseModel):
    drafter: str | None  # None: the target alone
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None = None  # null when nothing was drafted
    target_forwards: int
    mean_tokens_per_forward: float
    mean_num_draft_tokens: float  # k per step, as chosen (fixed, adaptive, or cut short by the drafter)
    accepted_per_position: list[int]
    draft_seconds: float
    verify_seconds: float
    steps_by_drafter: dict[str, int] = Field(default_factory=dict)  # who drafted each step (auto picks per step)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculative: SpeculativeUsage | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None  # what decides the bits: a seeded request repeats where it matches
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    # specserve's extension: the speculation counters of the choice that finishes in this chunk (null on
    # every other chunk). Token counts travel only in ``usage`` on the last chunk, with include_usage.
    speculative: SpeculativeUsage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallModel] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None  # as in CompletionResponse
    choices: list[ChatChoice]
    usage: Usage
    warnings: list[str] | None = None  # specserve's extension: what the server could not do as asked


class ToolCallDelta(ToolCallModel):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    speculative_draft: bool | None = None  # specserve's extension: true when this text was an accepted draft token

    @model_serializer(mode="wrap")
    def _only_present(self, handler):  # the first delta carries the role, later ones only content
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None  # as in CompletionResponse
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the last chunk (choices: []), when stream_options.include_usage
    speculative: SpeculativeUsage | None = None  # as in CompletionChunk: on the chunk that finishes a choice
    warnings: list[str] | None = None  # as in ChatCompletionResponse: on the first chunk only


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    # specserve's extension: what "speculative": {"drafter": ...} may name now ("none" is the target alone)
    drafters: list[str] = Field(default_factory=list)
    default_drafter: str = "none"
    # decode tokens/s by drafter, measured on this server since it started (drafters used for 32+ tokens)
    drafter_tokens_per_s: dict[str, float] = Field(default_factory=dict)
    # the draft model loaded: a ref, or the copy of the target it is ("copy:int8" where copy:auto chose it); None: none
    draft: str | None = None
    # models drafters run of their own, by drafter: {"eagle3": "EAGLE-3 head ... (9.8M params, ...)"}
    drafter_models: dict[str, str] = Field(default_factory=dict)
    # what the target's products multiply on CPU: "int8" (a GGUF target's blocks as llama.cpp computes
    # them, --activations) or "float32" (exact to the file's dequantized weights)
    activations: str = "float32"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, whatever its status: {"error": {message, type, param, code}}."""

    error: ErrorDetail


# What the generation routes document in the OpenAPI schema besides their JSON 200 body.
GENERATION_RESPONSES: dict = {
    200: {
        "description": "the JSON response, or with stream=true server-sent events: each event's data is one "
        "JSON chunk (or an error object), and the last is [DONE]",
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                    "required": ["data"],
                }
            }
        },
    },
    **{
        status: {"model": ErrorResponse, "description": description}
        for status, description in {
            400: "invalid request",
            401: "missing or wrong API key",
            404: "unknown model",
            429: "queue full (see Retry-After)",
            500: "the engine failed on this request",
            503: "loading, shutting down, or engine dead",
            504: "request timeout",
        }.items()
    },
}
