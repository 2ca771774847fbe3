"""Tenants that are real (issue 27): what the server keeps across requests (the KV prefix, recent
outputs) is shared only within one API key's tenant, narrowed by user and cache_salt; only what a
client received is kept; and one bounded cache serves every drafter. Proven on a live server with
the reviewer's probe, and in the engine."""

from __future__ import annotations

import httpx
import pytest

from engine.config import ConfigError
from engine.request import Request
from engine.sampling import SamplingParams
from server.tenants import Tenancy, is_loopback
from tests.conftest import start_server, stop_server
from tests.tiny import byte_tokenizer, tiny_engine, tiny_llama

KEYS = {"alice": "key-for-alice", "bob": "key-for-bob", "carol": "key-for-carol"}
TOKENIZER = byte_tokenizer()
PRINTABLE = {TOKENIZER(chr(c)).input_ids[0] for c in range(32, 127)}
# every other token banned: outputs are printable text, so their token ids read back from the text
ASCII_ONLY = {str(token): -100 for token in range(len(TOKENIZER)) if token not in PRINTABLE}
COMPARED = ("drafter", "drafted_tokens", "accepted_tokens", "target_forwards", "accepted_per_position")


# ---- who shares what ----------------------------------------------------------------------------


def test_keys_name_tenants_from_flags_and_a_file(tmp_path):
    listing = tmp_path / "keys"
    listing.write_text("# tenants\nkey-b:bob\n\nkey-c\n")
    tenancy = Tenancy.from_settings(["key-a:alice"], str(listing), "auto", "0.0.0.0")
    assert tenancy.tenant_of("Bearer key-a") == "alice" and tenancy.tenant_of("Bearer key-b") == "bob"
    assert tenancy.tenant_of("Bearer key-c").startswith("key-") and "key-c" not in tenancy.tenant_of("Bearer key-c")
    assert tenancy.tenant_of("Bearer nope") is None and tenancy.tenant_of(None) is None
    assert tenancy.share  # within each key
    with pytest.raises(ConfigError, match="given twice"):
        Tenancy.from_settings(["k:a", "k:b"], None, "auto", "127.0.0.1")
    with pytest.raises(ConfigError, match="no file"):
        Tenancy.from_settings([], str(tmp_path / "missing"), "auto", "127.0.0.1")


def test_user_and_cache_salt_only_narrow_a_tenants_scope():
    tenancy = Tenancy.from_settings(["key-a:alice", "key-b:bob"], None, "auto", "127.0.0.1")
    alice = tenancy.scope("alice", None, None)
    assert tenancy.scope("alice", None, None) == alice != tenancy.scope("bob", None, None)
    assert tenancy.scope("alice", "u1", None) != alice != tenancy.scope("alice", None, "salt")
    # a user or salt that spells another tenant's scope cannot reach it
    assert tenancy.scope("alice", "\x1fbob", None) != tenancy.scope("bob", None, None)


@pytest.mark.parametrize(
    "host,share,expected",
    [
        ("127.0.0.1", "auto", True),
        ("localhost", "auto", True),
        ("0.0.0.0", "auto", False),
        ("0.0.0.0", "on", True),
        ("127.0.0.1", "off", False),
    ],
)
def test_without_keys_sharing_follows_the_bind_address(host, share, expected):
    tenancy = Tenancy.from_settings([], None, share, host)
    assert tenancy.share is expected and tenancy.tenant_of(None) == ""
    first, second = tenancy.scope("", None, None), tenancy.scope("", None, None)
    assert (first == second) is expected  # off: every request a scope of its own
    assert ("shared by all clients" if expected else "shared by no two requests") in tenancy.describe()
    assert is_loopback("::1") and not is_loopback("10.0.0.1")


def test_the_kv_prefix_is_reused_only_within_a_scope():
    engine = tiny_engine(tiny_llama(seed=1, vocab_size=64), None)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = list(range(1, 40))

    def cached(tenant: str, extra: int) -> int:
        return list(engine.generate(Request("r", [*prompt, extra], params, tenant=tenant)))[-1].cached_tokens

    assert cached("alice", 50) == 0
    assert cached("bob", 51) == 0  # alice's prefix is recomputed, not reused
    assert cached("bob", 52) == len(prompt)  # within bob, as before
    assert cached("alice", 53) == 0  # and bob's is not alice's


# ---- on a live server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tiny_model_dirs, tmp_path_factory):
    target, _ = tiny_model_dirs
    folder = tmp_path_factory.mktemp("tenants")
    listing = folder / "keys"
    listing.write_text(f"{KEYS['bob']}:bob\n{KEYS['carol']}:carol\n")
    args = ["--target", str(target), "--draft", "none", "--device", "cpu", "--served-model-name", "tiny"]
    args += ["--max-model-len", "512", "--api-key", f"{KEYS['alice']}:alice", "--api-key-file", str(listing)]
    server = start_server(args, folder / "server.log")
    yield server
    stop_server(server)


def complete(server, tenant: str, prompt=None, **body) -> dict:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    request = {"temperature": 0, "speculative": {"drafter": "suffix"}, **body}
    if prompt is not None:
        request["prompt"] = prompt
    response = httpx.post(f"{server.v1}/completions", json=request, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def speculation(reply: dict) -> dict:
    return {key: reply["usage"]["speculative"][key] for key in COMPARED}


def secret_output(server, tenant: str, **body) -> list[int]:
    """A greedy answer the tenant received, as token ids (its text is printable, so it reads back)."""
    reply = complete(
        server, tenant, "Repeat exactly: the vault code", max_tokens=40, ignore_eos=True, logit_bias=ASCII_ONLY, **body
    )
    return TOKENIZER(reply["choices"][0]["text"], add_special_tokens=False).input_ids


def probe(server, tenant: str, guess: list[int], **body) -> dict:
    """The reviewer's probe: a prompt ending in a guess at another's output; the suffix drafter's
    counts would say whether the guess continues something the server kept."""
    memo = TOKENIZER("Memo. ", add_special_tokens=False).input_ids
    return speculation(complete(server, tenant, [*memo, *guess], max_tokens=6, **body))


def test_the_reviewers_probe_learns_nothing_across_keys_or_salts(keyed):
    """Each probe is the first in its scope (its own user): a scope also keeps its own probes' outputs."""
    secret = secret_output(keyed, "alice")
    right = secret[:12]
    wrong = [*secret[:11], next(t for t in PRINTABLE if t not in secret)]
    fresh = probe(keyed, "carol", right, user="p1")  # a scope that never saw anything
    assert probe(keyed, "bob", right, user="p2") == fresh
    assert probe(keyed, "bob", wrong, user="p3") == probe(keyed, "carol", wrong, user="p4")
    assert probe(keyed, "alice", right, cache_salt="other") == fresh  # a salt narrows within a key
    # the control: in alice's own scope the same probe does find her output
    assert probe(keyed, "alice", right)["drafted_tokens"] > fresh["drafted_tokens"]


def test_cached_tokens_is_zero_for_a_prefix_another_key_computed(keyed):
    document = "A long shared system prompt with private documents in it. " * 4
    first = complete(keyed, "alice", document + "Question one?", max_tokens=2)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    other = complete(keyed, "bob", document + "Question two?", max_tokens=2)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # bob's request ran in another slot: alice's prefix is still hers, and only hers
    again = complete(keyed, "alice", document + "Question three?", max_tokens=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(document)


def test_a_stop_strings_unsent_tail_never_becomes_a_match(keyed):
    """A scope whose request ended at a stop string knows what one that ended by length at the same
    token knows, and nothing of the tokens the engine computed past it."""
    whole = secret_output(keyed, "carol", user="reference")  # the whole answer, kept in its own scope
    text = TOKENIZER.decode(whole)
    cut = next(p for p in range(12, 24) if text.index(text[p : p + 3]) == p)  # a stop string's first place
    question = {"prompt": "Repeat exactly: the vault code", "ignore_eos": True, "logit_bias": ASCII_ONLY}
    stopped = complete(keyed, "carol", max_tokens=40, stop=text[cut : cut + 3], user="stopped", **question)
    assert stopped["choices"][0]["text"] == text[:cut]
    assert stopped["usage"]["completion_tokens"] == cut + 3  # the stop string's tokens count, as in OpenAI's API
    complete(keyed, "carol", max_tokens=cut + 3, user="by-length", **question)  # the same tokens, no tail
    complete(keyed, "carol", max_tokens=40, user="whole", **question)  # the same answer, tail and all
    before_tail = whole[cut - 3 : cut + 3]  # what would follow it is the tail the client never received
    # each the first probe in its scope
    stopped, by_length, tail_known = (
        probe(keyed, "carol", before_tail, user=u) for u in ("stopped", "by-length", "whole")
    )
    assert stopped == by_length
    assert tail_known != by_length  # the control: a scope that received the tail shows it


def test_a_key_the_server_did_not_issue_is_refused(keyed):
    response = httpx.post(
        f"{keyed.v1}/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer key-for-mallory"}
    )
    assert response.status_code == 401
    assert "API key required (3 tenants)" in keyed.log.read_text()  # the start-up line says who shares what


def test_a_server_that_shares_nothing_reuses_no_prefix(tiny_model_dirs, tmp_path):
    target, _ = tiny_model_dirs
    args = ["--target", str(target), "--draft", "none", "--device", "cpu", "--max-model-len", "256"]
    server = start_server([*args, "--share-cache", "off"], tmp_path / "server.log")
    try:
        prompt = "the same prompt, sent twice by two clients"
        for _ in range(2):
            body = {"prompt": prompt, "max_tokens": 2}
            reply = httpx.post(f"{server.v1}/completions", json=body, timeout=60).json()
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert "caches shared by no two requests" in server.log.read_text()
    finally:
        stop_server(server)


def test_only_the_tokens_a_client_received_are_remembered():
    """The serving core over a real engine thread: a stop string inside a run of accepted drafts
    (the engine computed tokens past it), and a client that leaves mid-stream. What the engine keeps
    is exactly what went out, never the tokens after."""
    import asyncio
    import copy

    from engine.async_engine import AsyncEngine
    from server.completions import CompletionsServing
    from server.metrics import Metrics
    from server.protocol import CompletionRequest
    from server.serving import ServingCore

    target = tiny_llama(seed=3, vocab_size=len(TOKENIZER), init=0.5)
    engine = tiny_engine(target, copy.deepcopy(target), num_draft_tokens=4)  # every draft accepted: 5-token steps
    ascii_only = {int(token): bias for token, bias in ASCII_ONLY.items()}
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias=ascii_only)
    reference = [t for output in engine.generate(Request("r", [65, 66, 67], params)) for t in output.token_ids]
    text = TOKENIZER.decode(reference)
    cut = next(p for p in range(6, 20) if text.index(text[p : p + 2]) == p)  # a stop string's first place
    question = {
        "prompt": [65, 66, 67],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": ASCII_ONLY,
    }

    async def run() -> str:
        client = AsyncEngine(lambda: engine)
        await client.ready()
        completions = CompletionsServing(ServingCore(client, TOKENIZER, "tiny", Metrics(queue_depth=lambda: 0)))
        stopped = CompletionRequest(**question, stop=text[cut : cut + 2])
        stopped.within("stopped")
        reply = await completions.create(stopped)
        assert reply.choices[0].text == text[:cut] and reply.usage.completion_tokens == cut + 2
        leaving = CompletionRequest(**question, stream=True)
        leaving.within("left")
        chunks, received = await completions.stream(leaving), []
        async for chunk in chunks:
            received.append(chunk.choices[0].text)
            if len(received) == 7:
                break  # the client leaves
        await chunks.aclose()
        last = CompletionRequest(prompt=[1, 2], max_tokens=1)  # the engine takes what to remember before it
        last.within("other")
        await completions.create(last)
        client.shutdown(timeout=5)
        return "".join(received)

    streamed = asyncio.run(run())
    assert engine.outputs.recent("stopped") == [reference[: cut + 2]]  # the stop string's tokens, not the step's rest
    left = engine.outputs.recent("left")
    assert len(left) == 1 and TOKENIZER.decode(left[0]) == streamed and len(left[0]) < 40  # what it received, no more
