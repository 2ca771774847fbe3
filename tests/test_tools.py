"""Tool calling: validation, rendering through the chat template, forced calls, and parsing."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from server.tools import ToolCallStream, parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def check_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days"} and isinstance(arguments["days"], int)


def test_named_tool_choice_returns_a_parsed_call(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=120, seed=0
    )
    assert response.choices[0].finish_reason == "tool_calls"
    assert response.choices[0].message.content is None
    check_weather_call(response.choices[0].message.tool_calls[0])


def test_named_tool_choice_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=120, seed=1, stream=True
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    empty = [chunk for chunk in chunks[1:] if not chunk.choices[0].delta.model_dump(exclude_none=True)]
    assert all(chunk.choices[0].finish_reason for chunk in empty)  # no empty deltas while the call forms
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ""
    check_weather_call(calls[0])


def test_required_tool_choice_calls_one_of_the_tools(client):
    response = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=120, seed=2
    )
    assert response.choices[0].message.tool_calls[0].function.name in {"get_weather", "get_time"}


def test_tools_are_rendered_into_the_prompt(client):
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    rendered = "system\nTools: get_weather\n"  # plus <|im_start|> and <|im_end|>, one token each
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens + len(rendered) + 2


def test_a_conversation_with_tool_results_is_accepted(client):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert (
        client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=3)
        .choices[0]
        .message.role
        == "assistant"
    )


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "auto"},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch_rockets"}}},
        {"tools": [WEATHER], "tool_choice": "sometimes"},
    ],
)
def test_bad_tool_choice_gets_400(server, extra):
    response = httpx.post(f"{server.v1}/chat/completions", json={"messages": ASK, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tool_choice"


# ---- parsing ------------------------------------------------------------------------------------


def test_hermes_blocks_are_parsed_and_removed_from_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, {"get_weather"})
    assert (
        content == "Let me check."
        and calls[0].name == "get_weather"
        and json.loads(calls[0].arguments) == {"city": "Oslo"}
    )


def test_bare_json_call_with_parameters_is_parsed():
    content, calls = parse_tool_calls('{"name": "get_time", "parameters": {}}', {"get_time"})
    assert content is None and calls[0].name == "get_time" and calls[0].arguments == "{}"


@pytest.mark.parametrize(
    "text", ['{"name": "unknown", "arguments": {}}', "<tool_call>not json</tool_call>", "just words"]
)
def test_text_that_is_not_a_known_call_stays_content(text):
    assert parse_tool_calls(text, {"get_time"}) == (text, [])


def test_stream_sends_plain_text_at_once_and_holds_a_call():
    stream = ToolCallStream({"get_time"})
    assert stream.push("Hello ") == "Hello "
    assert stream.push("there <tool_") == "there "  # a partial marker is held back
    assert stream.push('call>{"name": "get_time", "arguments": {}}</tool_call>') == ""
    content, calls = stream.finish()
    assert content == "" and calls[0].name == "get_time"


def test_stream_releases_held_marker_prefix_that_was_not_a_call():
    stream = ToolCallStream({"get_time"})
    sent = stream.push("a <tool") + stream.push("box> b")
    content, calls = stream.finish()
    assert sent + content == "a <toolbox> b" and calls == []
