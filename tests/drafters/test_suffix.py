"""The suffix drafter: continuations of the longest matching suffix, within a request and across a
tenant's recent outputs, bounded, and never across tenants. Exactness lives in test_lossless.py."""

from __future__ import annotations

import torch

from engine.drafters.suffix import SuffixDrafter
from engine.outputs import ContinuationIndex, OutputCache
from engine.request import Request
from engine.sampling import SamplingParams
from tests.tiny import tiny_engine, tiny_llama

CPU = torch.device("cpu")


def proposed(drafter: SuffixDrafter, tokens: list[int], k: int = 8) -> list[int]:
    return drafter.propose(tokens, k, None).token_ids.tolist()


def test_the_longest_match_picks_the_most_frequent_continuation():
    index = ContinuationIndex(max_match=4)
    index.add([1, 2, 3, 9, 1, 2, 3, 9, 5, 2, 3, 7])
    assert index.longest_match([8, 1, 2, 3]) == (3, {9: 2})  # "1 2 3" was followed by 9 twice
    n, counts = index.longest_match([8, 2, 3])
    assert n == 2 and counts == {9: 2, 7: 1}
    assert index.longest_match([42]) == (0, None)


def test_the_longest_match_climbing_from_one_token_finds_what_a_search_of_every_length_finds():
    """``longest_match`` stops at the first length not indexed, which is exact only because the keys
    are closed under suffixes, through additions and evictions alike: checked against a search of
    every length, longest first, over random texts in a small vocabulary (many matches)."""
    import random

    rng = random.Random(0)
    for trial in range(100):
        index = ContinuationIndex(8)
        texts = [[rng.randrange(5) for _ in range(rng.randrange(2, 40))] for _ in range(4)]
        for text in texts:
            index.add(text)
        index.add(texts[trial % 4], sign=-1)  # an output evicted
        for _ in range(30):
            tail = tuple(rng.randrange(5) for _ in range(rng.randrange(1, 12)))[-8:]
            found = next(
                ((n, index.table[tail[-n:]]) for n in range(len(tail), 0, -1) if tail[-n:] in index.table), None
            )
            assert index.longest_match(list(tail)) == (found or (0, None))


def test_a_repeated_passage_is_drafted_and_the_length_follows_the_match():
    drafter = SuffixDrafter(CPU, None)
    drafter.begin([])
    passage = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    assert proposed(drafter, passage + [50] + passage[:6], k=8) == passage[6:] + [50] + passage[:3]
    drafter.begin([])
    # a one-token match drafts at most two tokens
    assert len(proposed(drafter, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1], k=8)) == 2
    assert drafter.propose([1, 2, 3], 4, None).probs is None  # deterministic: verified as one-hot


def test_an_offer_says_whether_its_first_token_was_the_only_one_seen_after_its_match():
    drafter = SuffixDrafter(CPU, None)
    drafter.begin([])
    assert drafter.offer([5, 6, 9, 1, 5, 6], 4)[0] == 9  # after 5 6, always 9
    assert drafter.match_length == 2 and not drafter.match_split
    drafter.begin([])
    assert drafter.offer([1, 7, 2, 7, 2, 7, 3, 8, 4, 7], 4)[0] == 2  # after 7: 2 twice, 3 once
    assert drafter.match_length == 1 and drafter.match_split
    assert drafter.offer([1, 7, 2, 7, 2, 7, 3, 8, 4, 42], 4) == [] and not drafter.match_split  # no match


def test_an_uncertain_continuation_is_not_drafted():
    drafter = SuffixDrafter(CPU, None)
    drafter.begin([])
    # after 7 came eleven different tokens once each: none reaches the probability cutoff (0.1)
    assert proposed(drafter, [t for follower in range(20, 31) for t in (7, follower)] + [7]) == []


def test_outputs_are_shared_within_a_tenant_and_never_across():
    cache = OutputCache(max_requests=8)
    drafter = SuffixDrafter(CPU, cache)
    answer = [30, 31, 32, 33, 34, 35, 36, 37]
    drafter.begin([1, 2], tenant="key-a/")
    drafter.propose([1, 2, *answer], 4, None)  # the request's own sequence is not shared by itself
    drafter.begin([3, 4], tenant="key-a/")
    assert proposed(drafter, [3, 4, 30, 31, 32], k=4) == []
    cache.add("key-a/", answer)  # what the engine remembers of an output its client received
    drafter.begin([3, 4], tenant="key-a/")
    assert proposed(drafter, [3, 4, 30, 31, 32], k=4) == [33, 34, 35, 36]
    drafter.begin([3, 4], tenant="key-b/")
    assert proposed(drafter, [3, 4, 30, 31, 32], k=4) == []
    assert cache.stats["tenants"] == 1


def test_the_shared_cache_is_bounded_and_forgets_the_oldest():
    cache = OutputCache(max_requests=2)
    for start in (100, 200, 300):
        cache.add("t", list(range(start, start + 5)))
    index = cache.index("t")
    assert index.longest_match([101])[1] is None and index.longest_match([301])[1] == {302: 1}
    assert cache.stats["requests"] == 2
    for start in (400, 500):
        cache.add("t", list(range(start, start + 5)))
    assert cache.index("t").size == 2 * (1 + 2 + 3 + 4)  # n-grams of the last two outputs only


def test_one_scopes_flood_evicts_its_own_outputs_first():
    cache = OutputCache(max_requests=4)
    cache.add("a", [1, 2, 3])
    for start in range(100, 160, 5):
        cache.add("b", list(range(start, start + 5)))
    assert cache.recent("a") == [[1, 2, 3]] and len(cache.recent("b")) == 3
    assert cache.index("a").longest_match([1, 2])[1] == {3: 1}


def test_global_matching_can_be_turned_off():
    engine = tiny_engine(tiny_llama(seed=1, vocab_size=64), None, drafter="suffix", suffix_global=False)
    assert engine.drafter("suffix").cache is None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = [t for o in engine.generate(Request("a", [5, 6, 7], params)) for t in o.token_ids]
    second = list(engine.generate(Request("b", [8, 9, *first[:4]], params)))
    assert second[-1].stats.drafter == "suffix"


def test_an_engine_remembers_only_what_it_is_told_reached_the_client():
    engine = tiny_engine(tiny_llama(seed=1, vocab_size=64), None, drafter="suffix")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = [t for o in engine.generate(Request("a", [5, 6, 7], params, tenant="t")) for t in o.token_ids]
    assert engine.outputs.stats["requests"] == 0  # generating alone adds nothing
    engine.remember("t", first[:6])  # the client received six tokens
    probe = Request("b", [9, *first[:3]], SamplingParams(max_tokens=4, temperature=0.0), tenant="t")
    assert list(engine.generate(probe))[-1].stats.drafted_tokens > 0  # a match within what was sent
    tail = first[7:10]
    assert all(first[i : i + 3] != tail for i in range(4))  # the tail does not recur in the sent part
    past = Request("c", [9, *tail], SamplingParams(max_tokens=4, temperature=0.0), tenant="t")
    assert list(engine.generate(past))[-1].stats.drafted_tokens == 0  # the unsent tail is unknown


def test_every_drafter_that_matches_outputs_reads_one_cache_bounded_in_total():
    engine = tiny_engine(tiny_llama(seed=1, vocab_size=64), tiny_llama(seed=2, vocab_size=64), suffix_cache_requests=3)
    suffix = engine.drafter("suffix")
    assert engine.drafter("auto").candidates["suffix"].cache is suffix.cache is engine.outputs
    assert engine.drafter("staged", ("suffix", "model")).stages[0].cache is engine.outputs
    for tenant in ("a", "b", "c", "d", "e"):
        engine.remember(tenant, [1, 2, 3, 4])
    assert engine.outputs.stats["requests"] == 3  # one bound for the server, not one per drafter
