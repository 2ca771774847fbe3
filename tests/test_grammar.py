"""Grammar constraints: drafted rows are masked as if their prefix were committed, and constrained
speculative decoding equals constrained target-only decoding."""

from __future__ import annotations

import json

import pytest
import torch

from engine.grammar import GrammarCompiler, GrammarError, TokenConstraint
from engine.request import Request
from engine.sampling import SamplingParams
from tests.tiny import byte_tokenizer, perturbed_copy, tiny_engine, tiny_llama

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
    "required": ["a", "b"],
}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def allowed(constraint: TokenConstraint, rows: int, appended: list[int], vocab: int) -> torch.Tensor:
    return constraint.apply(torch.zeros(rows, vocab), appended) > float("-inf")  # [T, V]


def test_drafted_rows_get_the_mask_of_their_own_prefix(tokenizer, compiler):
    vocab = len(tokenizer)
    drafts = tokenizer('{"a": 1', add_special_tokens=False).input_ids
    verify = allowed(TokenConstraint(compiler.json_schema(SCHEMA), vocab), len(drafts) + 1, drafts, vocab)
    for t in range(len(drafts) + 1):
        fresh = TokenConstraint(compiler.json_schema(SCHEMA), vocab)
        fresh.commit(drafts[:t])
        assert torch.equal(verify[t], allowed(fresh, 1, [], vocab)[0]), t
    assert verify[0].sum() == 1  # only "{" may start the object


def test_masking_leaves_the_committed_state_untouched(tokenizer, compiler):
    constraint = TokenConstraint(compiler.json_schema(SCHEMA), len(tokenizer))
    before = allowed(constraint, 1, [], len(tokenizer))
    allowed(constraint, 4, tokenizer('{"a', add_special_tokens=False).input_ids, len(tokenizer))
    assert torch.equal(before, allowed(constraint, 1, [], len(tokenizer)))


def test_invalid_schema_is_a_grammar_error(compiler):
    with pytest.raises(GrammarError):
        compiler.json_schema({"type": "no-such-type"})


def test_constrained_greedy_speculative_equals_constrained_target_only(tokenizer, compiler):
    target = tiny_llama(seed=21, vocab_size=len(tokenizer), hidden=64, init=0.15)
    draft = perturbed_copy(target, noise=0.05, seed=22)
    eos = {tokenizer.eos_token_id}
    prompt = tokenizer("make json").input_ids
    params = SamplingParams(max_tokens=120, temperature=0.0)
    outputs = {}
    for name, engine in (
        ("spec", tiny_engine(target, draft, 4, eos, 512)),
        ("alone", tiny_engine(target, None, 4, eos, 512)),
    ):
        steps = list(engine.generate(Request(name, prompt, params, grammar=compiler.json_schema(SCHEMA))))
        outputs[name] = [t for s in steps for t in s.token_ids]
        stats = steps[-1].stats
    assert outputs["spec"] == outputs["alone"]
    value = json.loads(tokenizer.decode(outputs["spec"], skip_special_tokens=True))
    assert isinstance(value["a"], int) and len(value["b"]) <= 5
    assert stats.target_forwards == len(outputs["alone"])  # the last engine ran alone: one forward per token


def test_rows_after_a_token_the_grammar_rejects_are_left_open(tokenizer, compiler):
    """Such rows are never used: the target gives the rejected token zero probability first."""
    vocab = len(tokenizer)
    drafts = tokenizer('{"a":1', add_special_tokens=False).input_ids  # compact form needs ": "
    masks = allowed(TokenConstraint(compiler.json_schema(SCHEMA), vocab), len(drafts) + 1, drafts, vocab)
    assert not masks[5, drafts[5]] and masks[6].all()
