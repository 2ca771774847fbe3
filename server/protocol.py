"""The OpenAI request and response shapes that specserve speaks.

Requests accept unknown extra fields (clients send many); known fields are validated here and in
``SamplingParams``. Responses are plain models so the OpenAPI schema describes them.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class SpeculativeOptions(BaseModel):
    """specserve's own extra body field: choose the drafter and k for one request."""

    model_config = ConfigDict(extra="forbid")
    drafter: str | None = None
    num_draft_tokens: int | None = Field(default=None, ge=0, le=64)
    adaptive_k: bool | None = None  # None: the server's --adaptive-k (off for seeded requests); true: k is the cap
    stages: list[str] | None = None  # the staged drafter's chain for this request, cheapest first


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # NaN / inf are never valid numbers here

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    speculative: SpeculativeOptions | None = None
    _credential: str = PrivateAttr(default="")  # a digest of the caller's API key, set by the route

    def from_caller(self, authorization: str | None) -> None:
        """Record who sent this: what drafters keep across requests stays within one key and user."""
        self._credential = hashlib.sha256((authorization or "").encode()).hexdigest()[:16] if authorization else ""

    @property
    def tenant(self) -> str:
        return f"{self._credential}/{self.user or ''}"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"] = "text"
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallModel(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallModel] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict:
        """The message as chat templates expect it (tool call arguments as objects)."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return message

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


# ---- responses -------------------------------------------------------------------------------


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
    acceptance_rate: float
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
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
