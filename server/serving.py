"""From OpenAI requests to engine requests, and from engine outputs to OpenAI responses."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.async_engine import AsyncEngine, EngineDead
from engine.engine import PromptTooLong, Request, StepOutput
from engine.sampling import SamplingError, SamplingParams

from .detokenizer import TextStream
from .errors import BadRequest, EngineUnavailable, ModelNotFound
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    SpeculativeUsage,
    Usage,
    _Request,
    new_id,
    now,
)


@dataclass(slots=True)
class TextDelta:
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None  # set on the last delta


def usage_of(output: StepOutput, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=output.prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.cached_tokens),
        speculative=SpeculativeUsage(**output.stats.to_dict()),
    )


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = engine.engine.vocab_size

    # ---- request -> engine --------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name:
            raise ModelNotFound(f"the model '{name}' does not exist; this server serves '{self.model_name}'", "model")

    def _sampling_params(self, body: _Request, max_tokens: int) -> SamplingParams:
        if body.n != 1:
            raise BadRequest("n > 1 is not supported yet", "n")
        if body.stream_options is not None and not body.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        logit_bias: dict[int, float] = {}
        for key, bias in (body.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < self.vocab_size:
                raise BadRequest(f"logit_bias key {key!r} is not a token id in [0, {self.vocab_size})", "logit_bias")
            logit_bias[int(key)] = bias
        values = {
            "max_tokens": max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty,
            "seed": body.seed,
        }
        try:
            return SamplingParams(
                **{key: value for key, value in values.items() if value is not None},
                logit_bias=logit_bias,
                stop=stop,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
            )
        except SamplingError as exc:
            raise BadRequest(str(exc), exc.param) from exc

    def _check_fits(self, prompt_ids: list[int], max_tokens: int, param: str) -> None:
        try:
            self.engine.engine.check_fits(len(prompt_ids), max_tokens)
        except PromptTooLong as exc:
            raise BadRequest(str(exc), param, code="context_length_exceeded") from exc

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise BadRequest("a list of several prompts is not supported yet; send one prompt", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        if any(not 0 <= token < self.vocab_size for token in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        return list(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # ---- engine -> text -----------------------------------------------------------------------

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TextDelta]:
        """Run one request and yield text as it becomes safe to send; the last delta has the usage."""
        text = TextStream(self.tokenizer, prompt_ids, params.stop)
        completion_tokens = 0
        request = Request(uuid.uuid4().hex, prompt_ids, params)
        try:
            outputs = self.engine.generate(request)
            async for output in outputs:
                completion_tokens += len(output.token_ids)
                piece = text.push(output.token_ids)
                finish = "stop" if text.stopped else output.finish_reason
                if finish is not None:
                    piece += text.finish()
                    yield TextDelta(piece, finish, usage_of(output, completion_tokens))
                    return
                if piece:
                    yield TextDelta(piece)
        except EngineDead as exc:
            raise EngineUnavailable(str(exc)) from exc
        finally:
            await outputs.aclose()  # leaving early (stop string, disconnect) aborts the request

    # ---- /v1/completions ------------------------------------------------------------------------

    def prepare_completion(self, body: CompletionRequest) -> tuple[list[int], SamplingParams]:
        self.check_model(body.model)
        prompt_ids = self.completion_prompt(body)
        params = self._sampling_params(body, body.max_tokens or 16)
        self._check_fits(prompt_ids, params.max_tokens, "max_tokens")
        return prompt_ids, params

    async def completion(self, body: CompletionRequest) -> CompletionResponse:
        prompt_ids, params = self.prepare_completion(body)
        parts: list[str] = [self._echo(body, prompt_ids)]
        async for delta in self._generate(prompt_ids, params):
            parts.append(delta.text)
        return CompletionResponse(
            id=new_id("cmpl"),
            created=now(),
            model=self.model_name,
            choices=[CompletionChoice(index=0, text="".join(parts), finish_reason=delta.finish_reason)],
            usage=delta.usage,
        )

    async def completion_stream(self, body: CompletionRequest) -> AsyncIterator[CompletionResponse]:
        prompt_ids, params = self.prepare_completion(body)
        return self._completion_chunks(body, prompt_ids, params)

    async def _completion_chunks(self, body, prompt_ids, params) -> AsyncIterator[CompletionResponse]:
        request_id, created = new_id("cmpl"), now()

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        if body.echo:
            yield chunk([CompletionChoice(index=0, text=self._echo(body, prompt_ids))])
        async for delta in self._generate(prompt_ids, params):
            yield chunk([CompletionChoice(index=0, text=delta.text, finish_reason=delta.finish_reason)], delta.usage)
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], delta.usage)

    def _echo(self, body: CompletionRequest, prompt_ids: list[int]) -> str:
        if not body.echo:
            return ""
        return body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(prompt_ids)

    # ---- /v1/chat/completions -------------------------------------------------------------------

    def prepare_chat(self, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        self.check_model(body.model)
        prompt_ids = self.chat_prompt(body)
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = requested or max(1, self.engine.engine.max_model_len - len(prompt_ids))
        params = self._sampling_params(body, max_tokens)
        self._check_fits(prompt_ids, params.max_tokens, "max_completion_tokens" if requested else "messages")
        return prompt_ids, params

    async def chat(self, body: ChatCompletionRequest) -> ChatCompletionResponse:
        prompt_ids, params = self.prepare_chat(body)
        parts: list[str] = []
        async for delta in self._generate(prompt_ids, params):
            parts.append(delta.text)
        return ChatCompletionResponse(
            id=new_id("chatcmpl"),
            created=now(),
            model=self.model_name,
            choices=[
                ChatChoice(
                    index=0, message=ChatResponseMessage(content="".join(parts)), finish_reason=delta.finish_reason
                )
            ],
            usage=delta.usage,
        )

    async def chat_stream(self, body: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        prompt_ids, params = self.prepare_chat(body)
        return self._chat_chunks(body, prompt_ids, params)

    async def _chat_chunks(self, body, prompt_ids, params) -> AsyncIterator[ChatCompletionChunk]:
        request_id, created = new_id("chatcmpl"), now()

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        yield chunk([ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))])
        async for delta in self._generate(prompt_ids, params):
            content = delta.text or None
            yield chunk(
                [ChatChunkChoice(index=0, delta=ChatDelta(content=content), finish_reason=delta.finish_reason)],
                delta.usage,
            )
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], delta.usage)
