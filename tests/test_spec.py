"""The rejection sampler on hand-made distributions."""

from __future__ import annotations

import pytest
import torch

from engine.spec import NonFiniteProbabilities, greedy_verdict, rejection_sample


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_draft_with_zero_target_probability_is_always_rejected():
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for seed in range(50):
        verdict = rejection_sample(torch.tensor([0]), q, p, gen(seed))
        assert verdict.num_accepted == 0 and verdict.next_token in (1, 2)


def test_draft_where_p_exceeds_q_is_always_accepted_and_bonus_drawn_from_last_row():
    p = torch.tensor([[0.2, 0.8, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    for seed in range(50):
        verdict = rejection_sample(torch.tensor([1]), q, p, gen(seed))
        assert verdict.num_accepted == 1 and verdict.next_token == 2


def test_residual_distribution_after_rejection():
    """Rejected at p=(.5,.5,0) with q=(1,0,0): the residual max(0, p-q) puts all mass on token 1."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    outcomes = [rejection_sample(torch.tensor([0]), q, p, gen(seed)) for seed in range(400)]
    rejected = [v for v in outcomes if v.num_accepted == 0]
    assert all(v.next_token == 1 for v in rejected)
    assert 150 < len(rejected) < 250  # acceptance probability p/q = 0.5


def test_first_token_is_distributed_as_p():
    """Draw x ~ q, verify, and the emitted first token follows p exactly (Leviathan et al., Theorem 1)."""
    p0 = torch.tensor([0.1, 0.6, 0.3, 0.0])
    q0 = torch.tensor([0.4, 0.1, 0.2, 0.3])
    p = torch.stack([p0, torch.full((4,), 0.25)])
    generator = gen(7)
    counts = torch.zeros(4)
    trials = 20000
    for _ in range(trials):
        draft = torch.multinomial(q0, 1, generator=generator)
        verdict = rejection_sample(draft, q0[None], p, generator)
        first = int(draft[0]) if verdict.num_accepted else verdict.next_token
        counts[first] += 1
    assert torch.allclose(counts / trials, p0, atol=0.015)


def test_chain_stops_at_first_rejection():
    p = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    verdict = rejection_sample(torch.tensor([1, 1, 0]), q, p, gen())
    assert verdict.num_accepted == 1 and verdict.next_token == 0


def test_deterministic_drafts_verify_as_one_hot():
    """q=None (n-gram style): accept with probability p(x); resample from p without x."""
    p = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    outcomes = [rejection_sample(torch.tensor([1]), None, p, gen(seed)) for seed in range(400)]
    rejected = [v for v in outcomes if v.num_accepted == 0]
    assert all(v.next_token == 0 for v in rejected) and 60 < len(rejected) < 140


def test_no_drafts_samples_from_p():
    p = torch.tensor([[0.0, 0.0, 1.0]])
    assert rejection_sample(torch.empty(0, dtype=torch.long), None, p, gen()).next_token == 2


def test_greedy_one_hot_distributions_reduce_to_argmax_match():
    eye = torch.eye(5)
    p = eye[[3, 1, 4, 2]]  # target argmax at each position
    q = eye[[3, 1, 0]]  # drafts 3, 1 agree; 0 does not
    verdict = rejection_sample(torch.tensor([3, 1, 0]), q, p, gen())
    assert verdict.num_accepted == 2 and verdict.next_token == 4


def test_drafts_past_a_device_side_cutoff_are_never_accepted():
    """num_proposed = 1 of k = 2: the second draft does not count, and when the first passes, the
    next token comes from p_1, the target's distribution after one draft (not from p_2)."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    outcomes = [
        rejection_sample(torch.tensor([0, 1]), None, p, gen(seed), num_proposed=torch.tensor(1)) for seed in range(200)
    ]
    # draft 0 kept then p_1's token, or resampled at row 0; counting draft 1 would give (0, 1, 0)
    assert {tuple(v.token_ids) for v in outcomes} == {(0, 1), (1,)}
    assert all(v.num_proposed == 1 and v.num_accepted <= 1 for v in outcomes)


def test_the_greedy_verdict_is_the_rejection_samplers_on_one_hot_targets_whatever_the_drafts_q():
    """At temperature 0 the engine takes greedy_verdict; it must be rejection_sample's verdict for
    p one-hot at the target's tokens, for deterministic and sampled drafts, with and without a cutoff."""
    vocab = 6
    for seed in range(300):
        g = gen(seed)
        k = int(torch.randint(0, 5, (), generator=g))
        target_tokens = torch.randint(0, vocab, (k + 1,), generator=g)  # [k+1]
        drafts = torch.where(
            torch.rand(k, generator=g) < 0.6, target_tokens[:k], torch.randint(0, vocab, (k,), generator=g)
        )
        q = None if seed % 2 else torch.softmax(torch.randn(k, vocab, generator=g), -1)  # [k, V]
        if q is not None:  # a draft drawn from q has mass under it
            q[torch.arange(k), drafts] += 0.1
            q = q / q.sum(-1, keepdim=True)
        cutoff = torch.tensor(int(torch.randint(0, k + 1, (), generator=g))) if seed % 3 == 0 else None
        p = torch.eye(vocab)[target_tokens]  # [k+1, V]
        expected = rejection_sample(drafts, q, p, gen(seed + 1000), cutoff)
        for on_host in (True, False):  # read from host lists (a CPU), or by the device's ops
            assert greedy_verdict(drafts, target_tokens, torch.tensor(True), cutoff, on_host) == expected


@pytest.mark.parametrize("on_host", [True, False])
def test_the_greedy_verdict_refuses_non_finite_logits(on_host):
    with pytest.raises(NonFiniteProbabilities):
        greedy_verdict(torch.tensor([1]), torch.tensor([1, 2]), torch.tensor(False), on_host=on_host)
