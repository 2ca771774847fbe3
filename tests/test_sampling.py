"""Logits to probabilities: each transform, and per-position history for drafted tokens."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import RequestSampler, SamplingError, SamplingParams, first_largest


def sampler(prompt=(), **params) -> RequestSampler:
    return RequestSampler(SamplingParams(**params), 6, torch.device("cpu"), list(prompt), seed=0)


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_greedy_is_one_hot_argmax():
    assert sampler(temperature=0.0).probs(LOGITS).tolist() == [[1, 0, 0, 0, 0, 0]]


def test_temperature_one_is_softmax():
    assert torch.allclose(sampler().probs(LOGITS), torch.softmax(LOGITS, -1))


def test_top_k_keeps_k_tokens():
    probs = sampler(top_k=2).probs(LOGITS)[0]
    assert (probs > 0).tolist() == [True, True, False, False, False, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_smallest_set_reaching_mass():
    full = torch.softmax(LOGITS, -1)[0]  # .61 .22 .14 ...
    probs = sampler(top_p=0.7).probs(LOGITS)[0]
    assert (probs > 0).sum() == 2 and full[:2].sum() >= 0.7


def sorted_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition, by a full sort: a token stays when the mass ahead of it is under top_p."""
    values, order = probs.sort(dim=-1, descending=True)
    drop = values.cumsum(-1) - values >= top_p
    drop[:, 0] = False
    return torch.zeros_like(probs).scatter_(-1, order, values.masked_fill(drop, 0.0))


@pytest.mark.parametrize("sharpness", [40.0, 8.0, 3.0, 1.0, 0.05])
def test_top_p_over_a_few_candidates_keeps_what_a_full_sort_keeps(sharpness, monkeypatch):
    """The candidates' paths agree bit for bit with sorting the whole row, whether the kept set lies
    among the tokens above the floor (peaked rows), needs a partial top-k, or only the full sort finds
    it (a nearly flat row), with rows of zeros (after top_k) among them."""
    import engine.sampling as sampling

    generator = torch.Generator().manual_seed(int(sharpness * 100))
    logits = torch.randn(5, 49152, generator=generator) * sharpness  # [T, V]
    logits[1, 300:] = float("-inf")  # top_k leaves a few hundred tokens with mass
    probs = torch.softmax(logits, -1)
    rungs = []
    real_topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, k, **kw: rungs.append(k) or real_topk(self, k, **kw))
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
        rungs.clear()
        assert torch.equal(sampling._top_p(probs, top_p), sorted_top_p(probs, top_p)), top_p
        if sharpness == 8.0 and top_p <= 0.95 or sharpness == 40.0:
            assert rungs == []  # peaked (one token holding nearly all, at 40): the tokens above the floor suffice
        if sharpness == 0.05:
            assert rungs == list(sampling.TOP_P_CANDIDATES)  # flat: every rung falls short, then the sort


def test_the_first_largest_id_is_torchs_argmax_with_ties_and_nans():
    """Greedy picks by numpy on a CPU: the same id as ``argmax``, the first of tied largest values, the
    first NaN, over a row cut from a wider one (logits past the tokenizer's vocabulary)."""
    generator = torch.Generator().manual_seed(0)
    for index in range(50):
        logits = torch.randint(-3, 3, (3, 60), generator=generator).float()  # [T, V] many ties
        logits[1, index % 60] = float("nan")
        view = logits[:, :50]  # strided
        assert torch.equal(first_largest(view), view.argmax(-1)) and first_largest(view).dtype == torch.long


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = sampler(min_p=0.3).probs(LOGITS)[0]
    assert (probs > 0).tolist() == [True, True, False, False, False, False]


def test_logit_bias_can_force_a_token():
    s = RequestSampler(SamplingParams(temperature=0.0, logit_bias={5: 100.0}), 6, torch.device("cpu"), [], seed=0)
    assert s.probs(LOGITS)[0].argmax() == 5


def test_penalties_for_drafted_positions_match_committed_history():
    """Row t of a verify pass with drafts d must equal a fresh pass after committing d[:t]."""
    params = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.4)
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    drafts = torch.tensor([0, 0, 3])
    verified = sampler(prompt=[2], **params).probs(logits, drafts)  # [4, V]
    for t in range(4):
        reference = sampler(prompt=[2], **params)
        reference.commit(drafts[:t].tolist())
        assert torch.allclose(verified[t], reference.probs(logits[t : t + 1])[0], atol=1e-6)


def penalised_everywhere(logits, prompt, output, drafts, presence, frequency, repetition):
    """The penalties' definition over every id of every row: row t follows the output and drafts[:A - (T - 1) + t]."""
    rows = []
    for t in range(logits.shape[0]):
        counts = torch.zeros(logits.shape[1])
        for token in output + drafts[: len(drafts) - (logits.shape[0] - 1) + t]:
            counts[token] += 1
        seen = counts > 0
        seen[prompt] = True
        row = logits[t] - frequency * counts - presence * (counts > 0).float()
        rows.append(torch.where(seen, torch.where(row > 0, row / repetition, row * repetition), row))
    return torch.stack(rows)


@pytest.mark.parametrize("penalties", [(0.7, 0.4, 1.4), (0.0, 0.0, 1.1), (-0.5, 1.2, 1.0)])
def test_penalties_at_the_ids_they_can_move_are_the_definition_over_every_id(penalties):
    """The sampler moves only the logits of ids in the history and the drafts (a few hundred of 49k):
    the same bits as the penalties computed over the whole row, with an id drafted twice, drafted
    after it was committed, and in the prompt alone."""
    presence, frequency, repetition = penalties
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=generator) * 3  # [T, V]
    prompt, output, drafts = [5, 17, 17, 250], [17, 42, 42, 99], [42, 7, 7]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    sampling = RequestSampler(params, 300, torch.device("cpu"), prompt, seed=0)
    sampling.commit(output[:2])
    sampling.commit(output[2:])
    seen_in_prompt = prompt if repetition != 1.0 else []
    moved = sampling._transformed(logits, torch.tensor(drafts))
    assert torch.equal(moved, penalised_everywhere(logits, seen_in_prompt, output, drafts, *penalties))
    alone = sampling._transformed(logits[:1], None)  # a decode step's one row, nothing drafted
    assert torch.equal(alone, penalised_everywhere(logits[:1], seen_in_prompt, output, [], *penalties))


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.1, "presence_penalty": 0.3}],
)
def test_a_rows_probabilities_are_the_same_bits_alone_or_among_a_verifys_rows(params):
    """A position's p is the same bits from a verify's rows or from a step's one row, at the thread
    counts users run: a seeded draw keyed by position then lands alike whatever was drafted. (The
    whole row's total, summed with the rows beside it, differed in its last bit at 2+ threads.)"""
    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(2)) * 4  # [T, V]
    logits[:, :30] += 14
    drafts, prompt, threads = [11, 12, 11, 40], [5, 11, 300, 7], torch.get_num_threads()
    try:
        for count in (1, 2, 8, 16):
            torch.set_num_threads(count)
            verify = RequestSampler(SamplingParams(**params), 49152, torch.device("cpu"), prompt, seed=0)
            rows = verify.probs(logits, torch.tensor(drafts))  # [5, V]
            for position in range(5):
                step = RequestSampler(SamplingParams(**params), 49152, torch.device("cpu"), prompt, seed=0)
                step.commit(drafts[:position])
                assert torch.equal(rows[position], step.probs(logits[position : position + 1])[0]), (count, position)
    finally:
        torch.set_num_threads(threads)


def test_repetition_penalty_covers_the_prompt_presence_penalty_does_not():
    logits = torch.zeros(1, 6)
    logits[0, 1] = 1.0
    assert sampler(prompt=[1], repetition_penalty=2.0, temperature=0.0).probs(logits)[0, 1] == 1.0  # 1/2 > 0
    presence = sampler(prompt=[1], presence_penalty=2.0).probs(logits)[0]
    assert torch.allclose(presence, torch.softmax(logits, -1)[0])  # the prompt does not count


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_k", -2),
        ("max_tokens", 0),
        ("presence_penalty", 3.0),
        ("seed", 2**63),
    ],
)
def test_out_of_range_parameters_are_rejected_with_their_name(field, value):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_same_seed_same_draws():
    draws = [torch.multinomial(torch.ones(100), 5, generator=sampler(seed=42).generator).tolist() for _ in range(2)]
    assert draws[0] == draws[1]
