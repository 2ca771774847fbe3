"""Defects found by the independent review (issue 11): half-precision serving, usage and speculation
counters that describe what the client received, one usage chunk per stream, staged chains, seeded
requests under adaptive k, the sampling range, logprob bytes, and prompts ending inside a character."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch
from openai import OpenAI

from engine.config import ConfigError, EngineConfig
from engine.drafters import check_stages
from engine.factory import load_engine
from engine.request import Request
from engine.sampling import SamplingParams
from server.detokenizer import IncrementalDetokenizer, TextStream, TokenBytes, ends_inside_character
from tests.conftest import REPO
from tests.faults import every_forward
from tests.test_lossless import greedy_reference
from tests.tiny import byte_tokenizer, perturbed_copy, tiny_engine, tiny_llama

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def tokens_of(outputs) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


# ---- 1. float16: the NaN guard must not overflow ----------------------------------------------------


def test_float16_logits_whose_sum_overflows_are_served():
    """49k SmolLM2 logits of mean ~3.8 sum past float16's 65,504; here 4,096 logits of mean ~30 do."""
    target = tiny_llama(seed=3, vocab_size=4096).to(torch.float16)
    engine = tiny_engine(target, None)
    engine.logits_hook = every_forward(lambda logits: logits + 30.0)  # finite, but a row's sum is inf in float16
    outputs = list(engine.generate(Request("f", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))))
    assert len(tokens_of(outputs)) == 3


def test_a_real_nan_is_still_refused_in_float16():
    from engine.spec import NonFiniteProbabilities

    engine = tiny_engine(tiny_llama(seed=3, vocab_size=64).to(torch.float16), None)
    engine.logits_hook = every_forward(lambda logits: torch.full_like(logits, float("nan")))
    with pytest.raises(NonFiniteProbabilities):
        list(engine.generate(Request("n", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_bad_logit_in_a_verify_row_is_refused(bad, temperature):
    """One NaN or inf among the logits of any row (here the last row of a k = 4 verify, late in the
    vocabulary) is refused like a row of them: the guard reads every row and every id."""
    from engine.spec import NonFiniteProbabilities

    def spoil(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[-1, -3] = bad
        return logits

    target = tiny_llama(seed=3, vocab_size=96)
    engine = tiny_engine(target, perturbed_copy(target, 0.01, 1), num_draft_tokens=4)
    engine.logits_hook = every_forward(spoil)
    params = SamplingParams(max_tokens=3, temperature=temperature)
    with pytest.raises(NonFiniteProbabilities):
        list(engine.generate(Request("b", [1, 2, 3], params, drafter="model")))


# ---- 2 and 8: counters describe the tokens the client received --------------------------------------


def test_speculative_counters_stop_at_end_of_sequence():
    """A draft identical to the target accepts everything; EOS inside an accepted run ends the output."""
    target = tiny_llama(seed=3, vocab_size=96, init=0.5)
    expected = greedy_reference(target, [5, 6, 7, 8], 20)
    eos = expected[6]  # the 7th token, first seen there: inside the second step's run of 5 (4 drafts + bonus)
    assert eos not in expected[:6]
    draft = tiny_llama(seed=3, vocab_size=96, init=0.5)
    engine = tiny_engine(target, draft, num_draft_tokens=4, eos={eos})
    outputs = list(engine.generate(Request("e", [5, 6, 7, 8], SamplingParams(max_tokens=20, temperature=0.0))))
    stats = outputs[-1].stats
    assert tokens_of(outputs) == expected[:7]
    assert stats.target_forwards == 2 and stats.emitted_tokens == 7  # not 10
    assert stats.mean_tokens_per_forward == 3.5 and stats.accepted_tokens == 4 + 2
    assert stats.accepted_per_position == [2, 2, 1, 1] and outputs[-1].step.num_emitted == 2


def test_speculative_counters_stop_at_max_tokens_and_name_the_target_alone():
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    engine = tiny_engine(target, tiny_llama(seed=3, vocab_size=96, init=0.2), num_draft_tokens=4)
    outputs = list(engine.generate(Request("m", [5, 6], SamplingParams(max_tokens=7, temperature=0.0))))
    assert outputs[-1].stats.emitted_tokens == 7 == len(tokens_of(outputs))
    alone = list(engine.generate(Request("n", [5, 6], SamplingParams(max_tokens=3), drafter="none")))
    assert alone[-1].stats.to_dict()["drafter"] == "none"


def generated_tokens_metric(server) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("specserve_generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no generation token counter")


def test_usage_after_a_stop_string_inside_an_accepted_run_counts_what_target_only_would(client, server):
    prompt = "Stop inside a run:"
    alone = {"speculative": {"drafter": "none"}, "ignore_eos": True}
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, extra_body=alone)
    overshoot = 0
    for start in range(1, 9):
        stop = text.choices[0].text[start : start + 2]
        if text.choices[0].text.index(stop) != start or "\ufffd" in stop:
            continue
        target_only = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop], extra_body=alone
        )
        before = generated_tokens_metric(server)
        speculative = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
        )
        assert generated_tokens_metric(server) - before == target_only.usage.completion_tokens
        assert speculative.choices[0].text == target_only.choices[0].text
        assert speculative.choices[0].finish_reason == "stop"
        counted = speculative.usage.completion_tokens
        assert counted == target_only.usage.completion_tokens
        stats = speculative.usage.model_extra["speculative"]
        assert round(stats["mean_tokens_per_forward"] * stats["target_forwards"]) == counted
        overshoot += stats["accepted_tokens"] > 0
    assert overshoot > 0  # some stops landed inside a run of accepted drafts


# ---- 3. cached_tokens is what was reused --------------------------------------------------------------


def test_cached_tokens_is_zero_when_the_prompt_is_scored_again(client):
    prompt = "A prompt long enough to be cached the second time round"
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    reused = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    assert reused.usage.prompt_tokens_details.cached_tokens > 0
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True, logprobs=1, **GREEDY)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0


# ---- 4. usage on one chunk only ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), ("/completions", {"prompt": "hi"})],
)
@pytest.mark.parametrize("include_usage", [True, False])
def test_usage_is_sent_once_on_the_last_chunk_and_speculation_on_each_finish(server, path, body, include_usage):
    request = {**body, "model": "tiny", "max_tokens": 6, "n": 2, "stream": True, "ignore_eos": True}
    if include_usage:
        request["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{server.v1}{path}", json=request, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(event) for event in events[:-1]]
    with_usage = [chunk for chunk in chunks if chunk.get("usage") is not None]
    finishing = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["finish_reason"]]
    assert len(finishing) == 2 and all(chunk["speculative"]["drafter"] == "model" for chunk in finishing)
    assert all(chunk["speculative"] is None for chunk in chunks if chunk not in finishing)
    if include_usage:
        assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        drafted = sum(chunk["speculative"]["drafted_tokens"] for chunk in finishing)
        assert chunks[-1]["usage"]["speculative"]["drafted_tokens"] == drafted
    else:
        assert with_usage == []


# ---- 5. staged chains name each drafter once ---------------------------------------------------------


@pytest.mark.parametrize(
    "stages,why",
    [
        (("model", "model"), "more than once"),
        (("ngram", "model", "model"), "more than once"),
        (("ngram",), "at least two"),
        (("ngram", "staged"), "itself"),
        (("ngram", "bogus"), "unknown drafter"),
        (("model", "ngram"), "cannot check"),
    ],
)
def test_bad_stage_chains_are_refused_by_the_registry(stages, why):
    with pytest.raises(ConfigError, match=why):
        check_stages(stages)


def test_a_chain_naming_a_model_twice_is_refused_at_startup(tiny_model_dirs):
    target, draft = tiny_model_dirs
    command = [sys.executable, "-m", "server.cli", "serve", "--target", str(target), "--draft", str(draft)]
    result = subprocess.run(
        [*command, "--stages", "model,model", "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "'model' appears more than once" in result.stderr and "Traceback" not in result.stderr


def test_per_request_stages_are_checked_and_used(server, client):
    response = httpx.post(
        f"{server.v1}/completions", json={"prompt": "x", "speculative": {"stages": ["model", "model"]}}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "speculative.stages"
    assert "more than once" in response.json()["error"]["message"]
    response = httpx.post(
        f"{server.v1}/completions",
        json={"prompt": "x", "speculative": {"drafter": "ngram", "stages": ["ngram", "model"]}},
    )
    assert response.status_code == 400
    chained = client.completions.create(
        model="tiny",
        prompt="abcabcabc",
        max_tokens=10,
        extra_body={"speculative": {"stages": ["ngram", "model"]}, **GREEDY["extra_body"]},
        temperature=0,
    )
    alone = client.completions.create(
        model="tiny",
        prompt="abcabcabc",
        max_tokens=10,
        extra_body={"speculative": {"drafter": "none"}, **GREEDY["extra_body"]},
        temperature=0,
    )
    assert chained.choices[0].text == alone.choices[0].text
    assert chained.usage.model_extra["speculative"]["drafter"] == "staged"


# ---- 6. seeded requests repeat under adaptive k ----------------------------------------------------------


def test_seeded_requests_repeat_when_the_server_adapts_k():
    target = tiny_llama(seed=0, vocab_size=16, init=0.12)
    draft = perturbed_copy(target, noise=0.5, seed=1)
    engine = tiny_engine(target, draft, num_draft_tokens=4, adaptive_k=True)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=42)
    outputs = {tuple(tokens_of(engine.generate(Request(str(i), [1, 2, 3], params)))) for i in range(6)}
    assert len(outputs) == 1
    # a fixed k, or adaptive k asked for by the request: the same text (draws keyed by position)
    asked = list(engine.generate(Request("a", [1, 2, 3], params, adaptive_k=True)))
    fixed = list(engine.generate(Request("f", [1, 2, 3], params, adaptive_k=False, num_draft_tokens=2)))
    assert {tuple(tokens_of(asked)), tuple(tokens_of(fixed))} == outputs


# ---- 7. only ids the tokenizer can decode are sampled ----------------------------------------------------


@pytest.mark.parametrize("drafter", ["none", "model", "ngram"])
def test_padding_rows_past_the_tokenizer_are_never_sampled(drafter):
    tokenizer_size = 40
    target = tiny_llama(seed=4, vocab_size=64, init=0.3)  # 24 padding rows with real (random) weights
    draft = perturbed_copy(target, noise=0.1, seed=5)
    engine = tiny_engine(target, draft, tokenizer_size=tokenizer_size)
    params = SamplingParams(max_tokens=100, temperature=1.5, ignore_eos=True)
    for i in range(4):
        tokens = tokens_of(engine.generate(Request(str(i), [1, 2, 3, 1, 2, 3], params, drafter=drafter)))
        assert max(tokens) < tokenizer_size


def test_loading_limits_sampling_to_the_tokenizer(tmp_path):
    tokenizer = byte_tokenizer()
    folder = tmp_path / "padded"
    model = tiny_llama(seed=1, vocab_size=len(tokenizer) + 30)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    loaded = load_engine(EngineConfig(target=str(folder), device="cpu", max_model_len=64), show_progress=False)
    assert loaded.engine.vocab_size == len(tokenizer) < loaded.engine.target.vocab_size


# ---- 9. logprob bytes are the token's own -------------------------------------------------------------


def test_token_bytes_of_a_byte_level_tokenizer():
    tokenizer = byte_tokenizer()
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes.byte_level
    ids = tokenizer("a€").input_ids
    assert [token_bytes(token) for token in ids] == [b"a", b"\xe2", b"\x82", b"\xac"]
    assert token_bytes(tokenizer.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def test_top_logprobs_carry_each_tokens_own_bytes(client):
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "bytes"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=20,
        **GREEDY,
    )
    tops = [top for entry in response.choices[0].logprobs.content for top in entry.top_logprobs]
    single_bytes = [top for top in tops if top.token != "<|im_start|>" and top.token != "<|im_end|>"]
    assert all(len(top.bytes) == 1 for top in single_bytes)
    assert any(top.bytes[0] >= 0x80 for top in single_bytes)  # parts of characters: their real byte
    assert all(top.bytes != [239, 191, 189] for top in single_bytes)


# ---- 10. a prompt that ends inside a character ---------------------------------------------------------


def test_ends_inside_character():
    assert ends_inside_character("a€".encode()[:-1]) and ends_inside_character(b"\xf0\x9f")
    assert not ends_inside_character("a€".encode()) and not ends_inside_character(b"abc")
    assert not ends_inside_character("\ufffd".encode())  # a literal replacement character is complete


def test_output_completes_a_character_the_prompt_began():
    tokenizer = byte_tokenizer()
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer("a€b").input_ids  # a, e2, 82, ac, b
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:3], token_bytes=token_bytes)
    assert detokenizer.push([ids[3]]) == "€" and detokenizer.push([ids[4]]) == "b"
    stream = TextStream(tokenizer, ids[:2], [], token_bytes)  # two bytes still missing
    assert stream.push([ids[2]]) == "" and stream.push([ids[3]]) == "€"
    literal = tokenizer("x\ufffd").input_ids  # a prompt that really ends with U+FFFD
    detokenizer = IncrementalDetokenizer(tokenizer, literal, token_bytes=token_bytes)
    assert detokenizer.push(tokenizer("y").input_ids) == "y"


def test_token_id_prompt_ending_inside_a_character_over_http(server):
    tokenizer = byte_tokenizer()
    prompt = tokenizer("Price: €").input_ids[:-1]  # the euro sign's last byte is missing
    euro_end = tokenizer("€").input_ids[-1]
    response = httpx.post(
        f"{server.v1}/completions",
        json={"prompt": prompt, "max_tokens": 1, "logit_bias": {str(euro_end): 100}, "temperature": 0},
    )
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "€"
