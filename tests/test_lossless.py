"""Speculative decoding samples exactly from the target: statistically at temperature 1, token for
token at temperature 0. A tiny random target is drafted by a different tiny random model."""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

import engine.sampling as engine_sampling
from engine.model.model import CausalLM
from engine.request import Request
from engine.sampling import RequestSampler, SamplingParams
from engine.stats import SpecStats
from tests.tiny import DEVICE_PATH_SETUPS, DRAFTER_SETUPS, perturbed_copy, setup_engine, tiny_engine, tiny_llama

VOCAB = 8
PROMPT = [1, 5, 2, 7, 1, 5]  # repeats, so n-gram lookup has something to propose
SAMPLES = 1200  # enough: replacing the residual max(0, p - q) by p is still rejected (p < 1e-9 at 1,500)
ALPHA = 1e-3  # a correct sampler fails this by chance once in a thousand runs; the seeds are fixed


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Half precision runs the drafters the issue names (and target-only, the control below); float32 runs all.
HALF_PRECISION_SETUPS = ("model", "ngram", "staged-ngram-model")
UNTRAINED_HEADS = ("eagle3", "eagle3-compiled")  # random weights: exactness is the point, not acceptance


@pytest.fixture(scope="module")
def model_pairs():
    # Spread-out but clearly different distributions (TV about 0.4): a sampler bug shifts the output a lot.
    target = tiny_llama(seed=0, vocab_size=VOCAB, init=0.12)
    draft = tiny_llama(seed=1, vocab_size=VOCAB, init=0.12)
    return {name: (copy.deepcopy(target).to(dtype), copy.deepcopy(draft).to(dtype)) for name, dtype in DTYPES.items()}


@pytest.fixture(scope="module")
def models(model_pairs):
    return model_pairs["float32"]


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
CASES_FOR = {
    "medusa": ("3tok-topk-topp", "3tok-penalties"),
    "suffix": ("2tok-topk",),  # deterministic proposals, verified one-hot like ngram (which runs both)
    # where the draft's keys and values come from changes q, not how it is used: one case each
    "model-target-kv": ("2tok-topk",),
    "auto-target-kv": ("2tok-topk",),
    "model-int8": ("2tok-topk",),  # a different q, used the same way
    "auto-eagle3": ("2tok-topk",),
}
MATRIX = (
    [
        pytest.param("float32", setup, *case.values, id=f"float32-{setup}-{case.id}")
        for setup in DRAFTER_SETUPS
        for case in CASES
        if setup == "model" or case.id in CASES_FOR.get(setup, ("2tok-topk", "3tok-penalties"))
    ]
    + [
        pytest.param(dtype, setup, *case.values, id=f"{dtype}-{setup}-{case.id}")
        for dtype in ("bfloat16", "float16")
        for setup in HALF_PRECISION_SETUPS
        for case in CASES
        if case.id == "2tok-topk"
    ]
    + [  # a head's q through half-precision products too
        pytest.param("bfloat16", "eagle3", *case.values, id=f"bfloat16-eagle3-{case.id}")
        for case in CASES
        if case.id == "2tok-topk"
    ]
    + [
        pytest.param("float32", setup, *case.values, id=f"float32-{setup}-{case.id}")
        for setup in DEVICE_PATH_SETUPS
        for case in CASES
        if case.id == "2tok-topk"
    ]
)


@pytest.mark.parametrize("dtype,setup,length,num_draft_tokens,sampling", MATRIX)
def test_speculative_samples_match_target_distribution(
    model_pairs, dtype, setup, length, num_draft_tokens, sampling, monkeypatch
):
    """The reference law is the target's own, computed in the same dtype. top_p's partial top-k
    runs while sampling (rungs this small vocabulary can fill or miss), its definition (the full
    sort) for the reference."""
    target, draft = model_pairs[dtype]
    engine = setup_engine(setup, target, draft, num_draft_tokens=num_draft_tokens)
    engine._seeds.manual_seed(1234)
    params = SamplingParams(max_tokens=length, **sampling)
    monkeypatch.setattr(engine_sampling, "TOP_P_CANDIDATES", (2, 4))
    counts, stats = sample_continuations(engine, params, SAMPLES)
    assert stats.drafted_tokens > 0  # the drafter really proposed, so the sampler was exercised
    monkeypatch.setattr(engine_sampling, "TOP_P_CANDIDATES", ())
    pvalue = chi_square_pvalue(counts, exact_distribution(target, params, length))
    assert pvalue > ALPHA, f"speculative samples differ from the target's distribution (p={pvalue:.2e})"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_target_only_samples_match_target_distribution(model_pairs, dtype):
    """The engine's own forward, without drafting, in each dtype: the same law as the stock forward."""
    target, _ = model_pairs[dtype]
    engine = tiny_engine(target, None)
    engine._seeds.manual_seed(4321)
    params = SamplingParams(max_tokens=2, temperature=0.8, top_k=4)
    counts, _ = sample_continuations(engine, params, SAMPLES)
    pvalue = chi_square_pvalue(counts, exact_distribution(target, params, 2))
    assert pvalue > ALPHA, f"target-only samples differ from the target's distribution (p={pvalue:.2e})"


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
    engine._seeds.manual_seed(7)
    total = SpecStats()  # over all 50 requests: one 8-token request alone may accept all or nothing
    for i in range(50):
        outputs = list(engine.generate(Request(str(i), PROMPT, SamplingParams(max_tokens=8))))
        total.add(outputs[-1].stats)
    assert 0 < total.accepted_tokens < total.drafted_tokens


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


REFERENCES: dict[tuple[str, tuple[int, ...], int], list[int]] = {}  # by target weights' digest, prompt, length


def cached_reference(model, weights: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """``greedy_reference`` once per target weights (``weights_digest``) and prompt: every setup at
    one k reads the same prompts, most with the same target (one holding blocks changes it), and
    the uncached forward is half of such a test's time."""
    key = (weights, prompt, max_tokens)
    if key not in REFERENCES:
        REFERENCES[key] = greedy_reference(model, list(prompt), max_tokens)
    return REFERENCES[key]


def weights_digest(model) -> str:
    digest = hashlib.sha256()
    for name, param in model.state_dict().items():
        digest.update(name.encode() + param.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


GREEDY_MATRIX = [(setup, k) for setup in DRAFTER_SETUPS for k in (1, 2, 4, 7)] + [
    (setup, 4) for setup in DEVICE_PATH_SETUPS
]


@pytest.mark.parametrize("setup,num_draft_tokens", GREEDY_MATRIX)
def test_greedy_speculative_equals_target_greedy(setup, num_draft_tokens):
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    draft = perturbed_copy(target, noise=0.05, seed=num_draft_tokens)  # agrees often, not always
    engine = setup_engine(setup, target, draft, num_draft_tokens=num_draft_tokens)
    generator = torch.Generator().manual_seed(num_draft_tokens)
    total, weights = SpecStats(), weights_digest(target)
    for _ in range(8):
        chunk = torch.randint(
            0, 96, (int(torch.randint(2, 8, (1,), generator=generator)),), generator=generator
        ).tolist()
        prompt = chunk + [5] + chunk  # a repeat gives n-gram lookup material
        expected = cached_reference(target, weights, tuple(prompt), 24)
        outputs = list(engine.generate(Request("g", prompt, SamplingParams(max_tokens=24, temperature=0.0))))
        assert [t for o in outputs for t in o.token_ids] == expected
        total.add(outputs[-1].stats)
    # a random EAGLE-3 head seldom names the target's argmax: its drafts are checked, rarely kept
    assert total.drafted_tokens > 0 and (total.accepted_tokens > 0 or setup in UNTRAINED_HEADS)


# Half precision: a verify pass computes k+1 rows in one matrix product, a decode step one row, and the
# two round differently. Where the target's top two logits are within a few units in the last place,
# the argmax can flip between them (vLLM documents the same for batched numerics). Greedy output is then
# the target's own up to such a near-tie, and at the first divergence the other token is the runner-up.
NEAR_TIE = {"bfloat16": 0.0625, "float16": 0.0078}  # 4 units in the last place for logits in [2, 4)


def first_divergence(expected: list[int], actual: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(expected, actual, strict=True)) if a != b), None)


@pytest.mark.parametrize("num_draft_tokens", [1, 4])
@pytest.mark.parametrize("setup", HALF_PRECISION_SETUPS)
@pytest.mark.parametrize("dtype", list(NEAR_TIE))
def test_half_precision_greedy_diverges_from_target_greedy_only_at_near_ties(dtype, setup, num_draft_tokens):
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    draft = perturbed_copy(target, noise=0.05, seed=num_draft_tokens)
    target, draft = target.to(DTYPES[dtype]), draft.to(DTYPES[dtype])
    engine = setup_engine(setup, target, draft, num_draft_tokens=num_draft_tokens)
    alone = tiny_engine(target, None)
    generator = torch.Generator().manual_seed(num_draft_tokens)
    total, identical = SpecStats(), 0
    for _ in range(8):
        chunk = torch.randint(0, 96, (int(torch.randint(2, 8, (1,), generator=generator)),), generator=generator)
        prompt = chunk.tolist() + [5] + chunk.tolist()
        params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
        reference = list(alone.generate(Request("t", prompt, params)))
        expected = [t for o in reference for t in o.token_ids]
        outputs = list(engine.generate(Request("s", prompt, SamplingParams(max_tokens=24, temperature=0.0))))
        actual = [t for o in outputs for t in o.token_ids]
        total.add(outputs[-1].stats)
        at = first_divergence(expected, actual)
        if at is None:
            identical += 1
            continue
        (best, best_lp), (runner_up, runner_lp) = [lp for o in reference for lp in o.logprobs][at].top
        assert actual[at] == runner_up and best_lp - runner_lp <= NEAR_TIE[dtype], (
            f"diverged at token {at} where the target's top two logits differ by {best_lp - runner_lp:.4f}"
        )
    assert identical >= 6  # most sequences are identical; near-ties are rare
    assert total.drafted_tokens > 0 and total.accepted_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", *NEAR_TIE])
def test_batched_verify_argmax_flips_only_at_near_ties(dtype, capsys):
    """Measures the flips directly: at every position, the argmax of a 5-row verify pass against
    the argmax of the 1-row decode step over the same prefix."""
    flips, positions = 0, 0
    for seed in range(4):
        model = CausalLM(tiny_llama(seed=3 + seed, vocab_size=96, init=0.2).to(DTYPES[dtype]), 256)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(6):
            prompt = torch.randint(0, 96, (8,), generator=generator).tolist()
            model.cache.rollback(0)
            logits, sequence, single = model.extend(prompt), list(prompt), []
            for _ in range(30):
                single.append(logits[-1].float())  # [V]
                sequence.append(int(logits[-1].argmax()))
                logits = model.extend([sequence[-1]])
            for start in range(len(prompt), len(sequence) - 5, 5):
                model.cache.rollback(start - 1)
                batch = model.extend(sequence[start - 1 : start + 4], num_logits=5).float()  # [5, V]
                for row in range(5):
                    one = single[start - len(prompt) + row]
                    positions += 1
                    if int(one.argmax()) != int(batch[row].argmax()):
                        flips += 1
                        top = one.topk(2).values
                        assert dtype != "float32", "float32 verify and decode disagree"
                        assert float(top[0] - top[1]) <= NEAR_TIE[dtype]
    with capsys.disabled():
        print(f"\n{dtype}: batched-verify argmax flips {flips} of {positions} positions")
    assert flips <= positions // 100


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


# ---- int8 activations (--activations int8): another target, whose own forward gives the law ----


class EngineForward:
    """A target-only engine's forward, called as exact_distribution calls a model: the logits of a
    prefix from the engine's own products. With int8 activations that is the target, not the
    float32 model its blocks decode to (tests/cpu/test_blocks.py proves the products' law)."""

    def __init__(self, engine) -> None:
        self.target = engine.target

    def __call__(self, ids: torch.Tensor):  # [1, T] -> .logits [1, 1, V]
        self.target.cache.rollback(0)
        return SimpleNamespace(logits=self.target.extend(ids[0].tolist())[None])


def int8_target_engine(seed: int, vocab: int, init: float, draft, num_draft_tokens: int):
    """An engine whose target's products take int8 activations (Q4_0, Q4_1 and Q8_0 blocks), drafted by ``draft``."""
    target = tiny_llama(seed=seed, vocab_size=vocab, init=init)
    engine = setup_engine("model-blocks", target, draft, int8_activations=True, num_draft_tokens=num_draft_tokens)
    # every product, the LM head too where its rows come in sixteens (Q8_0)
    assert f"int8 activations in {9 if vocab % 16 == 0 else 8}/9" in engine.target.weights.blocks_line
    return engine


def test_int8_activation_samples_match_the_int8_targets_distribution():
    params = SamplingParams(max_tokens=2, temperature=0.8, top_k=4)
    draft = tiny_llama(seed=1, vocab_size=VOCAB, init=0.12)
    engine = int8_target_engine(0, VOCAB, 0.12, draft, num_draft_tokens=1)
    reference = int8_target_engine(0, VOCAB, 0.12, draft, num_draft_tokens=1)
    engine._seeds.manual_seed(1234)
    counts, stats = sample_continuations(engine, params, SAMPLES)
    assert stats.drafted_tokens > 0
    pvalue = chi_square_pvalue(counts, exact_distribution(EngineForward(reference), params, 2))
    assert pvalue > ALPHA, f"speculative samples differ from the int8 target's distribution (p={pvalue:.2e})"


@pytest.mark.parametrize("num_draft_tokens", [1, 4])
def test_int8_activation_greedy_speculative_equals_its_target_only_greedy(num_draft_tokens):
    """A verify row is the decode step's row bit for bit, so drafting changes no token."""
    base = tiny_llama(seed=3, vocab_size=96, init=0.2)
    engine = int8_target_engine(3, 96, 0.2, perturbed_copy(base, noise=0.05, seed=1), num_draft_tokens)
    generator = torch.Generator().manual_seed(num_draft_tokens)
    total, params = SpecStats(), SamplingParams(max_tokens=24, temperature=0.0)
    for i, length in enumerate((3, 5, 8, 11, 6, 9)):
        prompt = torch.randint(0, 96, (length,), generator=generator).tolist()
        alone = [t for o in engine.generate(Request(f"a{i}", prompt, params, drafter="none")) for t in o.token_ids]
        outputs = list(engine.generate(Request(f"s{i}", prompt, params)))
        assert [t for o in outputs for t in o.token_ids] == alone
        total.add(outputs[-1].stats)
    assert 0 < total.accepted_tokens < total.drafted_tokens


def test_int8_activation_logits_are_the_same_bits_however_the_rows_are_grouped():
    """A position's logits from a 48-row prompt pass, from 1-row decode steps and from 5-row verify
    passes are equal bit for bit: with int8 activations a last-bit difference anywhere (an attention
    kernel that blocks by length, say) could move a rounding to int8, and greedy output would depend
    on the drafts. Without blocks the float32 paths differ in the last bits (the control)."""
    draft = tiny_llama(seed=1, vocab_size=96, init=0.2)
    prompt = torch.randint(0, 96, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    targets = {True: int8_target_engine(3, 96, 0.2, draft, 4).target}
    targets[False] = tiny_engine(tiny_llama(seed=3, vocab_size=96, init=0.2), None).target
    for int8, target in targets.items():
        target.cache.rollback(0)
        whole = target.extend(prompt, num_logits=len(prompt))  # [48, V]
        target.cache.rollback(0)
        stepped = torch.cat([target.extend([token]) for token in prompt])  # [48, V]
        target.cache.rollback(0)
        grouped = torch.cat(
            [target.extend(prompt[i : i + 5], num_logits=len(prompt[i : i + 5])) for i in range(0, 48, 5)]
        )
        same = torch.equal(whole, stepped) and torch.equal(whole, grouped)
        assert same == int8, (
            f"int8 activations {int8}: rows grouped differently give {'the same' if same else 'other'} bits"
        )
