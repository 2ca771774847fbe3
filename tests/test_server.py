"""End to end through a real uvicorn server: the OpenAI SDK, raw SSE, and bad input."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def sse_events(server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{server.v1}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list().data] == ["tiny"]
    assert client.models.list().data[0].model_extra["draft"].endswith("draft")  # the tiny draft's folder


def test_completion_with_the_sdk_reports_speculative_usage(client):
    response = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=20, **GREEDY)
    choice = response.choices[0]
    assert response.object == "text_completion" and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 20
    speculative = response.usage.model_extra["speculative"]
    assert speculative["drafted_tokens"] > 0 and 0 <= speculative["accepted_tokens"] <= speculative["drafted_tokens"]
    assert speculative["mean_tokens_per_forward"] >= 1.0


def test_completion_stream_joins_to_the_non_streaming_text(client):
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, **GREEDY)
    chunks = list(
        client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, stream=True, **GREEDY)
    )
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in chunks].count("length") == 1


def test_completion_accepts_token_ids(client):
    response = client.completions.create(model="tiny", prompt=[70, 71, 72], max_tokens=5, **GREEDY)
    assert response.usage.prompt_tokens == 3 and response.usage.completion_tokens == 5


def test_chat_with_the_sdk_streaming_and_not(client):
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=25, **GREEDY)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=25, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.choices[0].delta.role is None for chunk in chunks[1:])
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    assert all(chunk.usage is None for chunk in chunks)  # usage only with stream_options.include_usage
    assert chunks[-1].model_extra["speculative"]["drafted_tokens"] > 0  # on the chunk that finishes the choice


def test_chat_content_parts_equal_plain_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "hello there"}]
    a = client.chat.completions.create(model="tiny", messages=parts, max_tokens=10, **GREEDY)
    b = client.chat.completions.create(model="tiny", messages=plain, max_tokens=10, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_raw_sse_chat_chunk_shapes(server):
    body = {
        "model": "tiny",
        "messages": CHAT,
        "max_tokens": 12,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(server, "/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    with_choices = [chunk for chunk in chunks if chunk["choices"]]
    assert [c["choices"][0]["finish_reason"] for c in with_choices].count("length") == 1
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert set(usage_chunk["usage"]["speculative"]) >= {"drafted_tokens", "accepted_tokens", "acceptance_rate"}


def test_raw_sse_completion_chunk_shapes(server):
    events = sse_events(server, "/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 8, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert sum(1 for chunk in chunks if chunk["choices"][0]["finish_reason"]) == 1


def test_stop_string_never_appears(client):
    text = client.completions.create(model="tiny", prompt="Stop here:", max_tokens=40, **GREEDY).choices[0].text
    stop = text[10:13]
    stopped = client.completions.create(model="tiny", prompt="Stop here:", max_tokens=40, stop=[stop], **GREEDY)
    assert stopped.choices[0].text == text[: text.index(stop)] and stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt="Stop here:", max_tokens=40, stop=stop, stream=True, **GREEDY
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible(client):
    texts = {
        client.completions.create(model="tiny", prompt="seeded", max_tokens=15, temperature=1.0, seed=7).choices[0].text
        for _ in range(2)
    }
    assert len(texts) == 1


def test_next_chat_turn_reuses_the_cached_prefix(client):
    first = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, **GREEDY)
    turn = CHAT + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    second = client.chat.completions.create(model="tiny", messages=turn, max_tokens=8, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2


BAD_REQUESTS = [
    ("/completions", {"model": "tiny"}, "prompt"),
    ("/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/completions", {"prompt": "x", "temperature": 5}, "temperature"),
    ("/completions", {"prompt": "x" * 300}, "prompt"),  # the prompt alone leaves no room: it is what to change
    ("/completions", {"prompt": "x" * 300, "stream": True}, "prompt"),
    ("/completions", {"prompt": [99999]}, "prompt"),
    ("/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("/chat/completions", {"messages": []}, "messages"),
    ("/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_bad_input_gets_an_openai_shaped_400(server, path, body, param):
    response = httpx.post(f"{server.v1}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_malformed_json_gets_400(server):
    for content in (b'{"prompt": "x",', b"[1, 2]", b"not json"):
        response = httpx.post(f"{server.v1}/completions", content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_prompt_too_long_is_reported_before_streaming(server):
    response = httpx.post(f"{server.v1}/completions", json={"prompt": "y" * 400, "stream": True})
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_sdk_raises_typed_errors_and_the_engine_keeps_serving(client):
    with pytest.raises(NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, top_p=0)
    assert client.completions.create(model="tiny", prompt="still alive", max_tokens=3).usage.completion_tokens >= 1


def test_health(server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_a_request_can_choose_its_drafter_and_k(client):
    def usage(speculative):
        response = client.completions.create(
            model="tiny",
            prompt="abcabcabc",
            max_tokens=12,
            extra_body={"speculative": speculative, **GREEDY["extra_body"]},
            temperature=0,
        )
        return response.usage.model_extra["speculative"]

    assert usage({"drafter": "ngram"})["drafter"] == "ngram"
    assert usage({"drafter": "none"})["drafted_tokens"] == 0
    model = usage({"num_draft_tokens": 1})
    assert model["drafter"] == "model" and model["mean_num_draft_tokens"] <= 1
    for _ in range(3):  # 36 tokens with ngram: enough for a measured speed
        usage({"drafter": "ngram"})
    speeds = httpx.get(f"{client.base_url}models").json()["data"][0]["drafter_tokens_per_s"]
    assert speeds["ngram"] > 0 and all(value > 0 for value in speeds.values())


@pytest.mark.parametrize(
    "speculative,param",
    [
        ({"drafter": "no-such-drafter"}, "speculative.drafter"),
        ({"num_draft_tokens": 99}, "speculative.num_draft_tokens"),
    ],
)
def test_bad_speculative_options_get_400(server, speculative, param):
    response = httpx.post(f"{server.v1}/completions", json={"prompt": "x", "speculative": speculative})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# ---- the first hour, again (issue 26) ---------------------------------------------------------------


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_context_length_error_names_the_field_the_client_sent(server, field):
    body = {"messages": [{"role": "user", "content": "hi"}], field: 100_000}
    response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == field


@pytest.mark.parametrize("path,field", [("chat/completions", "messages"), ("completions", "prompt")])
def test_a_prompt_that_leaves_no_room_is_named_whatever_length_was_asked(server, path, field):
    prompt = {"messages": [{"role": "user", "content": "y" * 400}]} if field == "messages" else {"prompt": "y" * 400}
    for length in ({}, {"max_tokens": 5}):
        response = httpx.post(f"{server.v1}/{path}", json={**prompt, **length}, timeout=30)
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == field
    fits = httpx.post(f"{server.v1}/completions", json={"prompt": "short", "max_tokens": 100_000}, timeout=30)
    assert fits.json()["error"]["param"] == "max_tokens"  # the prompt fits: the length is what to change


@pytest.mark.parametrize("path,field", [("chat/completions", "messages"), ("completions", "prompt")])
@pytest.mark.parametrize("content", [b"", b"[1, 2]", b'"hello"', b"null"])
def test_a_body_that_is_no_object_says_what_it_needs(server, path, field, content):
    response = httpx.post(f"{server.v1}/{path}", content=content, headers={"content-type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field
    assert error["message"] == f"the request body must be a JSON object with {field} (and model: the served model's id)"


def test_acceptance_rate_is_null_when_nothing_was_drafted(client):
    body = {"speculative": {"drafter": "none"}, "ignore_eos": True}
    alone = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0, extra_body=body)
    speculative = alone.usage.model_extra["speculative"]
    assert speculative["drafted_tokens"] == 0 and speculative["acceptance_rate"] is None
    drafted = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
    assert drafted.usage.model_extra["speculative"]["acceptance_rate"] is not None


def test_health_and_metrics_polls_stay_out_of_an_info_log(server):
    for path in ("/health", "/metrics", "/health?probe=1", "/v1/models"):
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 200
    log = server.log.read_text()
    assert '"GET /v1/models HTTP/1.1" 200' in log  # access lines are on
    assert "GET /health" not in log and "GET /metrics" not in log
