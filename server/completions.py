"""/v1/completions: prompts (text or token ids, one or many), echo, legacy logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from .choices import Choice, TokenPiece, UsageTotals
from .errors import BadRequest
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse, new_id, now
from .serving import ServingCore

MAX_PROMPTS = 64  # prompts in one request; each becomes its own choice


class CompletionsServing:
    """/v1/completions over the serving core: ``create`` and ``stream``."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        prompts: list = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise BadRequest(f"prompt must hold between 1 and {MAX_PROMPTS} prompts", "prompt")
        encoded = []
        for item in prompts:
            ids = self.core.tokenizer(item).input_ids if isinstance(item, str) else list(item)
            if not ids:
                raise BadRequest("prompt must not be empty", "prompt")
            if any(not 0 <= token < self.core.vocab_size for token in ids):
                raise BadRequest(f"prompt token ids must be in [0, {self.core.vocab_size})", "prompt")
            encoded.append(ids)
        return encoded

    def prepare_completion(self, body: CompletionRequest) -> list[Choice]:
        self.core.check_model(body.model)
        if body.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise BadRequest("best_of is not supported (only best_of == n)", "best_of")
        prompts = self.completion_prompts(body)
        params = self.core.sampling_params(body, body.max_tokens or 16, body.logprobs)
        if body.echo and body.logprobs is not None:
            params = replace(params, prompt_logprobs=body.logprobs)
        for prompt_ids in prompts:
            self.core.check_fits(prompt_ids, params.max_tokens, "max_tokens", "prompt")
        echoes = [self._echo(body, i, ids) for i, ids in enumerate(prompts)]
        return self.core.choices(body, prompts, params, echoes)

    def _echo(self, body: CompletionRequest, index: int, prompt_ids: list[int]) -> str:
        if not body.echo:
            return ""
        prompt = (
            body.prompt[index] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        )
        return prompt if isinstance(prompt, str) else self.core.tokenizer.decode(prompt_ids)

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
                {self.core.token_text(t): lp for t, lp in piece.logprob.top} if piece.logprob else None
                for piece in pieces
            ],
            text_offset=offsets,
        )

    async def create(self, body: CompletionRequest) -> CompletionResponse:
        choices, totals = [], UsageTotals()
        for choice in self.prepare_completion(body):
            parts, pieces, offset = [choice.echo], [], len(choice.echo)
            async for delta in self.core.generate(choice, "completions"):
                parts.append(delta.text)
                pieces.extend(delta.pieces or [])
                if delta.prompt_logprobs is not None:
                    pieces[:0] = self.core.prompt_pieces(choice.prompt_ids, delta.prompt_logprobs)
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
            id=new_id("cmpl"),
            created=now(),
            model=self.core.model_name,
            system_fingerprint=self.core.fingerprint,
            choices=choices,
            usage=totals.usage(),
        )

    async def stream(self, body: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        return self._completion_chunks(body, self.prepare_completion(body))

    async def _completion_chunks(
        self, body: CompletionRequest, choices: list[Choice]
    ) -> AsyncIterator[CompletionChunk]:
        chunk, totals = self.core.stream_chunks(CompletionChunk, "cmpl"), UsageTotals()

        for choice in choices:
            offset, echoed = 0, False
            async for delta in self.core.generate(choice, "completions"):
                if choice.echo and not echoed:
                    echoed = True
                    prompt_logprobs = delta.prompt_logprobs
                    echo_pieces = (
                        self.core.prompt_pieces(choice.prompt_ids, prompt_logprobs) if prompt_logprobs else None
                    )
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
                yield chunk(
                    [
                        CompletionChoice(
                            index=choice.index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason
                        )
                    ],
                    speculative=delta.speculative(),
                )
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=totals.usage())
