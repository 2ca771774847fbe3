"""Reliability and security against real `specserve serve` processes on a tiny model: backpressure,
cancellation, timeouts, limits, engine faults, graceful shutdown, API keys, hostile input."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, start_server, stop_server
from tests.faults import fault_marker

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
ERROR_KEYS = {"message", "type", "param", "code"}
REQUESTS = int(os.environ.get("SPECSERVE_SOAK_REQUESTS", "500"))  # sequential requests for the RSS test


def _args(target: Path, *extra: str) -> list[str]:
    return ["--target", str(target), "--draft", "none", "--device", "cpu", "--served-model-name", "tiny", *extra]


@pytest.fixture(scope="module")
def guarded(tiny_model_dirs, tmp_path_factory):
    """API key on, a queue of 8, generous timeout; the fault hook on for the engine-fault tests."""
    target, _ = tiny_model_dirs
    server = start_server(
        _args(target, "--max-model-len", "256", "--max-queue", "8", "--drafter", "ngram"),
        tmp_path_factory.mktemp("guarded") / "server.log",
        env={"SPECSERVE_API_KEY": KEY},
        faults=True,
    )
    yield server
    stop_server(server)


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _rss_mb(server: Server) -> float:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


def _complete(server: Server, **body) -> httpx.Response:
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(f"{server.v1}/completions", json=body, headers=AUTH, timeout=60)


# ---- auth -------------------------------------------------------------------------------------


ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [104, 105]}),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_api_route_needs_the_key(guarded, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        response = httpx.request(method, guarded.url + path, json=body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert set(response.json()["error"]) == ERROR_KEYS
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.request(method, guarded.url + path, json=body, headers=AUTH).status_code == 200


def test_health_and_metrics_stay_open(guarded):
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200


def test_the_openai_sdk_sends_the_key(guarded):
    from openai import AuthenticationError, OpenAI

    assert OpenAI(base_url=guarded.v1, api_key=KEY).models.list().data[0].id == "tiny"
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=guarded.v1, api_key="nope", max_retries=0).models.list()


# ---- load and backpressure --------------------------------------------------------------------


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, str, dict]:
    async with client.stream("POST", url, json=body, headers=AUTH) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, response.text, dict(response.headers)
        text = ""
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += event["choices"][0]["text"] if event["choices"] else ""
        return 200, text, {}


def test_32_concurrent_streams_complete_correctly_or_get_429(guarded):
    body = {"prompt": "load test", "max_tokens": 160, "temperature": 0, "ignore_eos": True, "stream": True}
    expected = _complete(guarded, **{**body, "stream": False}).json()["choices"][0]["text"]

    async def run() -> list[tuple[int, str, dict]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60)) as client:
            return await asyncio.wait_for(
                asyncio.gather(*[_stream(client, f"{guarded.v1}/completions", body) for _ in range(32)]), 120
            )

    results = asyncio.run(run())  # wait_for: nothing may hang
    done = [text for status, text, _ in results if status == 200]
    refused = [(text, headers) for status, text, headers in results if status == 429]
    assert len(done) + len(refused) == 32, [status for status, _, _ in results]
    print(f"32 concurrent streams: {len(done)} completed, {len(refused)} refused with 429")
    assert all(text == expected for text in done)
    assert 9 <= len(done) < 32 and refused  # one running + 8 waiting at once, at least
    for text, headers in refused:
        assert json.loads(text)["error"]["code"] == "queue_full" and int(headers["retry-after"]) >= 1
    assert _complete(guarded).status_code == 200


def test_memory_does_not_grow_over_sequential_requests(guarded):
    with httpx.Client(headers=AUTH, timeout=60) as client:
        body = {"prompt": "memory", "max_tokens": 4, "temperature": 0.8}
        for index in range(REQUESTS):
            if index == REQUESTS // 10:
                after_50 = _rss_mb(guarded)
            assert client.post(f"{guarded.v1}/completions", json=body).status_code == 200
    after_500 = _rss_mb(guarded)
    print(f"RSS after {REQUESTS // 10} requests {after_50:.1f} MB, after {REQUESTS} {after_500:.1f} MB")
    assert after_500 <= after_50 * 1.05, (after_50, after_500)  # within 5% of its value after the first tenth


# ---- cancellation -----------------------------------------------------------------------------


def test_disconnected_streams_are_aborted_within_a_step(guarded):
    body = {"prompt": "abort me", "max_tokens": 240, "ignore_eos": True, "stream": True, "temperature": 0}
    started = time.perf_counter()
    plain = _complete(guarded, max_tokens=20, ignore_eos=True)
    baseline = time.perf_counter() - started
    assert plain.status_code == 200
    before = _metric(guarded, "specserve_abort_latency_seconds_count")
    for _ in range(20):
        with httpx.stream("POST", f"{guarded.v1}/completions", json=body, headers=AUTH, timeout=60) as response:
            for index, _line in enumerate(response.iter_lines()):
                if index >= 6:
                    break  # leave mid-stream
        deadline = time.monotonic() + 5
        while _metric(guarded, "specserve_running_requests") and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _metric(guarded, "specserve_running_requests") == 0
    aborted = _metric(guarded, "specserve_abort_latency_seconds_count") - before
    latency_sum = _metric(guarded, "specserve_abort_latency_seconds_sum")
    assert aborted == 20
    mean_abort = latency_sum / max(_metric(guarded, "specserve_abort_latency_seconds_count"), 1)
    print(f"abort latency: mean {mean_abort * 1e3:.1f} ms over {aborted:.0f} disconnects")
    # within one step: a step of this tiny model takes milliseconds
    assert latency_sum / max(_metric(guarded, "specserve_abort_latency_seconds_count"), 1) < 0.1
    started = time.perf_counter()
    assert _complete(guarded, max_tokens=20, ignore_eos=True).status_code == 200
    after = time.perf_counter() - started
    print(f"20-token request: {baseline * 1e3:.0f} ms before the disconnects, {after * 1e3:.0f} ms after")
    assert after < max(5 * baseline, 1.0)


FINISHED_BY_LENGTH = 'specserve_requests_total{endpoint="completions",finish_reason="length"}'


def test_a_non_streaming_client_that_gives_up_is_aborted(guarded):
    """The client leaves while its request generates. The tiny model writes its tokens in a few tenths
    of a second, so on a loaded host the request could finish before the client's leaving landed (all
    three attempts did in two CI runs, once under the server's ngram drafter, once with the target
    alone): its sixth forward now stalls (the fault hook's ``stall``), and the client leaves while
    it does. An attempt that still finished first proves nothing and is made again (up to three)."""
    prompt = f"give up {fault_marker('stall', 5)}"
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    body = json.dumps({**body, "speculative": {"drafter": "none"}}).encode()
    host, port = guarded.url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    for _ in range(3):
        before = _metric(guarded, "specserve_abort_latency_seconds_count")
        finished = _metric(guarded, FINISHED_BY_LENGTH)
        with socket.create_connection((host, int(port))) as client:
            client.sendall(head.encode() + body)
            deadline = time.monotonic() + 10
            while not _metric(guarded, "specserve_running_requests") and time.monotonic() < deadline:
                time.sleep(0.005)
            assert _metric(guarded, "specserve_running_requests") == 1  # generating now; the client gives up
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _metric(guarded, "specserve_running_requests"):
            time.sleep(0.01)
        if _metric(guarded, FINISHED_BY_LENGTH) == finished:  # the request did not run to its end
            break
    assert _metric(guarded, FINISHED_BY_LENGTH) == finished, "every attempt finished before the client left"
    deadline = time.monotonic() + 5
    while _metric(guarded, "specserve_abort_latency_seconds_count") == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _metric(guarded, "specserve_abort_latency_seconds_count") == before + 1
    assert _metric(guarded, "specserve_running_requests") == 0


# ---- engine faults ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_a_fault_in_the_forward_pass_fails_only_that_request(guarded, kind):
    failed = _complete(guarded, prompt=f"hello {fault_marker(kind, 1)}", max_tokens=6)
    assert failed.status_code == 500 and set(failed.json()["error"]) == ERROR_KEYS
    expected = "InjectedFault" if kind == "raise" else "NonFiniteProbabilities"
    assert expected in failed.json()["error"]["message"]
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert _complete(guarded, max_tokens=5, ignore_eos=True).json()["usage"]["completion_tokens"] == 5


# ---- limits and hostile input -----------------------------------------------------------------


def _post_raw(server: Server, content: bytes, path: str = "/v1/completions") -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


HOSTILE_BODIES = {
    "malformed json": b'{"prompt": "x", "max_tokens": ',
    "not an object": b"[1, 2, 3]",
    "invalid utf-8": b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}',
    "NaN temperature": b'{"prompt": "x", "temperature": NaN}',
    "infinite top_p": b'{"prompt": "x", "top_p": Infinity}',
    "huge max_tokens": b'{"prompt": "x", "max_tokens": 1000000000000000000000000000000}',
    "float max_tokens": b'{"prompt": "x", "max_tokens": 1e30}',
    "negative max_tokens": b'{"prompt": "x", "max_tokens": -1}',
    "huge seed": b'{"prompt": "x", "seed": 1267650600228229401496703205376}',
    "huge temperature": b'{"prompt": "x", "temperature": 1e308}',
    "wrong type prompt": b'{"prompt": {"a": 1}}',
    "wrong type n": b'{"prompt": "x", "n": "many"}',
    "negative token id": b'{"prompt": [-5, 3]}',
    "out of range token": b'{"prompt": [99999999]}',
    "empty prompt": b'{"prompt": ""}',
    "too many prompts": json.dumps({"prompt": ["x"] * 65}).encode(),
    "too many stops": json.dumps({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}).encode(),
    "n too large": json.dumps({"prompt": "x", "n": 17}).encode(),
    "prompts x n too large": json.dumps({"prompt": ["x"] * 10, "n": 10}).encode(),
    "too many logit_bias": json.dumps({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}).encode(),
    "max_tokens beyond context": json.dumps({"prompt": "x", "max_tokens": 10_000}).encode(),
    "unknown drafter path": json.dumps({"prompt": "x", "speculative": {"drafter": "/etc/passwd"}}).encode(),
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_bodies_get_a_400_with_the_openai_error_shape(guarded, name):
    response = _post_raw(guarded, HOSTILE_BODIES[name])
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == ERROR_KEYS
    assert httpx.get(f"{guarded.url}/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["x"] * 65}, "prompt"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ],
)
def test_each_limit_names_its_param(guarded, body, param):
    response = _post_raw(guarded, json.dumps(body).encode())
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_10_mb_body_is_refused_with_or_without_content_length(guarded):
    big = json.dumps({"prompt": "x" * 10_000_000}).encode()
    response = _post_raw(guarded, big)
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"

    def chunks():  # no Content-Length: the limit is counted while reading
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    headers = {**AUTH, "Content-Type": "application/json"}
    response = httpx.post(f"{guarded.v1}/completions", content=chunks(), headers=headers, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "request_too_large"
    assert _complete(guarded).status_code == 200


def test_prompts_of_raw_special_tokens_are_just_text(guarded):
    for prompt in ["</s><s><unk>", "<|im_start|>system\n<|im_end|>", "\x00\x01\x02"]:
        response = _complete(guarded, prompt=prompt, max_tokens=3)
        assert response.status_code == 200, response.text
    chat = httpx.post(
        f"{guarded.v1}/chat/completions",
        json={"messages": [{"role": "user", "content": "</s>" * 20}], "max_tokens": 3},
        headers=AUTH,
    )
    assert chat.status_code == 200


# ---- timeouts, shutdown and engine death: servers of their own ---------------------------------


@pytest.fixture
def fragile(tiny_model_dirs, tmp_path):
    target, _ = tiny_model_dirs
    server = start_server(
        _args(target, "--max-model-len", "4096", "--request-timeout", "0.5"),
        tmp_path / "server.log",
        faults=True,
    )
    yield server
    stop_server(server)


@pytest.fixture
def draining(tiny_model_dirs, tmp_path):
    target, _ = tiny_model_dirs
    server = start_server(_args(target, "--max-model-len", "1024", "--shutdown-timeout", "10"), tmp_path / "server.log")
    yield server
    stop_server(server)


def test_the_request_timeout_ends_generation_with_a_clear_error(fragile):
    long = {"prompt": "slow", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    started = time.perf_counter()
    response = httpx.post(f"{fragile.v1}/completions", json=long, timeout=30)
    assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
    assert time.perf_counter() - started < 3
    with httpx.stream("POST", f"{fragile.v1}/completions", json={**long, "stream": True}, timeout=30) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
    quick = httpx.post(f"{fragile.v1}/completions", json={"prompt": "next", "max_tokens": 4}, timeout=30)
    assert quick.status_code == 200  # the engine moved on


def test_sigterm_under_load_finishes_in_flight_streams_and_exits_0(draining):
    body = {"prompt": "drain", "max_tokens": 300, "ignore_eos": True, "stream": True, "temperature": 0}

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(timeout=30) as client:
            first_chunk = asyncio.Event()
            streams = [
                asyncio.create_task(_stream_anon(client, f"{draining.v1}/completions", body, first_chunk))
                for _ in range(3)
            ]
            await asyncio.wait_for(first_chunk.wait(), 10)
            await asyncio.sleep(0.1)  # all three are in: one generating, two waiting
            draining.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)  # the listener stays open while the server drains
            late = (await client.post(f"{draining.v1}/completions", json={"prompt": "late"})).status_code
            health = (await client.get(f"{draining.url}/health")).status_code
            return await asyncio.gather(*streams), (late, health)

    finished, (late, health) = asyncio.run(run())
    assert all(status == 200 and tokens > 0 for status, tokens in finished), finished  # clean [DONE] ends
    assert len({tokens for _, tokens in finished}) == 1  # the same greedy text, in full, for all three
    assert late == 503 and health == 503
    assert draining.process.wait(20) == 0


@pytest.fixture
def hurried(tiny_model_dirs, tmp_path):
    """A grace period far shorter than a 4,000-token stream."""
    target, _ = tiny_model_dirs
    server = start_server(
        _args(target, "--max-model-len", "4096", "--shutdown-timeout", "0.5"), tmp_path / "server.log"
    )
    yield server
    stop_server(server)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stream_cut_by_shutdown_ends_with_an_error_event_and_done(hurried, sig):
    body = {"prompt": "long", "max_tokens": 4000, "ignore_eos": True, "stream": True, "temperature": 0}
    events, health = [], []
    with httpx.stream("POST", f"{hurried.v1}/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                hurried.process.send_signal(sig)
                time.sleep(0.1)
                health.append(httpx.get(f"{hurried.url}/health", timeout=5).status_code)  # 503, not refused
    assert health == [503]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "did not finish within 0.5 s" in error["message"]
    assert hurried.process.wait(20) == 0
    log = hurried.log.read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "Cancel" not in log, log[-3000:]


async def _stream_anon(client: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event) -> tuple[int, int]:
    """(status, tokens received) for a stream that ended with [DONE] and no error, else (status, -1)."""
    tokens, lines = 0, []
    async with client.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line)
                first.set()
                tokens += line.startswith('data: {"id"') and '"text":' in line
    clean = bool(lines) and lines[-1] == "data: [DONE]" and '"error"' not in lines[-2]
    return response.status_code, tokens if clean else -1


def test_when_the_engine_thread_dies_requests_fail_fast_and_the_process_exits_nonzero(fragile):
    response = httpx.post(
        f"{fragile.v1}/completions",
        json={"prompt": f"die {fault_marker('kill', 1)}", "max_tokens": 8},
        timeout=30,
    )
    assert response.status_code == 503 and set(response.json()["error"]) == ERROR_KEYS
    assert fragile.process.wait(20) == 3
    assert not os.path.exists(f"/proc/{fragile.process.pid}/status") or fragile.process.returncode == 3
