"""The static-shape forward and the runner that compiles or captures it (engine/runner.py), proven
on CPU: CI has no GPU. Exactness on the compiled path lives in test_lossless.py (DEVICE_PATH_SETUPS)."""

from __future__ import annotations

import torch

from engine.model import CausalLM
from engine.runner import GraphRunner, windows
from tests.tiny import compiling_engine, serve_varied_requests, tiny_llama


def test_windows_double_up_to_the_cache_length():
    assert windows(4096) == [256, 512, 1024, 2048, 4096]
    assert windows(300) == [256, 300]
    assert windows(100) == [100]


def test_a_static_window_past_the_live_context_reads_only_the_live_context():
    model = tiny_llama(seed=3, vocab_size=96, init=0.2)
    eager, static = CausalLM(model, 512), CausalLM(model, 512)
    torch.manual_seed(0)
    static.cache.keys.normal_()  # stale keys and values everywhere: the mask must hide them
    static.cache.values.normal_()
    prompt = list(range(1, 40))
    eager.extend(prompt)
    static.extend(prompt)
    for tokens in ([7], [8, 9, 10, 11]):
        start = eager.cache.length
        expected = eager.extend(tokens, num_logits=len(tokens))  # [T, V]
        positions = static.positions[start : start + len(tokens)]
        _, logits = static.static_forward(static.upload(tokens), positions, 256, static.all_layers)
        static.cache.append(tokens)
        assert torch.allclose(logits, expected, atol=1e-5)


def test_the_static_forward_compiles_whole_and_matches_eager():
    """inductor with fullgraph=True, which raises at any graph break, at query lengths 1 and K+1."""
    model = tiny_llama(seed=3, vocab_size=96, init=0.2)
    eager, compiled = CausalLM(model, 64), CausalLM(model, 64)
    compiled.runner = GraphRunner(compiled, "compile", max_query=4)
    eager.extend([1, 2, 3, 4, 5, 6])
    compiled.extend([1, 2, 3, 4, 5, 6])  # prefill stays eager
    for tokens in ([7], [8, 9, 10, 11], [12], [13, 14, 15, 16]):
        expected = eager.extend(tokens, num_logits=len(tokens))
        logits = compiled.extend(tokens, num_logits=len(tokens))
        assert (logits - expected).abs().max() < 1e-4
    layers = compiled.all_layers
    assert compiled.runner.compilations == {(1, 64, layers): 1, (4, 64, layers): 1}  # each shape once


def test_every_shape_compiles_once_at_warm_up_and_never_while_serving():
    engine = compiling_engine(forward="compile")
    report = engine.warm_up()
    # query lengths 1..k+2; the target with all its layers and the self drafter's subset, the draft whole
    assert report.variants == 5 * 2 + 5
    compiled = {id(model): dict(model.runner.compilations) for model in engine.models}
    assert all(count == 1 for counts in compiled.values() for count in counts.values())
    serve_varied_requests(engine)
    assert {id(model): dict(model.runner.compilations) for model in engine.models} == compiled
