"""Token ids to text, incrementally: no half UTF-8 characters, no stop string ever emitted."""

from __future__ import annotations

import json
import re

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

REPLACEMENT = "\ufffd"
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's tokens for single raw bytes
METASPACE = "\u2581"  # SentencePiece's visible space


class TokenBytes:
    """Each token's own UTF-8 bytes, as OpenAI's logprobs report them: a token that is only part of
    a character has bytes that do not decode on their own, and its decoded text would be U+FFFD."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.dumps(json.loads(backend.to_str()).get("decoder")) if backend is not None else ""
        self.byte_level = '"ByteLevel"' in decoder
        # byte-level BPE (GPT-2 and most current tokenizers) writes each byte as one printable character
        self._alphabet = {char: byte for byte, char in bytes_to_unicode().items()}
        self._added = {index: token.content for index, token in tokenizer.added_tokens_decoder.items()}

    def __call__(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return b""
        if self.byte_level and all(char in self._alphabet for char in token):
            return bytes(self._alphabet[char] for char in token)
        if match := BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        return token.replace(METASPACE, " ").encode()


def ends_inside_character(data: bytes) -> bool:
    """True when ``data`` ends with the first bytes of a UTF-8 character but not all of them."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: the character starts further back
            continue
        needed = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return needed > back
    return False


class IncrementalDetokenizer:
    """Decodes a growing id list and returns only the new, complete text.

    A window of earlier ids is decoded with the new ones, so tokenizers that drop a leading
    space at the start of a decode still produce the right spacing.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context_ids: list[int],
        context: int = 4,
        token_bytes: TokenBytes | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.ids = list(context_ids[-context:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # A prompt that ends inside a character decodes to a trailing U+FFFD; the output's first text
        # is the whole character its tokens complete, so that U+FFFD does not count as already seen.
        self._open_character = token_bytes is not None and ends_inside_character(
            b"".join(token_bytes(token) for token in self.ids)
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _seen(self) -> str:
        seen = self._decode(self.ids[self.prefix_offset : self.read_offset])
        if self._open_character and seen.endswith(REPLACEMENT):
            seen = seen[: -len(REPLACEMENT)]
        return seen

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        seen = self._seen()
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(seen) or full.endswith(REPLACEMENT):
            return ""  # wait for the rest of a multi-byte character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._open_character = False
        return full[len(seen) :]

    def flush(self) -> str:
        seen = self._seen()
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        self._open_character = False
        return full[len(seen) :]


class StopStrings:
    """Holds back just enough text to be sure no stop string is being emitted."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.hold = max((len(stop) for stop in self.stops), default=1) - 1
        self.buffer = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buffer += text
        found = [index for stop in self.stops if (index := self.buffer.find(stop)) >= 0]
        if found:
            self.stopped = True
            out, self.buffer = self.buffer[: min(found)], ""
            return out
        cut = len(self.buffer) - self.hold
        if cut <= 0:
            return ""
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out


class TextStream:
    """Detokenizer plus stop strings: push token ids, get the text that is safe to send."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        stop: list[str],
        token_bytes: TokenBytes | None = None,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, token_bytes=token_bytes)
        self.stop = StopStrings(stop)

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def push(self, token_ids: list[int]) -> str:
        return self.stop.push(self.detokenizer.push(token_ids))

    def finish(self) -> str:
        text = self.stop.push(self.detokenizer.flush())
        return text + self.stop.flush()
