"""The serving core both generation endpoints hold: request validation, requests to the engine
(through its client, ``AsyncEngine``), and engine outputs turned into text, logprob pieces,
metrics and usage."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from engine.async_engine import AsyncEngine, DeadlinePassed, EngineClosed, EngineDead
from engine.config import ConfigError
from engine.request import PromptTooLong, Request, StepOutput, TokenLogprob
from engine.sampling import SamplingError, SamplingParams

from .choices import Choice, TextDelta, TokenPiece
from .detokenizer import IncrementalDetokenizer, TextStream, TokenBytes
from .errors import BadRequest, EngineUnavailable, InternalError, ModelNotFound, OpenAIError, RequestTimeout
from .metrics import Metrics
from .protocol import ChatMessage, DetokenizeRequest, TokenizeRequest, _Request
from .responses import DetokenizeResponse, TokenizeResponse, new_id, now

MAX_STOP_STRINGS = 4
MAX_N = 16
MAX_LOGIT_BIAS = 300  # entries, as in OpenAI's API
MAX_CHOICES = 64  # prompts x n in one request: they run one after another

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServingCore:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        metrics: Metrics,
        request_timeout: float | None = None,
        generation_defaults: bool = True,
    ) -> None:
        """``generation_defaults``: requests that leave a sampling field (or chat's length) unset get
        the model's generation config's value (``EngineDescription.generation_defaults``), as in vLLM,
        and a chat request that sends no system message the model's default one, where it has one
        (``EngineDescription.default_system``); else OpenAI's defaults and the template's own."""
        self.engine = engine
        self.request_timeout = request_timeout
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.description = engine.description  # the loaded engine's: vocabulary, context, drafters
        self.fingerprint = self.description.system_fingerprint or None
        self.defaults = dict(self.description.generation_defaults) if generation_defaults else {}
        self.system = self.description.default_system if generation_defaults else None
        self.vocab_size = self.description.vocab_size
        self.token_bytes = TokenBytes(tokenizer)

    # ---- request -> engine --------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name:
            raise ModelNotFound(f"the model '{name}' does not exist; this server serves '{self.model_name}'", "model")

    def sampling_params(self, body: _Request, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if body.stream_options is not None and not body.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        if body.n > MAX_N:
            raise BadRequest(f"n must be at most {MAX_N}", "n")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        if len(body.logit_bias or {}) > MAX_LOGIT_BIAS:
            raise BadRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
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
        values = {key: self.defaults.get(key) if value is None else value for key, value in values.items()}
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

    def _engine_options(self, body: _Request) -> dict:
        """The ``Request`` fields a request sets beyond prompt and sampling, checked up front: its own
        drafter, k and adaptive k (extra body field ``speculative``)."""
        options: dict = {}
        speculative = body.speculative
        if speculative is not None:
            drafter, stages = speculative.drafter, speculative.stages
            if stages is not None:
                if drafter not in (None, "staged"):
                    raise BadRequest(f"stages applies to the staged drafter, not {drafter!r}", "speculative.stages")
                drafter, stages = "staged", tuple(stages)
            if drafter is not None and drafter != "none":
                try:
                    self.engine.check_drafter(drafter, stages)
                except ConfigError as exc:
                    param = "speculative.stages" if stages is not None else "speculative.drafter"
                    raise BadRequest(str(exc), param) from exc
            options.update(
                drafter=drafter,
                num_draft_tokens=speculative.num_draft_tokens,
                adaptive_k=speculative.adaptive_k,
                stages=stages,
            )
        return options

    def check_fits(self, prompt_ids: list[int], max_tokens: int, length_param: str, prompt_param: str) -> None:
        """A 400 naming the field to change: the prompt's (``messages``, ``prompt``) where the prompt
        leaves no room for one new token, else the length field the client used."""
        try:
            self.description.check_fits(len(prompt_ids), max_tokens)
        except PromptTooLong as exc:
            fits = 0 < len(prompt_ids) < self.description.max_model_len
            raise BadRequest(str(exc), length_param if fits else prompt_param, code="context_length_exceeded") from exc

    def choices(
        self, body: _Request, prompts: list[list[int]], params: SamplingParams, echoes: list[str]
    ) -> list[Choice]:
        """Prompt i's j-th choice gets index i * n + j; a seeded request gives each choice seed + j."""
        n, choices = body.n, []
        if len(prompts) * n > MAX_CHOICES:
            raise BadRequest(f"prompts x n must be at most {MAX_CHOICES}", "n")
        options = self._engine_options(body)
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        log.debug("request prompts: %r", prompts)  # prompts are the users' data: debug level only
        for i, prompt_ids in enumerate(prompts):
            for j in range(n):
                seed = None if params.seed is None else (params.seed + j) % 2**63
                choice_params = replace(params, seed=seed)
                request = Request(uuid.uuid4().hex, prompt_ids, choice_params, tenant=body.tenant, **options)
                choices.append(Choice(i * n + j, request, j == 0, echoes[i], deadline=deadline))
        return choices

    def stream_chunks(self, chunk_type: type[T], prefix: str) -> Callable[..., T]:
        """``chunk(choices, **fields)`` builds one stream's next chunk; all share an id and a time."""
        request_id, created = new_id(prefix), now()

        def chunk(choices: list, **fields) -> T:
            return chunk_type(
                id=request_id,
                created=created,
                model=self.model_name,
                system_fingerprint=self.fingerprint,
                choices=choices,
                **fields,
            )

        return chunk

    # ---- /tokenize, /detokenize ---------------------------------------------------------------

    def template_messages(self, messages: list[ChatMessage]) -> list[dict]:
        """Chat messages as the chat template gets them: after the model's default system message
        (``system``) where they carry no system or developer message of their own."""
        given = [message.template_dict() for message in messages]
        if self.system is None or any(message["role"] in ("system", "developer") for message in given):
            return given
        return [{"role": "system", "content": self.system}, *given]

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            tokens = self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        else:
            text = self.tokenizer.apply_chat_template(
                self.template_messages(body.messages), add_generation_prompt=body.add_generation_prompt, tokenize=False
            )
            tokens = self.tokenizer(text, add_special_tokens=False).input_ids
        return TokenizeResponse(count=len(tokens), max_model_len=self.description.max_model_len, tokens=tokens)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        if any(not 0 <= token < self.vocab_size for token in body.tokens):
            raise BadRequest(f"token ids must be in [0, {self.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    # ---- engine -> text -----------------------------------------------------------------------

    async def generate(self, choice: Choice, endpoint: str) -> AsyncIterator[TextDelta]:
        """Run one choice, yielding one delta per token that releases text (so a run of accepted
        drafts streams token by token); the last delta carries the finish reason and totals. What
        the client received of the output, and only that, is then remembered by the engine."""
        params = choice.params
        text = TextStream(self.tokenizer, choice.prompt_ids, params.stop, self.token_bytes)
        with_logprobs = params.logprobs is not None
        completion_tokens = 0
        started = last = time.perf_counter()
        prompt_logprobs = None
        waiting: list[TokenPiece] = []  # tokens that released no text yet (part of a character, or held back)
        token_ids: list[int] = []  # the output, up to a stop string
        sent = 0  # how many of them went out with a delta
        outputs = self.engine.generate(choice.request, choice.deadline)
        try:
            while True:
                output = await anext(outputs, None)
                if output is None:
                    return
                pieces = self._pieces(text, output)
                if text.stopped:  # tokens after the one that completed a stop string were never sent
                    output = output.truncated(len(pieces))
                now_ = time.perf_counter()
                self._observe(output, now_ - last, first=completion_tokens == 0)
                last = now_
                completion_tokens += len(output.token_ids)
                token_ids += output.token_ids
                prompt_logprobs = prompt_logprobs or output.prompt_logprobs
                accepted = output.step.num_accepted if output.step is not None else 0  # a step's first tokens
                for index, piece in enumerate(pieces):
                    waiting.append(piece)
                    if piece.text:
                        pieces = waiting if with_logprobs else None
                        sent += len(waiting)
                        yield TextDelta(piece.text, pieces, prompt_logprobs=prompt_logprobs, draft=index < accepted)
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
                sent = len(token_ids)
                yield TextDelta(tail, pieces, finish, output, completion_tokens, prompt_logprobs)
                return
        except DeadlinePassed:
            raise RequestTimeout(
                f"the request did not finish within the server's request timeout ({self.request_timeout:g} s)"
            ) from None
        except EngineDead as exc:
            raise EngineUnavailable(str(exc)) from exc
        except EngineClosed as exc:
            raise EngineUnavailable(str(exc), code="shutting_down") from exc
        except OpenAIError:
            raise
        except Exception as exc:  # the engine failed this request; it has reset itself and serves on
            raise InternalError(f"the engine failed on this request: {type(exc).__name__}: {exc}") from exc
        finally:
            await outputs.aclose()  # leaving early (stop string, disconnect) aborts the request
            self.engine.remember(choice.request.tenant, token_ids[:sent], choice.request.request_id)

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

    def prompt_pieces(self, prompt_ids: list[int], logprobs: list[TokenLogprob | None]) -> list[TokenPiece]:
        detokenizer = IncrementalDetokenizer(self.tokenizer, [])
        texts = [detokenizer.push([token]) for token in prompt_ids]
        texts[-1] += detokenizer.flush()
        return [TokenPiece(t, lp) for t, lp in zip(texts, logprobs, strict=True)]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
