"""The pointwise kernels between products, compiled (engine/model/kernels.py), proven on CPU where CI has
no GPU: inductor traces them without a graph break and matches the eager kernels, each compiles at
most twice per model whatever the number of tokens, and a compile failure is handled at start-up.
Exactness with compiled kernels lives in test_lossless.py (DEVICE_PATH_SETUPS)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.factory import compile_kernels, warm_up
from engine.model.model import CausalLM
from engine.model.runner import GraphRunner
from engine.request import Request
from engine.sampling import SamplingParams
from tests.tiny import (
    compiling_engine,
    perturbed_copy,
    serve_varied_requests,
    tiny_engine,
    tiny_llama,
    tiny_of_family,
)

FUNCTIONS = {"rms_norm", "add_rms_norm", "rotate", "gate"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # compiled code of earlier tests does not count here
    yield


def test_inductor_kernels_match_eager_ones_at_every_length():
    """inductor's generated code, not just its trace: prefill, decode and verify lengths."""
    model = tiny_llama(seed=3, vocab_size=96, init=0.2)
    eager, fused = CausalLM(model, 64), CausalLM(model, 64)
    fused.use_kernels("compiled")
    for tokens in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14, 15], [16], [17, 18]):
        expected = eager.extend(tokens, num_logits=len(tokens))  # [T, V]
        logits = fused.extend(tokens, num_logits=len(tokens))
        assert (logits - expected).abs().max() < 1e-4
        assert torch.allclose(fused.last_hidden, eager.last_hidden, atol=1e-5)
    # one variant for a single token and one for any other number (9, 5 and 2 tokens shared it)
    assert fused.kernels.compilations == {"rms_norm": 2, "add_rms_norm": 2, "rotate": 2, "gate": 2}


def test_compiled_kernels_run_inside_a_compiled_forward_and_the_self_drafters_partial_pass():
    model = tiny_llama(seed=3, vocab_size=96, layers=3, init=0.2)
    eager, fused = CausalLM(model, 64), CausalLM(model, 64)
    fused.use_kernels("compiled", backend="aot_eager")
    fused.runner = GraphRunner(fused, "compile", max_query=4, backend="aot_eager")
    eager.extend(list(range(1, 12)))
    fused.extend(list(range(1, 12)))
    for tokens in ([20], [21, 22, 23]):
        start = eager.cache.length
        expected = eager.draft_through(tokens, start, (0, 2), num_logits=len(tokens))
        assert torch.allclose(fused.draft_through(tokens, start, (0, 2), num_logits=len(tokens)), expected, atol=1e-5)
        expected = eager.extend(tokens, num_logits=len(tokens))
        assert torch.allclose(fused.extend(tokens, num_logits=len(tokens)), expected, atol=1e-5)
    assert set(fused.runner.compilations.values()) == {1}


def test_each_kernel_compiles_at_warm_up_and_never_while_serving():
    """Target, draft and self drafter, a stream of requests with varying k, drafters and prompts."""
    engine = compiling_engine(kernels="compiled")
    report = warm_up(engine)
    assert "pointwise kernels compiled: 16 compilations" in report.describe()  # 4 functions x 2, two models
    compiled = {id(model): dict(model.kernels.compilations) for model in engine.models}
    assert all(set(counts) == FUNCTIONS and set(counts.values()) == {2} for counts in compiled.values())
    serve_varied_requests(engine, max_prompt=60)
    assert {id(model): dict(model.kernels.compilations) for model in engine.models} == compiled


def test_a_compilation_after_warm_up_is_logged(caplog):
    engine = compiling_engine(kernels="compiled")
    warm_up(engine)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    list(engine.generate(Request("quiet", [1, 2, 3], params)))
    assert "compilations while serving" not in caplog.text
    hidden = torch.ones(1, 2, engine.target.config.hidden_size, dtype=torch.float64)  # a dtype never warmed up
    engine.target.kernels.rms_norm(hidden, engine.target.norm.weight.double())
    list(engine.generate(Request("after", [1, 2, 3], params)))
    assert "1 compilations while serving since warm-up" in caplog.text


def test_kernels_are_compiled_only_under_cuda_graphs_unless_asked():
    assert EngineConfig(device="cpu").kernel_mode == "eager"
    assert EngineConfig(device="cpu", forward="compile").kernel_mode == "eager"  # the forward fuses them itself
    assert EngineConfig(device="cpu", kernels="compiled").kernel_mode == "compiled"
    with pytest.raises(ConfigError, match="kernels must be one of auto, eager, compiled"):
        EngineConfig(kernels="fused")


def _refusing_backend(graph_module, example_inputs):
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


def test_a_kernel_compile_failure_falls_back_to_eager_kernels_or_fails_start_up_when_asked_for(caplog):
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    draft = perturbed_copy(target, 0.05, seed=1)
    asked = tiny_engine(target, draft, kernels="compiled", compile_backend=_refusing_backend)
    with pytest.raises(ConfigError, match="compiling the pointwise kernels failed .*C compiler.*use --kernels eager"):
        warm_up(asked)
    # "auto" compiles them only under CUDA graphs; the fallback it takes where compiling fails:
    engine = tiny_engine(target, draft, kernels="compiled", compile_backend=_refusing_backend)
    said = compile_kernels(engine, required=False)
    assert said.startswith("pointwise kernels eager: compiling them failed (RuntimeError: Failed to find C compiler")
    assert all(model.kernels.mode == "eager" for model in engine.models)
    assert "they run eagerly" in caplog.text  # a warning in the log, besides the start-up line
    eager = tiny_engine(target, draft, kernels="eager")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = [
        [t for step in e.generate(Request("r", [1, 2, 3, 4], params)) for t in step.token_ids] for e in (engine, eager)
    ]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12


def _refusing_large_graphs(graph_module, example_inputs):
    """A backend that compiles the kernels' small graphs and refuses a whole forward's."""
    if len(graph_module.graph.nodes) > 60:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    return graph_module.forward


def test_a_forward_that_cannot_be_prepared_stops_start_up_naming_what_to_turn_off():
    engine = compiling_engine(forward="compile", kernels="compiled", compile_backend=_refusing_large_graphs)
    with pytest.raises(ConfigError) as raised:
        warm_up(engine)
    message = str(raised.value)
    assert message.startswith(
        "preparing the compile forwards failed (RuntimeError: CUDA error: operation not permitted"
    )
    assert message.endswith("try --kernels eager, or --enforce-eager")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "mistral"])
def test_compiled_kernels_serve_every_supported_family(model_type):
    """Qwen3's per-head norms stay eager around the compiled rotation; Qwen2's biases sit in the products."""
    model = tiny_of_family(model_type, vocab_size=100)
    for param in model.parameters():
        param.data.normal_(0.0, 0.2)
    eager, fused = CausalLM(model, 64), CausalLM(model, 64)
    fused.use_kernels("compiled", backend="aot_eager")
    for tokens in ([1, 2, 3, 4, 5], [6], [7, 8, 9]):
        expected = eager.extend(tokens, num_logits=len(tokens))
        assert torch.allclose(fused.extend(tokens, num_logits=len(tokens)), expected, atol=1e-5)
    assert set(fused.kernels.compilations.values()) == {2}
