"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest

from server.detokenizer import IncrementalDetokenizer, StopStrings, TextStream
from tests.tiny import byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def test_multibyte_characters_are_never_split(tokenizer):
    text = "a€b😀c"
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.push([token]) for token in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[1] == "" and pieces[2] == "" and pieces[3] == "€"  # held until the third byte


def test_pushing_many_tokens_at_once_matches_one_at_a_time(tokenizer):
    ids = tokenizer("speculative décodage ✓").input_ids
    detok = IncrementalDetokenizer(tokenizer, [])
    assert (
        detok.push(ids[:5]) + detok.push(ids[5:13]) + detok.push(ids[13:]) + detok.flush() == "speculative décodage ✓"
    )


def test_stop_string_split_across_pushes_is_never_emitted():
    stop = StopStrings(["STOP"])
    out = stop.push("hello ST") + stop.push("O") + stop.push("P and more")
    assert out == "hello " and stop.stopped and stop.flush() == ""


def test_earliest_of_several_stop_strings_wins():
    stop = StopStrings(["xyz", "b"])
    assert stop.push("aaxyzb") == "aa"


def test_text_without_stop_strings_is_released_at_finish(tokenizer):
    stream = TextStream(tokenizer, [], ["never"])
    ids = tokenizer("almost nev").input_ids
    assert stream.push(ids) + stream.finish() == "almost nev"


def test_special_tokens_are_not_emitted(tokenizer):
    stream = TextStream(tokenizer, [], [])
    assert stream.push(tokenizer("hi").input_ids + [tokenizer.eos_token_id]) + stream.finish() == "hi"
