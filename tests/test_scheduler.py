"""Many conversations at once (issue 50): requests take turns step by step in sequence slots, a
reused slot's prefix comes back from the host-memory prefix store, and nothing crosses a scope.
Every test runs the real engine on tiny models through the engine thread's client."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest

import engine.sampling as engine_sampling
from engine.async_engine import AsyncEngine
from engine.errors import ConfigError
from engine.factory import warm_up
from engine.request import Request
from engine.sampling import SamplingParams
from tests.test_lossless import ALPHA, PROMPT, VOCAB, chi_square_pvalue, exact_distribution
from tests.tiny import compiling_engine, perturbed_copy, random_eagle3_head, tiny_engine, tiny_llama

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


def serve(engine, batches: list[list[Request]], log: list | None = None) -> list[tuple[list[int], int]]:
    """Each batch's requests sent together through the engine thread; (tokens, cached_tokens) of
    each, in order. ``log`` collects (request id, tokens) per step in the order the steps ran."""

    async def one(client: AsyncEngine, request: Request) -> tuple[list[int], int]:
        tokens, cached = [], 0
        async for output in client.generate(request):
            tokens += output.token_ids
            cached = output.cached_tokens
            if log is not None and output.token_ids:
                log.append(request.request_id)
        return tokens, cached

    async def run() -> list[tuple[list[int], int]]:
        client = AsyncEngine(lambda: engine)
        await client.ready()
        results = []
        for batch in batches:
            results += await asyncio.gather(*(one(client, request) for request in batch))
        client.shutdown(timeout=10)
        return results

    return asyncio.run(run())


def alone(engine, request: Request) -> list[int]:
    return [t for output in engine.generate(request) for t in output.token_ids]


def pair(seed: int = 3, vocab: int = 96):
    target = tiny_llama(seed=seed, vocab_size=vocab)
    return target, perturbed_copy(target, noise=0.02, seed=seed + 1)


@pytest.mark.parametrize("draft_kv", ["own", "target"])
def test_four_interleaved_requests_each_get_the_text_they_get_alone(draft_kv):
    """Greedy and seeded, under four drafters, one prompt longer than a prefill chunk; the steps
    really alternate between the requests. With ``draft_kv`` "target" (a copy draft's default) the
    draft copies keys and values from the target's cache of each slot."""
    target, draft = pair()
    engine = tiny_engine(target, draft, max_num_seqs=4, prefill_chunk=8, draft_kv=draft_kv)
    prompts = [list(range(5, 45)), [7, 8, 9, 7, 8, 9, 7], [60, 61, 62, 63], [30, 31, 30, 31, 30]]
    drafters = ["model", "suffix", "auto", "staged"]
    requests = [
        Request(f"r{i}", prompt, params, drafter=drafter, tenant=f"t{i}")
        for i, (prompt, drafter, params) in enumerate(
            zip(prompts, drafters, [GREEDY, SEEDED, SEEDED, GREEDY], strict=True)
        )
    ]
    log: list[str] = []
    together = serve(engine, [requests], log)
    switches = sum(a != b for a, b in itertools.pairwise(log))
    assert switches >= 8, f"the requests did not take turns: {log}"
    for request, (tokens, _) in zip(requests, together, strict=True):
        assert tokens == alone(engine, Request("solo", request.prompt_ids, request.params, drafter=request.drafter))


def test_interleaved_samples_follow_the_targets_law(monkeypatch):
    """The chi-square suite's case through four interleaved streams: unseeded samples of two tokens."""
    target = tiny_llama(seed=0, vocab_size=VOCAB, init=0.12)
    draft = tiny_llama(seed=1, vocab_size=VOCAB, init=0.12)
    engine = tiny_engine(target, draft, num_draft_tokens=1, max_num_seqs=4)
    engine._seeds.manual_seed(99)
    params = SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True)
    monkeypatch.setattr(engine_sampling, "TOP_P_CANDIDATES", ())
    requests = [Request(f"s{i}", PROMPT, params, tenant=f"t{i % 4}") for i in range(800)]
    results = serve(engine, [requests[i : i + 4] for i in range(0, len(requests), 4)])
    counts = Counter(tuple(tokens) for tokens, _ in results)
    pvalue = chi_square_pvalue(counts, exact_distribution(target, params, 2))
    assert pvalue > ALPHA, f"interleaved samples differ from the target's distribution (p={pvalue:.2e})"


def test_a_short_request_is_answered_while_a_long_one_streams():
    target, draft = pair()
    engine = tiny_engine(target, draft, max_num_seqs=2, max_model_len=512)
    long = Request("long", [1, 2, 3], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True), tenant="a")
    short = Request("short", [4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), tenant="b")
    log: list[str] = []
    serve(engine, [[long, short]], log)
    finished_short = len(log) - log[::-1].index("short")
    assert log[finished_short:].count("long") > 50, "the short request waited for the long one"


def test_two_scopes_taking_turns_keep_their_own_slots():
    target, draft = pair()
    engine = tiny_engine(target, draft, max_num_seqs=2)
    doc_a, doc_b = list(range(10, 70)), list(range(20, 80))
    turns = [
        [Request(f"{who}{i}", [*doc, 90 + i], GREEDY, tenant=who)]
        for i in range(3)
        for who, doc in (("a", doc_a), ("b", doc_b))
    ]
    results = serve(engine, turns)
    assert [cached for _, cached in results] == [0, 0, len(doc_a), len(doc_b), len(doc_a), len(doc_b)]


def test_a_reused_slots_prefix_comes_back_from_the_store_and_nothing_crosses_scopes():
    """One slot: b's request takes a's slot, a's prefix goes to the store, a's next request
    restores it (whole blocks) and answers as a cold run does; b, cold, is restored nothing."""
    target, draft = pair()
    engine = tiny_engine(target, draft, max_num_seqs=1)
    doc = list(range(10, 80))  # 70 tokens: two whole blocks of 32
    first, other, again, cold_b = serve(
        engine,
        [
            [Request("a1", [*doc, 1], GREEDY, tenant="a")],
            [Request("b1", [*doc, 2], GREEDY, tenant="b")],
            [Request("a2", [*doc, 3], GREEDY, tenant="a")],
            [Request("b2", [*doc, 4], GREEDY, tenant="b2")],
        ],
    )
    assert first[1] == 0 and other[1] == 0 and cold_b[1] == 0
    assert again[1] >= 64 and engine.store.hits == 1 and engine.store.restored_tokens >= 64
    engine.store.capacity = 0  # the same request computed from scratch
    engine.reset()
    assert again[0] == alone(engine, Request("cold", [*doc, 3], GREEDY))


def test_a_scopes_blocks_survive_another_scopes_flood():
    target, _ = pair()
    engine = tiny_engine(target, None, max_num_seqs=1)
    block = engine.cache_bytes * 32 // engine.max_model_len  # one block of the target's keys and values
    engine.store.capacity, engine.store.scope_limit = 8 * block, 4 * block
    doc = list(range(10, 80))
    serve(engine, [[Request("a", [*doc, 1], GREEDY, tenant="a")]])
    flood = [[Request(f"f{i}", [i, *doc, i], GREEDY, tenant="flood")] for i in range(12)]
    serve(engine, [*flood, [Request("b", [1], GREEDY, tenant="b")]])
    assert engine.store.scope_bytes("a") == 2 * block and engine.store.scope_bytes("flood") <= 4 * block
    ((_, cached),) = serve(engine, [[Request("a2", [*doc, 2], GREEDY, tenant="a")]])
    assert cached >= 64


def test_a_new_scope_in_a_slot_finds_nothing_of_the_last_in_the_heads_cache():
    target = tiny_llama(seed=4, vocab_size=64, layers=4)
    head = random_eagle3_head(target, (0, 1, 3), seed=1, scale=2.0)
    engine = tiny_engine(target, None, drafter="eagle3", draft_head=str(head), max_num_seqs=1)
    prompt = list(range(3, 40))
    serve(engine, [[Request("a", prompt, GREEDY, tenant="a")]])
    heads = list(engine.drafters.resources.heads.values())
    assert heads and heads[0].cache.length > 0
    engine.admit(engine.slots.slots[0], "b", prompt)
    assert heads[0].cache.length == 0 and engine.target.cache.length == 0
    engine.slots.slots[0].busy = False


def test_slots_bound_by_copy_serve_as_slots_bound_by_swapping():
    """The binding a captured forward needs (its tensors keep their addresses)."""
    target, draft = pair()
    engine = tiny_engine(target, draft, max_num_seqs=3)
    engine.slots = type(engine.slots)(engine.slots.holders, 3, copy=True)
    requests = [Request(f"c{i}", list(range(i + 5, i + 30)), GREEDY, tenant=f"t{i}") for i in range(3)]
    together = serve(engine, [requests, requests])
    for request, (tokens, _) in zip(requests * 2, together, strict=True):
        assert tokens == alone(engine, Request("solo", request.prompt_ids, GREEDY, drafter="model"))
    assert [cached for _, cached in together[3:]] == [24, 24, 24]


def test_an_aborted_request_frees_its_slot():
    target, draft = pair()
    engine = tiny_engine(target, draft, max_num_seqs=1)

    async def run() -> list[int]:
        client = AsyncEngine(lambda: engine)
        await client.ready()
        leaving = client.generate(Request("x", [1, 2], SamplingParams(max_tokens=200, temperature=0.0), tenant="a"))
        await anext(leaving)
        await leaving.aclose()  # the client leaves
        tokens = [
            t async for output in client.generate(Request("y", [3, 4], GREEDY, tenant="b")) for t in output.token_ids
        ]
        client.shutdown(timeout=10)
        return tokens

    assert len(asyncio.run(run())) == GREEDY.max_tokens
    assert engine.slots.in_use == 0


def test_a_side_request_leaves_the_conversation_its_slot_or_the_store():
    """A chat front end's title request shares only the template's opening with the conversation:
    with a free slot it takes that one, even where the opening is most of its own short prompt (it
    would keep 8 of the 70 tokens the conversation's slot holds); with one slot, the conversation
    comes back from the store."""
    target, draft = pair()
    opening = list(range(1, 9))
    conversation = [*opening, *range(10, 70)]
    for title in ([*opening[:3], *range(80, 90)], [*opening, *range(80, 84)]):
        for slots, expected in ((2, len(conversation)), (1, 32 * (len(conversation) // 32))):
            engine = tiny_engine(target, draft, max_num_seqs=slots)
            turns = [("c1", conversation), ("title", title), ("c2", [*conversation, 5])]
            results = serve(engine, [[Request(rid, prompt, GREEDY, tenant="a")] for rid, prompt in turns])
            assert results[2][1] == expected, (slots, len(title))


def test_a_compiled_static_forward_serves_every_slot_by_copy():
    """Item 8 on CPU: a captured forward keeps its tensors' addresses, so slots bind by copy."""
    engine = compiling_engine(forward="compile", max_num_seqs=2)
    assert engine.slots.copy
    warm_up(engine)
    compiled = engine.compilations
    requests = [Request(f"g{i}", list(range(i + 5, i + 20)), GREEDY, drafter="model", tenant=f"t{i}") for i in range(2)]
    log: list[str] = []
    together = serve(engine, [requests], log)
    assert sum(a != b for a, b in itertools.pairwise(log)) >= 4
    for request, (tokens, _) in zip(requests, together, strict=True):
        assert tokens == alone(engine, Request("solo", request.prompt_ids, GREEDY, drafter="model"))
    assert engine.compilations == compiled  # no slot compiled anything again


def test_slots_and_a_store_that_cannot_fit_are_refused_in_one_line():
    target, _ = pair()
    with pytest.raises(ConfigError, match=r"4 sequence slots .* prefix store need .* lower --max-num-seqs"):
        tiny_engine(target, None, max_num_seqs=4, prefix_cache_gb=1e6)


def test_a_shutdown_ends_every_running_and_waiting_request():
    target, draft = pair()
    engine = tiny_engine(target, draft, max_num_seqs=2, max_model_len=512)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run() -> list[str | None]:
        client = AsyncEngine(lambda: engine)
        await client.ready()
        started = asyncio.Event()

        async def last_finish(i: int) -> str | None:
            last = None
            async for output in client.generate(Request(f"s{i}", [i + 1, 2, 3], long, tenant=f"t{i}")):
                started.set()
                last = output.finish_reason
            return last

        tasks = [asyncio.create_task(last_finish(i)) for i in range(3)]  # two run, the third waits
        await started.wait()
        await asyncio.sleep(0.05)
        await asyncio.to_thread(client.shutdown, 10)
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)  # a request left running would hang here

    assert asyncio.run(run()) == ["abort", "abort", "abort"]


def test_the_store_keeps_a_reused_slots_prompt_and_only_what_its_client_received():
    """A 40-token prompt and 60 generated tokens, of which the client received 30: the store keeps
    two whole blocks of prompt and delivered output (70 positions), not the first block alone (the
    prompt) nor a third that the undelivered tokens would complete."""
    target, draft = pair()
    engine = tiny_engine(target, draft, max_num_seqs=1)
    prompt, params = list(range(10, 50)), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        client = AsyncEngine(lambda: engine)
        await client.ready()
        tokens = [t async for o in client.generate(Request("a", prompt, params, tenant="a")) for t in o.token_ids]
        client.remember("a", tokens[:30], "a")
        async for _ in client.generate(Request("b", [1, 2], GREEDY, tenant="b")):  # takes a's slot
            pass
        client.shutdown(timeout=10)

    asyncio.run(run())
    block = engine.target.cache.nbytes * 32 // engine.max_model_len  # the target's keys and values
    assert engine.store.scope_bytes("a") == 2 * block
