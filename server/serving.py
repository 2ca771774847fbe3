"""From OpenAI requests to engine requests, and from engine outputs to OpenAI responses."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from transformers import PreTrainedTokenizerBase

from engine.async_engine import AsyncEngine, EngineDead
from engine.config import ConfigError
from engine.engine import PromptTooLong, Request, StepOutput, TokenLogprob
from engine.grammar import GrammarCompiler, GrammarError
from engine.sampling import SamplingError, SamplingParams
from engine.stats import SpecStats

from .detokenizer import IncrementalDetokenizer, TextStream
from .errors import BadRequest, EngineUnavailable, InternalError, ModelNotFound, OpenAIError
from .metrics import Metrics
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    PromptTokensDetails,
    ResponseFormat,
    SpeculativeUsage,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallDelta,
    TopLogprob,
    Usage,
    _Request,
    new_id,
    now,
)
from .tools import ToolCallStream, ToolPlan, parse_tool_calls, plan_tools

MAX_STOP_STRINGS = 4
MAX_N = 16
MAX_PROMPTS = 64


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
    prompt_ids: list[int]
    params: SamplingParams
    first_of_prompt: bool  # usage counts each prompt once, however many choices it has
    echo: str = ""
    grammar: object | None = None  # a compiled grammar the output must follow
    tools: ToolPlan | None = None
    fail_at_step: int | None = None  # the fault-injection test hook, when the server enables it
    drafter: str | None = None  # None: the server's default
    num_draft_tokens: int | None = None


class OpenAIServing:
    def __init__(
        self, engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, model_name: str, metrics: Metrics
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.vocab_size = engine.engine.vocab_size
        self._grammars: GrammarCompiler | None = None  # built on first use: it indexes the whole vocabulary

    # ---- request -> engine --------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name:
            raise ModelNotFound(f"the model '{name}' does not exist; this server serves '{self.model_name}'", "model")

    def _sampling_params(self, body: _Request, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if body.stream_options is not None and not body.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        if body.n > MAX_N:
            raise BadRequest(f"n must be at most {MAX_N}", "n")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        logit_bias: dict[int, float] = {}
        for key, bias in (body.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < self.vocab_size:
                raise BadRequest(f"logit_bias key {key!r} is not a token id in [0, {self.vocab_size})", "logit_bias")
            logit_bias[int(key)] = bias
        values = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty,
        }
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                **{key: value for key, value in values.items() if value is not None},
                seed=body.seed,
                logit_bias=logit_bias,
                stop=stop,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
        except SamplingError as exc:
            raise BadRequest(str(exc), exc.param) from exc

    def _speculation(self, body: _Request) -> tuple[str | None, int | None]:
        """The request's own drafter and k (extra body field ``speculative``), checked up front."""
        options = body.speculative
        if options is None:
            return None, None
        if options.drafter is not None and options.drafter != "none":
            try:
                self.engine.engine.drafter(options.drafter)
            except ConfigError as exc:
                raise BadRequest(str(exc), "speculative.drafter") from exc
        drafter = "none" if options.drafter == "none" else options.drafter
        return drafter, options.num_draft_tokens

    def _check_fits(self, prompt_ids: list[int], max_tokens: int, param: str) -> None:
        try:
            self.engine.engine.check_fits(len(prompt_ids), max_tokens)
        except PromptTooLong as exc:
            raise BadRequest(str(exc), param, code="context_length_exceeded") from exc

    def _choices(
        self, body: _Request, prompts: list[list[int]], params: SamplingParams, echoes: list[str]
    ) -> list[Choice]:
        """Prompt i's j-th choice gets index i * n + j; a seeded request gives each choice seed + j."""
        n, choices = body.n, []
        drafter, num_draft_tokens = self._speculation(body)
        fail_at_step = None
        if self.engine.engine.config.fault_injection and body.model_extra:
            fail_at_step = body.model_extra.get("fault_at_step")
        for i, prompt_ids in enumerate(prompts):
            for j in range(n):
                seed = None if params.seed is None else (params.seed + j) % 2**63
                choice_params = replace(params, seed=seed)
                choice = Choice(i * n + j, prompt_ids, choice_params, j == 0, echoes[i], fail_at_step=fail_at_step)
                choice.drafter, choice.num_draft_tokens = drafter, num_draft_tokens
                choices.append(choice)
        return choices

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        prompts: list = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise BadRequest(f"prompt must hold between 1 and {MAX_PROMPTS} prompts", "prompt")
        encoded = []
        for item in prompts:
            ids = self.tokenizer(item).input_ids if isinstance(item, str) else list(item)
            if not ids:
                raise BadRequest("prompt must not be empty", "prompt")
            if any(not 0 <= token < self.vocab_size for token in ids):
                raise BadRequest(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
            encoded.append(ids)
        return encoded

    def chat_prompt(self, body: ChatCompletionRequest, tools: list[dict] | None) -> list[int]:
        if not self.tokenizer.chat_template:
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        messages = [message.template_dict() for message in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # templates raise their own errors (e.g. roles out of order)
            raise BadRequest(f"the chat template rejected these messages: {exc}", "messages") from exc
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # ---- /tokenize, /detokenize ---------------------------------------------------------------

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            tokens = self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        else:
            messages = [message.template_dict() for message in body.messages]
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tokenize=False
            )
            tokens = self.tokenizer(text, add_special_tokens=False).input_ids
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.engine.max_model_len, tokens=tokens)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        if any(not 0 <= token < self.vocab_size for token in body.tokens):
            raise BadRequest(f"token ids must be in [0, {self.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    # ---- engine -> text -----------------------------------------------------------------------

    async def _generate(self, choice: Choice, endpoint: str) -> AsyncIterator[TextDelta]:
        """Run one choice, yielding one delta per token that releases text (so a run of accepted
        drafts streams token by token); the last delta carries the finish reason and totals."""
        params = choice.params
        text = TextStream(self.tokenizer, choice.prompt_ids, params.stop)
        with_logprobs = params.logprobs is not None
        completion_tokens = 0
        started = last = time.perf_counter()
        prompt_logprobs = None
        waiting: list[TokenPiece] = []  # tokens that released no text yet (part of a character, or held back)
        request = Request(
            uuid.uuid4().hex,
            choice.prompt_ids,
            params,
            num_draft_tokens=choice.num_draft_tokens,
            drafter=choice.drafter,
            grammar=choice.grammar,
            fail_at_step=choice.fail_at_step,
        )
        outputs = self.engine.generate(request)
        try:
            async for output in outputs:
                now_ = time.perf_counter()
                self._observe(output, now_ - last, first=completion_tokens == 0)
                last = now_
                completion_tokens += len(output.token_ids)
                prompt_logprobs = prompt_logprobs or output.prompt_logprobs
                finish = None
                for piece in self._pieces(text, output):
                    waiting.append(piece)
                    if piece.text:
                        yield TextDelta(piece.text, waiting if with_logprobs else None, prompt_logprobs=prompt_logprobs)
                        waiting, prompt_logprobs = [], None
                finish = "stop" if text.stopped else output.finish_reason
                if finish is None:
                    continue
                tail = text.finish()
                if waiting:
                    waiting[-1].text += tail
                self.metrics.e2e.observe(time.perf_counter() - started)
                self.metrics.requests.labels(endpoint=endpoint, finish_reason=finish).inc()
                self.metrics.prompt_tokens.inc(output.prompt_tokens)
                self.metrics.cached_prompt_tokens.inc(output.cached_tokens)
                pieces = waiting if with_logprobs else None
                yield TextDelta(tail, pieces, finish, output, completion_tokens, prompt_logprobs)
                return
        except EngineDead as exc:
            raise EngineUnavailable(str(exc)) from exc
        except OpenAIError:
            raise
        except Exception as exc:  # the engine failed this request; it has reset itself and serves on
            raise InternalError(f"the engine failed on this request: {type(exc).__name__}: {exc}") from exc
        finally:
            await outputs.aclose()  # leaving early (stop string, disconnect) aborts the request

    def _observe(self, output: StepOutput, gap: float, first: bool) -> None:
        if output.step is not None:
            self.metrics.observe_step(output.stats.drafter, output.step)
        count = len(output.token_ids)
        if not count:
            return
        self.metrics.generation_tokens.inc(count)
        if first:
            self.metrics.ttft.observe(gap)
        else:
            for _ in range(count):
                self.metrics.itl.observe(gap / count)

    @staticmethod
    def _pieces(text: TextStream, output: StepOutput) -> list[TokenPiece]:
        """Push tokens one at a time: each token is paired with exactly the text it released."""
        logprobs = output.logprobs or [None] * len(output.token_ids)
        pieces = []
        for token, logprob in zip(output.token_ids, logprobs, strict=True):
            if text.stopped:
                break
            pieces.append(TokenPiece(text.push([token]), logprob))
        return pieces

    def _prompt_pieces(self, prompt_ids: list[int], logprobs: list[TokenLogprob | None]) -> list[TokenPiece]:
        detokenizer = IncrementalDetokenizer(self.tokenizer, [])
        texts = [detokenizer.push([token]) for token in prompt_ids]
        texts[-1] += detokenizer.flush()
        return [TokenPiece(t, lp) for t, lp in zip(texts, logprobs, strict=True)]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- /v1/completions ------------------------------------------------------------------------

    def prepare_completion(self, body: CompletionRequest) -> list[Choice]:
        self.check_model(body.model)
        if body.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise BadRequest("best_of is not supported (only best_of == n)", "best_of")
        prompts = self.completion_prompts(body)
        params = self._sampling_params(body, body.max_tokens or 16, body.logprobs)
        if body.echo and body.logprobs is not None:
            params = replace(params, prompt_logprobs=body.logprobs)
        for prompt_ids in prompts:
            self._check_fits(prompt_ids, params.max_tokens, "max_tokens")
        echoes = [self._echo(body, i, ids) for i, ids in enumerate(prompts)]
        return self._choices(body, prompts, params, echoes)

    def _echo(self, body: CompletionRequest, index: int, prompt_ids: list[int]) -> str:
        if not body.echo:
            return ""
        prompt = (
            body.prompt[index] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        )
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)

    def _completion_logprobs(self, pieces: list[TokenPiece] | None, offset: int) -> CompletionLogprobs | None:
        if pieces is None:
            return None
        offsets = []
        for piece in pieces:
            offsets.append(offset)
            offset += len(piece.text)
        return CompletionLogprobs(
            tokens=[piece.text for piece in pieces],
            token_logprobs=[piece.logprob.logprob if piece.logprob else None for piece in pieces],
            top_logprobs=[
                {self._token_text(t): lp for t, lp in piece.logprob.top} if piece.logprob else None for piece in pieces
            ],
            text_offset=offsets,
        )

    async def completion(self, body: CompletionRequest) -> CompletionResponse:
        choices, totals = [], UsageTotals()
        for choice in self.prepare_completion(body):
            parts, pieces, offset = [choice.echo], [], len(choice.echo)
            async for delta in self._generate(choice, "completions"):
                parts.append(delta.text)
                pieces.extend(delta.pieces or [])
                if delta.prompt_logprobs is not None:
                    pieces[:0] = self._prompt_pieces(choice.prompt_ids, delta.prompt_logprobs)
                    offset = 0
            totals.add(delta, choice.first_of_prompt)
            logprobs = self._completion_logprobs(pieces if choice.params.logprobs is not None else None, 0)
            if logprobs is not None and offset:  # echo without prompt logprobs: offsets start after the prompt
                logprobs.text_offset = [o + offset for o in logprobs.text_offset]
            choices.append(
                CompletionChoice(
                    index=choice.index, text="".join(parts), logprobs=logprobs, finish_reason=delta.finish_reason
                )
            )
        return CompletionResponse(
            id=new_id("cmpl"), created=now(), model=self.model_name, choices=choices, usage=totals.usage()
        )

    async def completion_stream(self, body: CompletionRequest) -> AsyncIterator[CompletionResponse]:
        return self._completion_chunks(body, self.prepare_completion(body))

    async def _completion_chunks(
        self, body: CompletionRequest, choices: list[Choice]
    ) -> AsyncIterator[CompletionResponse]:
        request_id, created, totals = new_id("cmpl"), now(), UsageTotals()

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        for choice in choices:
            offset, echoed = 0, False
            async for delta in self._generate(choice, "completions"):
                if choice.echo and not echoed:
                    echoed = True
                    prompt_logprobs = delta.prompt_logprobs
                    echo_pieces = self._prompt_pieces(choice.prompt_ids, prompt_logprobs) if prompt_logprobs else None
                    yield chunk(
                        [
                            CompletionChoice(
                                index=choice.index, text=choice.echo, logprobs=self._completion_logprobs(echo_pieces, 0)
                            )
                        ]
                    )
                    offset = len(choice.echo)
                logprobs = self._completion_logprobs(delta.pieces, offset)
                offset += len(delta.text)
                if delta.final is not None:
                    totals.add(delta, choice.first_of_prompt)
                usage = totals.usage() if delta.final is not None and choice is choices[-1] else None
                yield chunk(
                    [
                        CompletionChoice(
                            index=choice.index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason
                        )
                    ],
                    usage,
                )
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], totals.usage())

    # ---- /v1/chat/completions -------------------------------------------------------------------

    def prepare_chat(self, body: ChatCompletionRequest) -> list[Choice]:
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs requires logprobs: true", "top_logprobs")
        tools = plan_tools(body)
        prompt_ids = self.chat_prompt(body, tools.tools)
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = requested or max(1, self.engine.engine.max_model_len - len(prompt_ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, logprobs)
        self._check_fits(prompt_ids, params.max_tokens, "max_completion_tokens" if requested else "messages")
        choices = self._choices(body, [prompt_ids], params, [""])
        if tools.forced_schema is not None:
            grammar = self._grammar(ResponseFormat(type="json_schema", json_schema={"schema": tools.forced_schema}))
        else:
            grammar = self._grammar(body.response_format)
        for choice in choices:
            choice.grammar, choice.tools = grammar, tools
        return choices

    def _grammar(self, response_format: ResponseFormat | None) -> object | None:
        if response_format is None or response_format.type == "text":
            return None
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.engine.engine.eos_token_ids)
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
                TopLogprob(token=(text := self._token_text(t)), logprob=lp, bytes=list(text.encode()))
                for t, lp in piece.logprob.top
            ]
            content.append(
                ChatTokenLogprob(
                    token=piece.text, logprob=piece.logprob.logprob, bytes=list(piece.text.encode()), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)

    async def chat(self, body: ChatCompletionRequest) -> ChatCompletionResponse:
        choices, totals = [], UsageTotals()
        for choice in self.prepare_chat(body):
            parts, pieces = [], []
            async for delta in self._generate(choice, "chat"):
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
            id=new_id("chatcmpl"), created=now(), model=self.model_name, choices=choices, usage=totals.usage()
        )

    async def chat_stream(self, body: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        return self._chat_chunks(body, self.prepare_chat(body))

    async def _chat_chunks(
        self, body: ChatCompletionRequest, choices: list[Choice]
    ) -> AsyncIterator[ChatCompletionChunk]:
        request_id, created, totals = new_id("chatcmpl"), now(), UsageTotals()

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        for choice in choices:
            yield chunk([ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))])
            tool_stream = ToolCallStream(choice.tools.names) if choice.tools and choice.tools.parse else None
            async for delta in self._generate(choice, "chat"):
                text, calls, finish = delta.text, [], delta.finish_reason
                if tool_stream is not None:
                    text = tool_stream.push(text)
                    if finish is not None:
                        rest, calls = tool_stream.finish()
                        text += rest
                        finish = "tool_calls" if calls else finish
                if delta.final is not None:
                    totals.add(delta, choice.first_of_prompt)
                usage = totals.usage() if delta.final is not None and choice is choices[-1] else None
                tool_deltas = [ToolCallDelta(index=i, **call.to_openai()) for i, call in enumerate(calls)] or None
                chunk_choice = ChatChunkChoice(
                    index=choice.index,
                    delta=ChatDelta(content=text or None, tool_calls=tool_deltas),
                    logprobs=self._chat_logprobs(delta.pieces),
                    finish_reason=finish,
                )
                yield chunk([chunk_choice], usage)
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], totals.usage())
