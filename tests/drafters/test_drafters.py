"""Drafter-specific behaviour; exactness for every drafter lives in test_lossless.py."""

from __future__ import annotations

import pytest
import torch

from engine.adaptive import AdaptiveK, StepCosts
from engine.config import ConfigError, EngineConfig
from engine.cpu.matmul import PACKED, MatmulPlan
from engine.drafters.medusa import MedusaHeads
from engine.drafters.ngram import NgramDrafter
from engine.model.model import CausalLM
from engine.request import Request
from engine.sampling import SamplingParams
from engine.training.calibration import collect, train_heads
from server.settings import ServeSettings
from tests.tiny import perturbed_copy, random_medusa_heads, setup_engine, tiny_engine, tiny_llama


def test_ngram_proposes_what_followed_the_longest_recent_match():
    drafter = NgramDrafter(1, 3, torch.device("cpu"))
    drafter.begin([])
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    assert drafter.propose(tokens, 3, None).token_ids.tolist() == [4, 5, 1]
    assert drafter.propose(tokens + [4, 9], 3, None).token_ids.tolist() == []  # nothing seen after 9
    assert drafter.propose(tokens + [4, 9, 1], 4, None).token_ids.tolist() == [2, 3, 4, 9]  # the latest match wins
    assert drafter.propose(tokens + [4, 9, 1], 4, None).probs is None  # deterministic: verified as one-hot


def test_self_drafter_leaves_the_targets_cache_exact():
    target = tiny_llama(seed=4, vocab_size=64, init=0.2)
    engine = setup_engine("self", target, None, num_draft_tokens=4)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    list(engine.generate(Request("a", [1, 2, 3], params)))
    assert engine.target.cache.length > 3
    cached = list(engine.target.cache.token_ids)
    # the next turn reuses the cache the draft passes wrote into: it must hold the target's own KV
    reused = [t for o in engine.generate(Request("b", cached + [5], params)) for t in o.token_ids]
    fresh = [t for o in tiny_engine(target, None).generate(Request("b", cached + [5], params)) for t in o.token_ids]
    assert reused == fresh


def test_staged_stats_count_the_final_proposal():
    target = tiny_llama(seed=5, vocab_size=64, init=0.2)
    engine = setup_engine("staged-ngram-model", target, perturbed_copy(target, 0.05, 1), num_draft_tokens=4)
    outputs = list(engine.generate(Request("s", [1, 2, 1, 2, 1], SamplingParams(max_tokens=24, temperature=0.0))))
    stats = outputs[-1].stats
    assert stats.drafter == "staged" and stats.drafted_tokens > 0 and stats.accepted_tokens > 0


def test_staged_rejects_a_stage_that_cannot_refine():
    target = tiny_llama(seed=5, vocab_size=64)
    with pytest.raises(ConfigError, match="cannot check another stage's tokens"):
        tiny_engine(target, None, drafter="staged", stages=("self", "ngram"))


def test_medusa_checkpoint_round_trip(tmp_path):
    folder = random_medusa_heads(32, num_heads=3)
    heads = MedusaHeads.load(folder)
    features = heads(torch.ones(32))
    assert features.shape == (3, 32)
    (tmp_path / "config.json").write_text('{"format": "something-else"}')
    with pytest.raises(ConfigError, match="format"):
        MedusaHeads.load(tmp_path)
    with pytest.raises(ConfigError, match="no Medusa head checkpoint"):
        MedusaHeads.load(tmp_path / "missing")


def test_medusa_drafts_from_the_second_step_on():
    target = tiny_llama(seed=6, vocab_size=64, init=0.2)
    engine = setup_engine("medusa", target, None, num_draft_tokens=3)
    outputs = list(engine.generate(Request("m", [4, 5, 6], SamplingParams(max_tokens=12, temperature=0.0))))
    assert outputs[0].stats.drafted_tokens == 0  # no hidden state yet for this request
    assert outputs[-1].stats.drafted_tokens > 0


def test_adaptive_k_prefers_plain_decoding_when_drafts_are_costly_and_rejected():
    policy = AdaptiveK(StepCosts(0.05, {0: 0.03, 6: 0.04}), alpha=0.1)
    assert policy.choose(6) == 0


def test_adaptive_k_drafts_long_when_drafts_are_cheap_and_accepted():
    policy = AdaptiveK(StepCosts(0.002, {0: 0.03, 6: 0.035}), alpha=0.9)
    assert policy.choose(6) == 6
    assert policy.choose(2) == 2  # never past what the request allows


def test_adaptive_k_learns_acceptance_from_steps():
    policy = AdaptiveK()
    for _ in range(50):
        policy.observe(4, 0, 0.01, 0.02)
    assert policy.alpha < 0.1
    for _ in range(50):
        policy.observe(4, 4, 0.01, 0.02)
    assert policy.alpha > 0.8


def test_adaptive_k_times_no_step_after_one_that_made_several_tokens():
    """Served, such a step also waits on the earlier tokens' events: its seconds are not its k's cost."""
    policy = AdaptiveK(StepCosts())
    policy.observe(0, 0, 0.0, 0.030)  # one token made: the next step is timed
    policy.observe(4, 3, 0.004, 0.040)  # timed; four tokens made
    policy.observe(4, 0, 0.004, 0.090)  # not timed: would have raised the price of four drafts
    policy.observe(4, 1, 0.004, 0.041)  # one token made before it: timed
    assert policy.costs.verify == {0: 0.030, 4: pytest.approx(0.9 * 0.040 + 0.1 * 0.041)}


def test_adaptive_k_is_reported_in_stats():
    target = tiny_llama(seed=7, vocab_size=64, init=0.2)
    engine = setup_engine("model-adaptive-k", target, perturbed_copy(target, 0.05, 2), num_draft_tokens=5)
    outputs = list(engine.generate(Request("k", [1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0))))
    stats = outputs[-1].stats.to_dict()
    assert 0 <= stats["mean_num_draft_tokens"] <= 5 and stats["target_forwards"] > 1


def test_only_an_explicit_draft_none_skips_the_embedded_default_draft():
    """Issue 12: the default draft stays loaded whatever the start-up drafter, so requests may ask for it."""
    for drafter in ("ngram", "self", "medusa", "staged"):
        assert ServeSettings.load(None, {"drafter": drafter}).resolved_draft == "copy:auto"
        assert ServeSettings.load(None, {"drafter": drafter, "draft": "none"}).resolved_draft is None


def test_adaptive_k_keeps_costs_across_requests_but_acceptance_per_request():
    """Chat prompts must not drag a code request's acceptance down: only the costs are shared."""
    target = tiny_llama(seed=7, vocab_size=64, init=0.2)
    engine = setup_engine("model-adaptive-k", target, perturbed_copy(target, 0.05, 2), num_draft_tokens=4)
    seq = engine._begin(Request("a", [1, 2, 3], SamplingParams(max_tokens=8)))
    seq.policy.alpha = 0.05
    seq.policy.costs.observe(0, 0.0, 0.02)
    again = engine._begin(Request("b", [1, 2, 3], SamplingParams(max_tokens=8)))
    assert again.policy.alpha == 0.7 and again.policy.costs is seq.policy.costs


def reads(model) -> list[int]:
    """Record how many tokens each forward of ``model`` feeds."""
    rows: list[int] = []
    extend = model.extend

    def counted(token_ids, num_logits=1):
        rows.append(len(token_ids) if isinstance(token_ids, list) else token_ids.shape[0])
        return extend(token_ids, num_logits)

    model.extend = counted
    return rows


@pytest.mark.parametrize("draft_kv", ["own", "target"])
def test_a_draft_reading_the_targets_cache_reads_one_token_a_step(draft_kv):
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    engine = tiny_engine(target, perturbed_copy(target, 0.05, seed=1), drafter="model", draft_kv=draft_kv)
    draft_rows, target_rows = reads(engine.draft), reads(engine.target)
    prompt = list(range(10, 40))
    outputs = list(engine.generate(Request("r", prompt, SamplingParams(max_tokens=24, temperature=0.0))))
    assert outputs[-1].stats.accepted_tokens > 0
    if draft_kv == "own":
        assert draft_rows[0] == len(prompt) and max(draft_rows[1:]) > 1  # it reads a fully accepted run's tail too
        return
    assert set(draft_rows) == {1}
    assert target_rows[0] == len(prompt) - 1  # the target read the prompt once, for both models
    read = len(prompt) - 1  # the prompt's keys and values are the target's, copied
    assert torch.equal(engine.draft.cache.keys[:, :, :, :read], engine.target.cache.keys[:, :, :, :read])


def test_a_draft_reads_the_targets_cache_by_default_only_when_it_is_a_copy():
    assert EngineConfig(draft="copy:bfloat16").draft_reads_target_kv
    assert not EngineConfig(draft="some/other-model").draft_reads_target_kv
    assert EngineConfig(draft="some/other-model", draft_kv="target").draft_reads_target_kv
    assert not EngineConfig(draft="copy:bfloat16", draft_kv="own").draft_reads_target_kv
    with pytest.raises(ConfigError, match="draft_kv must be one of auto, own, target"):
        EngineConfig(draft_kv="shared")
    target = tiny_llama(seed=3, vocab_size=96)
    with pytest.raises(ConfigError, match="the draft's cache .* differs from the target's"):
        tiny_engine(target, tiny_llama(seed=4, vocab_size=96, layers=3), drafter="model", draft_kv="target")


def test_adaptive_k_does_not_time_a_requests_first_step_which_reads_the_prompt():
    target = tiny_llama(seed=7, vocab_size=64, init=0.2)
    engine = setup_engine("model-adaptive-k", target, perturbed_copy(target, 0.05, 2), num_draft_tokens=4)
    costs = engine._costs.setdefault("model", StepCosts())
    list(engine.generate(Request("a", list(range(1, 60)), SamplingParams(max_tokens=1))))
    assert not costs.knows(0)  # one step, the first: nothing timed
    list(engine.generate(Request("b", list(range(1, 60)), SamplingParams(max_tokens=2))))
    assert costs.knows(0)  # its second step was plain decoding (the cost of k = 0 is measured first)


def test_medusa_heads_train_on_a_target_whose_weights_are_packed():
    """Training multiplies by the LM head itself: where the plan packed it and freed the dense copy
    (an untied head), training reads it back exactly through ``weights.dense``."""
    model = tiny_llama(seed=5, vocab_size=64, init=0.2)
    dense_head = model.lm_head.weight.detach().clone()
    target = CausalLM(model, max_len=128)
    target.weights.use_plan(MatmulPlan.uniform(PACKED, 4, target.weights.linear_weights()))
    assert target.lm_head.weight.numel() == 0  # untied: freed, the packed copy alone remains
    assert torch.equal(target.weights.dense(target.lm_head, "weight"), dense_head)
    sequences = [torch.randint(0, 64, (60,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    features, labels = collect(target, sequences, num_heads=2, chunk=32)
    heads, report = train_heads(target, features, labels, num_heads=2, seconds=0.3, batch=16)
    assert report["steps"] > 0 and len(report["held_out_accuracy"]) == 2
