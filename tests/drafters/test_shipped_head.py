"""The EAGLE-3 head shipped for the embedded SmolLM2 (engine/eagle3_heads/): in the engine, on the
real model, its samples follow the target's own law (chi-square over the first two tokens), and it
actually drafts tokens the target accepts. Greedy exactness through the server is in
test_default_model.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from engine.drafters.eagle3_head import shipped_head
from engine.model.loader import EMBEDDED_NAME
from engine.request import Request
from engine.sampling import RequestSampler, SamplingParams
from engine.stats import SpecStats
from tests.conftest import EMBEDDED_FLOAT32, EMBEDDED_INT8
from tests.test_lossless import ALPHA, chi_square_pvalue

SAMPLES = 300  # nine outcomes: enough to catch a sampler that drifts from the law, in about a minute idle
PARAMS = SamplingParams(max_tokens=2, temperature=1.0, top_k=3)


@pytest.fixture(scope="module")
def loaded(embedded):
    assert (shipped_head(EMBEDDED_NAME) / "config.json").is_file(), "the shipped head is missing"
    return embedded(**EMBEDDED_FLOAT32)


def prompt_ids(loaded, text: str) -> list[int]:
    rendered = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return loaded.tokenizer(rendered, add_special_tokens=False).input_ids


@torch.inference_mode()
def exact_two_tokens(engine, prompt: list[int]) -> dict[tuple[int, int], float]:
    """P(t1, t2) under the request's transforms, from the engine's own target forward (top-k 3: nine outcomes)."""
    target, vocab = engine.target, engine.vocab_size
    law: dict[tuple[int, int], float] = {}
    first = RequestSampler(PARAMS, vocab, target.device, prompt, seed=0)
    target.cache.rollback(0)
    p1 = first.probs(target.extend(prompt))[0]  # [V]
    for t1 in p1.nonzero().flatten().tolist():
        second = RequestSampler(PARAMS, vocab, target.device, prompt, seed=0)
        second.commit([t1])
        target.cache.rollback(len(prompt))
        p2 = second.probs(target.extend([t1]))[0]
        for t2 in p2.nonzero().flatten().tolist():
            law[(t1, t2)] = float(p1[t1]) * float(p2[t2])
    target.cache.rollback(0)
    return law


def test_the_shipped_heads_samples_follow_the_targets_law(loaded):
    engine = loaded.engine
    prompt = prompt_ids(loaded, "Name one colour of the rainbow.")
    law = exact_two_tokens(engine, prompt)
    engine._seeds.manual_seed(2026)
    counts: Counter = Counter()
    total = SpecStats()
    for i in range(SAMPLES):
        outputs = list(engine.generate(Request(f"s{i}", prompt, PARAMS)))
        counts[tuple(t for o in outputs for t in o.token_ids)] += 1
        total.add(outputs[-1].stats)
    assert total.drafted_tokens > 0 and total.accepted_tokens > 0  # it drafted, and the target took some
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue > ALPHA, f"samples with the shipped head differ from the target's law (p={pvalue:.2e})"


def test_with_int8_activations_the_heads_greedy_output_is_the_int8_targets(loaded, embedded):
    """--activations int8 makes another target (llama.cpp's arithmetic): the head drafts for it and
    greedy output is its own target-only output, token for token, prompt rows and verify rows alike."""
    int8 = embedded(**EMBEDDED_INT8).engine
    assert "int8 activations in 121/121" in int8.warm_up_report
    assert "blocks 35/35 (not measured)" in int8.warm_up_report  # every product through its blocks, untimed
    params = SamplingParams(max_tokens=40, temperature=0.0)
    total, differs = SpecStats(), False
    for i, text in enumerate(("Name three rivers in Europe.", "Write a Python function that adds two numbers.")):
        prompt = prompt_ids(loaded, text)
        alone = [t for o in int8.generate(Request(f"a{i}", prompt, params, drafter="none")) for t in o.token_ids]
        outputs = list(int8.generate(Request(f"s{i}", prompt, params)))
        assert [t for o in outputs for t in o.token_ids] == alone
        total.add(outputs[-1].stats)
        float32 = [
            t for o in loaded.engine.generate(Request(f"f{i}", prompt, params, drafter="none")) for t in o.token_ids
        ]
        differs = differs or float32 != alone
    assert total.accepted_tokens > 0
    print(f"int8 activations: the float32 target's greedy output {'differs' if differs else 'is the same'}")


def test_auto_starts_the_head_at_what_it_agrees_on_prompts_it_never_saw(loaded):
    """The acceptance a request starts the head from is the one measured served on unseen prompts
    (bench/studies/eagle3_unseen.py --record), not its training's held-out answers (0.487), on which
    it agreed half as often again: every request then spent its first steps drafting with it."""
    recorded = json.loads((shipped_head(EMBEDDED_NAME) / "training.json").read_text())
    assert recorded["unseen_acceptance"] < recorded["held_out_acceptance"]
    auto = loaded.engine.drafter("auto")
    assert auto.priors["eagle3"] == recorded["unseen_acceptance"]
