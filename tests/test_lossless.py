"""Speculative decoding samples exactly from the target: statistically at temperature 1, token for
token at temperature 0. A tiny random target is drafted by a different tiny random model."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from engine.engine import Request
from engine.sampling import RequestSampler, SamplingParams
from engine.stats import SpecStats
from tests.tiny import DRAFTER_SETUPS, perturbed_copy, setup_engine, tiny_engine, tiny_llama

VOCAB = 8
PROMPT = [1, 5, 2, 7, 1, 5]  # repeats, so n-gram lookup has something to propose
SAMPLES = 3000
ALPHA = 1e-3  # a correct sampler fails this by chance once in a thousand runs; the seeds are fixed


@pytest.fixture(scope="module")
def models():
    # Spread-out but clearly different distributions (TV about 0.4): a sampler bug shifts the output a lot.
    target = tiny_llama(seed=0, vocab_size=VOCAB, init=0.12)
    draft = tiny_llama(seed=1, vocab_size=VOCAB, init=0.12)
    return target, draft


@torch.inference_mode()
def exact_distribution(model, params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """P(continuation) for every continuation of ``length`` tokens, by running the model alone."""
    result = {}
    for continuation in itertools.product(range(VOCAB), repeat=length):
        sampler = RequestSampler(params, VOCAB, torch.device("cpu"), PROMPT, seed=0)
        prob = 1.0
        for i, token in enumerate(continuation):
            logits = model(torch.tensor([PROMPT + list(continuation[:i])])).logits[0, -1:]  # [1, V]
            prob *= float(sampler.probs(logits)[0, token])
            sampler.commit([token])
        result[continuation] = prob
    return result


def sample_continuations(engine, params: SamplingParams, count: int) -> tuple[Counter, SpecStats]:
    counts: Counter = Counter()
    total = SpecStats()
    for i in range(count):
        tokens = []
        for output in engine.generate(Request(str(i), PROMPT, params)):
            tokens += output.token_ids
        counts[tuple(tokens)] += 1
        total.add(output.stats)
    return counts, total


def chi_square_pvalue(counts: Counter, expected: dict[tuple[int, ...], float]) -> float:
    total = sum(counts.values())
    observed, wanted, rest_observed, rest_wanted = [], [], 0, 0.0
    for outcome, prob in expected.items():
        if prob * total >= 5:
            observed.append(counts[outcome])
            wanted.append(prob * total)
        else:  # pool rare outcomes so the chi-square approximation holds
            rest_observed += counts[outcome]
            rest_wanted += prob * total
    if rest_wanted > 0:
        observed.append(rest_observed)
        wanted.append(rest_wanted)
    else:
        assert rest_observed == 0, "sampled a continuation the target gives probability zero"
    scale = total / sum(wanted)  # float32 probabilities sum to 1 only up to rounding
    wanted = [value * scale for value in wanted]
    return float(chisquare(observed, wanted).pvalue)


CASES = [
    pytest.param(2, 1, dict(temperature=1.0), id="2tok-plain"),
    pytest.param(2, 1, dict(temperature=0.8, top_k=4), id="2tok-topk"),
    pytest.param(2, 1, dict(temperature=1.0, top_p=0.8), id="2tok-topp"),
    pytest.param(3, 2, dict(temperature=1.0, top_k=5, top_p=0.9), id="3tok-topk-topp"),
    pytest.param(3, 2, dict(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.3), id="3tok-penalties"),
]
# The model drafter runs every case; the others run two that cover chains and history. Medusa drafts
# from the second step on (it needs the target's hidden state), so it needs three-token continuations.
CASES_FOR = {"medusa": ("3tok-topk-topp", "3tok-penalties")}
MATRIX = [
    pytest.param(setup, *case.values, id=f"{setup}-{case.id}")
    for setup in DRAFTER_SETUPS
    for case in CASES
    if setup == "model" or case.id in CASES_FOR.get(setup, ("2tok-topk", "3tok-penalties"))
]


@pytest.mark.parametrize("setup,length,num_draft_tokens,sampling", MATRIX)
def test_speculative_samples_match_target_distribution(models, setup, length, num_draft_tokens, sampling):
    target, draft = models
    engine = setup_engine(setup, target, draft, num_draft_tokens=num_draft_tokens)
    engine._seeds.manual_seed(1234)
    params = SamplingParams(max_tokens=length, **sampling)
    counts, stats = sample_continuations(engine, params, SAMPLES)
    assert stats.drafted_tokens > 0  # the drafter really proposed, so the sampler was exercised
    pvalue = chi_square_pvalue(counts, exact_distribution(target, params, length))
    assert pvalue > ALPHA, f"speculative samples differ from the target's distribution (p={pvalue:.2e})"


def test_chi_square_rejects_sampling_from_the_draft(models):
    """Control: the same test must fail for samples drawn from the draft's distribution."""
    target, draft = models
    params = SamplingParams(max_tokens=2, temperature=1.0)
    target_dist = exact_distribution(target, params, 2)
    draft_dist = exact_distribution(draft, params, 2)
    total_variation = 0.5 * sum(abs(target_dist[o] - draft_dist[o]) for o in target_dist)
    assert total_variation > 0.2  # the models really differ
    draft_only = tiny_engine(draft, None)
    draft_only._seeds.manual_seed(99)
    counts, _ = sample_continuations(draft_only, params, SAMPLES)
    assert chi_square_pvalue(counts, target_dist) < ALPHA


def test_acceptance_is_partial_so_both_branches_run(models):
    target, draft = models
    engine = tiny_engine(target, draft, num_draft_tokens=3)
    stats = None
    for i in range(50):
        for output in engine.generate(Request(str(i), PROMPT, SamplingParams(max_tokens=8))):
            stats = output.stats
        assert stats is not None
    assert 0 < stats.accepted_tokens < stats.drafted_tokens


# ---- temperature 0 -----------------------------------------------------------------------------


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Target-only greedy decoding with the stock Hugging Face forward and no cache at all."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def run(engine, prompt, params) -> list[int]:
    return [token for output in engine.generate(Request("r", prompt, params)) for token in output.token_ids]


@pytest.mark.parametrize("num_draft_tokens", [1, 2, 4, 7])
@pytest.mark.parametrize("setup", list(DRAFTER_SETUPS))
def test_greedy_speculative_equals_target_greedy(setup, num_draft_tokens):
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    draft = perturbed_copy(target, noise=0.05, seed=num_draft_tokens)  # agrees often, not always
    engine = setup_engine(setup, target, draft, num_draft_tokens=num_draft_tokens)
    generator = torch.Generator().manual_seed(num_draft_tokens)
    total = SpecStats()
    for _ in range(8):
        chunk = torch.randint(
            0, 96, (int(torch.randint(2, 8, (1,), generator=generator)),), generator=generator
        ).tolist()
        prompt = chunk + [5] + chunk  # a repeat gives n-gram lookup material
        expected = greedy_reference(target, prompt, 24)
        outputs = list(engine.generate(Request("g", prompt, SamplingParams(max_tokens=24, temperature=0.0))))
        assert [t for o in outputs for t in o.token_ids] == expected
        total.add(outputs[-1].stats)
    assert total.drafted_tokens > 0 and total.accepted_tokens > 0


def test_greedy_with_a_draft_that_agrees_accepts_everything():
    target = tiny_llama(seed=3, vocab_size=96)
    engine = tiny_engine(target, tiny_llama(seed=3, vocab_size=96), num_draft_tokens=4)
    outputs = list(engine.generate(Request("a", [1, 2, 3], SamplingParams(max_tokens=21, temperature=0.0))))
    stats = outputs[-1].stats
    assert stats.accepted_tokens == stats.drafted_tokens == 16 and stats.target_forwards == 5
    assert [t for o in outputs for t in o.token_ids] == greedy_reference(target, [1, 2, 3], 21)


def test_greedy_penalties_use_each_positions_own_prefix():
    """Penalties depend on history: drafted positions must see the drafts before them."""
    target = tiny_llama(seed=5, vocab_size=32, init=0.1)
    draft = tiny_llama(seed=5, vocab_size=32, init=0.1)  # same weights: drafts agree unless penalties are misapplied
    params = SamplingParams(
        max_tokens=30, temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5
    )
    speculative = run(tiny_engine(target, draft, num_draft_tokens=5), [4, 4, 9], params)
    alone = run(tiny_engine(target, None), [4, 4, 9], params)
    assert speculative == alone
    assert len(set(alone)) > 5  # the penalties are doing something


def test_eos_and_max_tokens_end_generation():
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    expected = greedy_reference(target, [5, 6], 20)
    eos = expected[6]
    engine = tiny_engine(target, perturbed_copy(target, noise=0.05, seed=0), eos={eos})
    outputs = list(engine.generate(Request("e", [5, 6], SamplingParams(max_tokens=20, temperature=0.0))))
    tokens = [t for o in outputs for t in o.token_ids]
    assert tokens == expected[: expected.index(eos) + 1] and outputs[-1].finish_reason == "stop"
    outputs = list(
        engine.generate(Request("l", [5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    )
    assert len([t for o in outputs for t in o.token_ids]) == 5 and outputs[-1].finish_reason == "length"
