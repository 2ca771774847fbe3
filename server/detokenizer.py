"""Token ids to text, incrementally: no half UTF-8 characters, no stop string ever emitted."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing id list and returns only the new, complete text.

    A window of earlier ids is decoded with the new ones, so tokenizers that drop a leading
    space at the start of a decode still produce the right spacing.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context_ids: list[int], context: int = 4) -> None:
        self.tokenizer = tokenizer
        self.ids = list(context_ids[-context:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        seen = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(seen) or full.endswith(REPLACEMENT):
            return ""  # wait for the rest of a multi-byte character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(seen) :]

    def flush(self) -> str:
        seen = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
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

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], stop: list[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = StopStrings(stop)

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def push(self, token_ids: list[int]) -> str:
        return self.stop.push(self.detokenizer.push(token_ids))

    def finish(self) -> str:
        text = self.stop.push(self.detokenizer.flush())
        return text + self.stop.flush()
