"""The static-shape forward and the runner that compiles or captures it (engine/model/runner.py), proven
on CPU: CI has no GPU. Exactness on the compiled path lives in test_lossless.py (DEVICE_PATH_SETUPS)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.factory import warm_up
from engine.model.attention import attention_chunks, split_attention
from engine.model.model import CausalLM
from engine.model.runner import GraphRunner, windows
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
    report = warm_up(engine)
    # query lengths 1..k+2; the target with all its layers and the self drafter's subset, the draft whole
    assert report.variants == 5 * 2 + 5
    compiled = {id(model): dict(model.runner.compilations) for model in engine.models}
    assert all(count == 1 for counts in compiled.values() for count in counts.values())
    serve_varied_requests(engine)
    assert {id(model): dict(model.runner.compilations) for model in engine.models} == compiled


@pytest.mark.parametrize("window,num_queries", [(4096, 4), (1000, 24), (8192, 1)])
def test_split_attention_equals_one_attention_call(window, num_queries):
    generator = torch.Generator().manual_seed(window)
    query = torch.randn(1, 2, num_queries, 16, generator=generator)  # [1, H_kv, Q, D]
    keys, values = torch.randn(2, 1, 2, window, 16, generator=generator)  # [1, H_kv, W, D] each
    mask = torch.rand(num_queries, window, generator=generator) < 0.6  # [Q, W]
    mask[:, 0] = True  # every query sees a key
    expected = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.25)
    chunks = attention_chunks(window)
    assert window % chunks == 0
    assert torch.allclose(split_attention(query, keys, values, mask, 0.25, chunks), expected, atol=1e-6)


def test_attention_chunks_divide_the_window_into_about_1024_positions():
    assert [attention_chunks(w) for w in (256, 4096, 32768, 10000, 4097, 2**17)] == [1, 4, 32, 8, 1, 64]


def test_a_split_window_compiles_whole_and_matches_eager_and_warm_up_chooses_by_measurement():
    model = tiny_llama(seed=3, vocab_size=96, init=0.2)
    eager, compiled = CausalLM(model, 8192), CausalLM(model, 8192)
    compiled.runner = GraphRunner(compiled, "compile", max_query=4, backend="aot_eager")
    compiled.runner.attention = {4096: 4}  # forced: this CPU may well measure one call faster
    prompt = torch.randint(1, 96, (2500,), generator=torch.Generator().manual_seed(0)).tolist()
    eager.extend(prompt)
    compiled.extend(prompt)  # prefill stays eager; the next tokens fall in the 4096 window
    for tokens in ([7], [8, 9, 10, 11]):
        expected = eager.extend(tokens, num_logits=len(tokens))
        assert (compiled.extend(tokens, num_logits=len(tokens)) - expected).abs().max() < 1e-5
    chooser = GraphRunner(eager, "compile", max_query=4, backend="aot_eager")
    chooser.choose_attention(repeats=3)
    assert set(chooser.attention) == {4096, 8192} == set(chooser.attention_ms)  # the windows of SPLIT_MIN or more
    for window, (fused_ms, split_ms) in chooser.attention_ms.items():
        assert chooser.attention[window] == (attention_chunks(window) if split_ms < fused_ms else 0)


def test_split_attention_that_cannot_run_leaves_one_attention_call(monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("bmm with out_dtype is not supported on this device")

    monkeypatch.setattr("engine.model.runner.split_attention", refuse)
    chooser = GraphRunner(CausalLM(tiny_llama(seed=3, vocab_size=96), 4096), "compile", max_query=2)
    chooser.choose_attention(repeats=1)
    assert chooser.attention == {4096: 0} and chooser.describe_attention() == ""
    assert "split attention failed at window 4096 (bmm with out_dtype is not supported" in caplog.text
