"""/v1/chat/completions: chat templates, logprobs, response_format, tools, streaming."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .choices import Choice, TokenPiece, UsageTotals
from .errors import BadRequest
from .protocol import ChatCompletionRequest, ResponseFormat
from .responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ToolCallDelta,
    TopLogprob,
    new_id,
    now,
)
from .serving import ServingCore
from .tools import ToolCallStream, parse_tool_calls, plan_tools

if TYPE_CHECKING:  # xgrammar (13 MB) loads when a request first brings a response_format
    from engine.grammar import GrammarCompiler

log = logging.getLogger(__name__)


TOOLS_IGNORED = "this model's chat template leaves tools out of the prompt: the model does not see them"
TOOL_CALLS_IGNORED = (
    "this model's chat template leaves assistant tool_calls out of the prompt: the model does not see the calls"
)


class ChatServing:
    """/v1/chat/completions over the serving core: ``create`` and ``stream``."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self._grammars: GrammarCompiler | None = None  # built on first use: it indexes the whole vocabulary
        self._logged: set[str] = set()  # each template warning goes to the log once per server

    def chat_prompt(self, body: ChatCompletionRequest, tools: list[dict] | None) -> tuple[list[int], list[str]]:
        """The prompt's token ids, and warnings for the client (tools the chat template leaves out)."""
        if not self.core.tokenizer.chat_template:
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        messages = self.core.template_messages(body.messages)
        without_calls = [{k: v for k, v in message.items() if k != "tool_calls"} for message in messages]
        render = self.core.tokenizer.apply_chat_template
        try:
            text = render(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            # what the template drops renders the same without it: the client is told
            dropped = {
                TOOLS_IGNORED: tools and text == render(messages, add_generation_prompt=True, tokenize=False),
                TOOL_CALLS_IGNORED: without_calls != messages
                and text == render(without_calls, tools=tools, add_generation_prompt=True, tokenize=False),
            }
        except Exception as exc:  # templates raise their own errors (e.g. roles out of order)
            raise BadRequest(f"the chat template rejected these messages: {exc}", "messages") from exc
        warnings = [warning for warning, found in dropped.items() if found]
        for warning in warnings:
            if warning not in self._logged:
                self._logged.add(warning)
                log.warning("%s (logged once)", warning)
        return self.core.tokenizer(text, add_special_tokens=False).input_ids, warnings

    def prepare_chat(self, body: ChatCompletionRequest) -> list[Choice]:
        self.core.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs requires logprobs: true", "top_logprobs")
        tools = plan_tools(body)
        prompt_ids, warnings = self.chat_prompt(body, tools.tools)
        requested = body.max_completion_tokens or body.max_tokens
        room = max(1, self.core.description.max_model_len - len(prompt_ids))  # to the end of the context
        max_tokens = requested or min(self.core.defaults.get("max_tokens", room), room)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.core.sampling_params(body, max_tokens, logprobs)
        # where only the length does not fit, the 400 names the length field the client used
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        self.core.check_fits(prompt_ids, params.max_tokens, param, "messages")
        choices = self.core.choices(body, [prompt_ids], params, [""])
        if tools.forced_schema is not None:
            grammar = self._grammar(ResponseFormat(type="json_schema", json_schema={"schema": tools.forced_schema}))
        else:
            grammar = self._grammar(body.response_format)
        for choice in choices:
            choice.request.grammar, choice.tools, choice.warnings = grammar, tools, warnings
        return choices

    def _grammar(self, response_format: ResponseFormat | None) -> object | None:
        if response_format is None or response_format.type == "text":
            return None
        from engine.grammar import GrammarCompiler, GrammarError

        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.core.tokenizer, self.core.vocab_size, self.core.description.eos_token_ids
            )
        if response_format.type == "json_object":
            return self._grammars.json_object()
        if response_format.json_schema is None:
            raise BadRequest("response_format json_schema needs a json_schema object", "response_format.json_schema")
        try:
            return self._grammars.json_schema(response_format.json_schema.schema_)
        except GrammarError as exc:
            raise BadRequest(str(exc), "response_format.json_schema") from exc

    def _chat_logprobs(self, pieces: list[TokenPiece] | None) -> ChatLogprobs | None:
        if pieces is None:
            return None
        content = []
        for piece in pieces:
            top = [
                TopLogprob(token=self.core.token_text(t), logprob=lp, bytes=list(self.core.token_bytes(t)))
                for t, lp in piece.logprob.top
            ]
            content.append(
                ChatTokenLogprob(
                    token=piece.text, logprob=piece.logprob.logprob, bytes=list(piece.text.encode()), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)

    async def create(self, body: ChatCompletionRequest) -> ChatCompletionResponse:
        choices, totals = [], UsageTotals()
        prepared = self.prepare_chat(body)
        for choice in prepared:
            parts, pieces = [], []
            async for delta in self.core.generate(choice, "chat"):
                parts.append(delta.text)
                pieces.extend(delta.pieces or [])
            totals.add(delta, choice.first_of_prompt)
            logprobs = self._chat_logprobs(pieces if choice.params.logprobs is not None else None)
            content, calls, finish = "".join(parts), [], delta.finish_reason
            if choice.tools is not None and choice.tools.parse:
                content, calls = parse_tool_calls(content, choice.tools.names)
                finish = "tool_calls" if calls else finish
            message = ChatResponseMessage(content=content, tool_calls=[call.to_openai() for call in calls] or None)
            choices.append(ChatChoice(index=choice.index, message=message, logprobs=logprobs, finish_reason=finish))
        return ChatCompletionResponse(
            id=new_id("chatcmpl"),
            created=now(),
            model=self.core.model_name,
            system_fingerprint=self.core.fingerprint,
            choices=choices,
            usage=totals.usage(),
            warnings=prepared[0].warnings or None,
        )

    async def stream(self, body: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        return self._chat_chunks(body, self.prepare_chat(body))

    async def _chat_chunks(
        self, body: ChatCompletionRequest, choices: list[Choice]
    ) -> AsyncIterator[ChatCompletionChunk]:
        chunk, totals = self.core.stream_chunks(ChatCompletionChunk, "chatcmpl"), UsageTotals()

        for choice in choices:
            first = chunk([ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))])
            first.warnings = (choice is choices[0] and choice.warnings) or None
            yield first
            tool_stream = ToolCallStream(choice.tools.names) if choice.tools and choice.tools.parse else None
            async for delta in self.core.generate(choice, "chat"):
                text, calls, finish = delta.text, [], delta.finish_reason
                if tool_stream is not None:
                    text = tool_stream.push(text)
                    if finish is not None:
                        rest, calls = tool_stream.finish()
                        text += rest
                        finish = "tool_calls" if calls else finish
                if delta.final is not None:
                    totals.add(delta, choice.first_of_prompt)
                tool_deltas = [ToolCallDelta(index=i, **call.to_openai()) for i, call in enumerate(calls)] or None
                if not text and tool_deltas is None and finish is None and delta.pieces is None:
                    continue  # text held back while a tool call may be forming: no empty delta
                chunk_choice = ChatChunkChoice(
                    index=choice.index,
                    delta=ChatDelta(
                        content=text or None,
                        tool_calls=tool_deltas,
                        speculative_draft=(delta.draft and bool(text)) or None,
                    ),
                    logprobs=self._chat_logprobs(delta.pieces),
                    finish_reason=finish,
                )
                yield chunk([chunk_choice], speculative=delta.speculative())
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=totals.usage())
