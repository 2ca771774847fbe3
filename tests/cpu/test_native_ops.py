"""engine/cpu/csrc's eager ops for a CPU float32 model (engine/model/kernels.py, engine/model/attention.py): the
norms agree with float64 within float32 rounding, the rotation rounds exactly as torch's ops do,
and the decode attention agrees with a float64 softmax on every instruction set this CPU runs, with
masked positions taking no part; the rotation fused with the cache write stores exactly what the
two apart store; a whole layer in one op gives the op-by-op values bit for bit. A CPU float32 model runs them (and agrees with torch's ops); a
bfloat16 one, one asked not to (a forward a runner compiles) or one without the extension runs
torch's. The chi-square and greedy suites run them too: their tiny targets are
CPU float32 models."""

from __future__ import annotations

import pytest
import torch

from engine.cpu import blocks as blocks_module
from engine.cpu.blocks import kernel_isa, layer_blocks, offer_blocks
from engine.cpu.matmul import BLOCKS, MatmulPlan
from engine.model import kernels
from engine.model.kv import KVCache
from tests.tiny import quantize_in_place, tiny_engine, tiny_llama

ISAS = list(range(kernel_isa() + 1))  # every instruction set this CPU runs, the portable reference first
U = 2.0**-24  # float32's unit roundoff
OPS = torch.ops.specserve


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 17, 64), (3, 40)])
def test_the_norms_agree_with_float64_within_float32_rounding(shape):
    torch.manual_seed(0)
    residual, delta, weight = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    total = residual.double() + delta.double()
    expected = weight.double() * total / (total.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    got_total, got = OPS.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(got_total, residual + delta)  # one float32 addition, as torch's
    bound = 8 * U * (weight.double().abs() * total.abs() / total.pow(2).mean(-1, keepdim=True).sqrt()) + 1e-30
    assert ((got.double() - expected).abs() <= bound).all()
    alone = OPS.rms_norm(residual, weight, 1e-5)
    assert torch.allclose(alone, kernels.rms_norm(residual, weight, 1e-5), rtol=8 * U, atol=0)


def test_the_rotation_rounds_exactly_as_torchs_ops_on_a_strided_view():
    torch.manual_seed(1)
    qkv = torch.randn(1, 5, 16 * 64)
    qk = qkv[..., : 12 * 64].view(1, 5, 12, 64).transpose(1, 2)  # [1, H, T, D], D contiguous only
    cos, sin = torch.randn(5, 64), torch.randn(5, 64)
    assert torch.equal(OPS.rotate(qk, cos, sin), kernels.rotate(qk, cos, sin))


def test_the_fused_rotation_writes_the_cache_exactly_as_rotation_then_write():
    torch.manual_seed(4)
    heads, kv_heads, dim, start, count = 6, 2, 32, 7, 3
    qkv = torch.randn(1, count, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(count, dim), torch.randn(count, dim)
    fused, separate = (
        KVCache(2, kv_heads, dim, 16, torch.float32, "cpu"),
        KVCache(2, kv_heads, dim, 16, torch.float32, "cpu"),
    )
    q, keys, values = fused.write_rotating(1, qkv, cos, sin, heads, start, start + count)
    by_head = qkv.view(1, count, heads + 2 * kv_heads, dim).transpose(1, 2)  # [1, heads, T, D]
    rotated = kernels.rotate(by_head[:, : heads + kv_heads], cos, sin)
    positions = torch.arange(start, start + count)
    expected_keys, expected_values = separate.write(
        1, positions, rotated[:, heads:], by_head[:, heads + kv_heads :], start + count
    )
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert torch.equal(fused.keys, separate.keys) and torch.equal(fused.values, separate.values)  # nothing else written


def reference_attention(query, keys, values, mask, scale):
    """In float64: query [1, H, Q, D] over keys/values [1, H, W, D], mask [Q, W] (True: attend)."""
    scores = (query.double() @ keys.double().transpose(-1, -2)) * scale  # [1, H, Q, W]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values.double()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("rows", "window", "dim"), [(1, 1, 64), (3, 15, 64), (15, 17, 64), (6, 300, 128), (51, 40, 16)]
)
def test_the_decode_attention_agrees_with_a_float64_softmax(isa, rows, window, dim):
    torch.manual_seed(rows + window)
    cache = torch.randn(2, 3, 400, dim)  # keys and values of 3 KV heads: the op reads views of a cache
    keys, values = cache[0, None, :, :window], cache[1, None, :, :window]  # [1, 3, W, D]
    query = torch.randn(1, 3, rows, dim)
    # each query row sees a prefix of the window, as a verify's rows do (the last sees all of it)
    mask = torch.arange(window)[None] <= (torch.arange(rows) % window + window - min(rows, window))[:, None]
    for row_mask in (mask, None):
        got = OPS.decode_attention(query, keys, values, row_mask, dim**-0.5, isa)
        expected = reference_attention(query, keys, values, row_mask, dim**-0.5)
        # float32 sums of window terms, and an exp within a few ulp: a bound well under any sampling effect
        assert torch.allclose(got.double(), expected, rtol=0, atol=64 * U * (1 + window**0.5)), (isa, row_mask is None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dim", [16, 64, 128])  # at AVX-512, one, four and eight chunks: the widths unrolled or not
def test_a_keys_score_is_the_same_bits_in_a_block_of_keys_and_alone(isa, dim):
    """The kernel scores keys a vector's width at a time (their lane sums taken together) and the
    last few of a window one by one. Two keys X and Y, seen at positions 0 and 32 of a window of 33
    (X in the first block, the rest of it and of the second masked; Y alone at the end) and at
    positions 0 and 1 of a window of 2 (both one by one), weigh the same values in the same order:
    the outputs are equal bit for bit only if a key's score is the same either way."""
    torch.manual_seed(dim)
    x_key, y_key, x_value, y_value = torch.randn(4, dim) * 2
    query = torch.randn(1, 3, 5, dim)  # [1, H_kv, Q, D]
    keys, values = torch.randn(1, 3, 33, dim), torch.randn(1, 3, 33, dim)
    keys[..., 0, :], keys[..., 32, :], values[..., 0, :], values[..., 32, :] = x_key, y_key, x_value, y_value
    mask = torch.zeros(5, 33, dtype=torch.bool)
    mask[:, [0, 32]] = True
    spread = OPS.decode_attention(query, keys, values, mask, dim**-0.5, isa)
    pair_keys, pair_values = torch.stack([x_key, y_key]).expand(1, 3, 2, dim), torch.stack([x_value, y_value])
    together = OPS.decode_attention(query, pair_keys.contiguous(), pair_values.expand(1, 3, 2, dim).contiguous(), None,
                                    dim**-0.5, isa)  # fmt: skip
    assert torch.equal(spread, together)
    unmasked = torch.ones(5, 33, dtype=torch.bool)  # every key seen: no block skipped or set aside
    assert not torch.equal(OPS.decode_attention(query, keys, values, unmasked, dim**-0.5, isa), spread)


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_attention_is_the_same_bits_beside_other_rows_and_alone(isa):
    """A KV head's rows are attended together, tile of keys by tile of keys (more rows than one
    group holds, a window of several tiles and a tail, holes in the mask, a row that sees nothing):
    each row's output is the bits it has when it is the only row."""
    torch.manual_seed(7)
    rows, window = 21, 150
    keys, values, query = torch.randn(1, 3, window, 64) * 2, torch.randn(1, 3, window, 64), torch.randn(1, 3, rows, 64)
    mask = torch.rand(rows, window) > 0.2
    mask[3] = False
    together = OPS.decode_attention(query, keys, values, mask, 0.125, isa)
    for row in range(rows):
        alone = OPS.decode_attention(
            query[:, :, row : row + 1].contiguous(), keys, values, mask[row : row + 1], 0.125, isa
        )
        assert torch.equal(together[:, :, row : row + 1], alone), row
    assert not together[:, :, 3].any() and together[:, :, 2].abs().sum() > 0


def test_the_gated_activation_is_the_same_bits_in_any_share_of_threads():
    """silu_gate splits rows into pieces among threads: a row's values at 2, 8 and 16 threads are the
    bits they have when it is alone on one thread (and silu(gate) * up within float32 rounding of
    float64's)."""
    torch.manual_seed(8)
    gate_up = torch.randn(1, 5, 2 * 600) * 4  # a row of two whole pieces and a tail
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [OPS.silu_gate(gate_up[:, row : row + 1].contiguous()) for row in range(5)]
        for count in (2, 8, 16):
            torch.set_num_threads(count)
            together = OPS.silu_gate(gate_up)
            for row in range(5):
                assert torch.equal(alone[row], together[:, row : row + 1]), (count, row)
    finally:
        torch.set_num_threads(threads)
    gate, up = gate_up[..., :600].double(), gate_up[..., 600:].double()
    assert torch.allclose(together.double(), gate * torch.sigmoid(gate) * up, rtol=8 * U, atol=1e-30)


@pytest.mark.parametrize("isa", ISAS)
def test_masked_positions_take_no_part_and_a_row_that_sees_nothing_is_zero(isa):
    torch.manual_seed(2)
    keys, values, query = torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64), torch.randn(1, 2, 3, 64)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[0, 10:] = False
    mask[2] = False
    got = OPS.decode_attention(query, keys, values, mask, 0.125, isa)
    keys[:, :, 10:], values[:, :, 10:] = 1e30, float("nan")  # what row 0 must not see
    changed = OPS.decode_attention(query, keys, values, mask, 0.125, isa)
    assert torch.equal(got[:, :, 0], changed[:, :, 0])
    assert torch.equal(got[:, :, 2], torch.zeros(1, 2, 64))


def test_a_cpu_float32_model_runs_them_where_it_can(monkeypatch):
    engine = tiny_engine(tiny_llama(seed=3, vocab_size=64), None)
    assert engine.target.kernels.native
    reference = tiny_engine(tiny_llama(seed=3, vocab_size=64), None)
    reference.target.use_kernels("eager", native=False)
    assert not reference.target.kernels.native
    tokens = list(range(1, 12))
    native_logits = engine.target.extend(tokens, num_logits=len(tokens))  # a prompt: SDPA, native norms
    torch_logits = reference.target.extend(tokens, num_logits=len(tokens))
    assert torch.allclose(native_logits, torch_logits, rtol=0, atol=1e-5)
    for _ in range(3):  # decode steps: the native attention too
        native_step, torch_step = engine.target.extend([5]), reference.target.extend([5])
        assert torch.allclose(native_step, torch_step, rtol=0, atol=1e-5)
    assert not tiny_engine(tiny_llama(seed=3, vocab_size=64).to(torch.bfloat16), None).target.kernels.native

    def missing() -> int:
        raise blocks_module.BlocksUnavailable("engine/cpu/_blocks was not built at install (no C++ compiler?)")

    monkeypatch.setattr(blocks_module, "kernel_isa", missing)
    assert not tiny_engine(tiny_llama(seed=3, vocab_size=64), None).target.kernels.native


def blocks_model(fused: bool):
    """A tiny CPU float32 target quantized in place, every product through its GGUF blocks;
    ``fused``: its layers run as specserve::decode_layer at decode and verify, else op by op."""
    target = tiny_llama(seed=5, vocab_size=64, layers=3)
    file = quantize_in_place(target, formats=("Q4_1",))  # q, k and v of one format: one part
    model = tiny_engine(target, None).target
    offer_blocks(model, file)  # held from now on
    if not fused:
        model._layer_products = [None] * len(model.layers)
    model.keep_features((0, 2))
    return model


def test_a_fused_layer_gives_the_op_by_op_values_bit_for_bit():
    fused, apart = blocks_model(True), blocks_model(False)
    assert layer_blocks(fused.weights.prepared, fused._layer_products[0]) is not None
    steps = [list(range(1, 30)), [7], [8, 9, 10, 11, 12], [13]]  # a prompt (op by op in both), decode, verify
    for tokens in steps:
        assert torch.equal(fused.extend(tokens, num_logits=len(tokens)), apart.extend(tokens, num_logits=len(tokens)))
    fused.cache.rollback(31)  # a rejected verify's tail, then a decode over it
    apart.cache.rollback(31)
    assert torch.equal(fused.extend([40]), apart.extend([40]))
    length = fused.cache.length
    assert torch.equal(fused.cache.keys[:, :, :, :length], apart.cache.keys[:, :, :, :length])
    assert torch.equal(fused.cache.values[:, :, :, :length], apart.cache.values[:, :, :, :length])
    assert torch.equal(fused.feature_rows(0, length), apart.feature_rows(0, length))
    with torch.profiler.profile() as profile:  # and the fused model did run its layers in one call
        fused.extend([41])
    calls = {e.key: e.count for e in profile.key_averages()}
    assert calls.get("specserve::decode_layers") == 1 and "specserve::decode_layer" not in calls


def test_a_layers_fused_arguments_are_built_once_while_its_weights_are_held_alike():
    """A step asks for each layer's decode_layer arguments: built once, the same tuple while the same
    weights are held, built anew from the new weights once a plan changes how they are held."""
    model = blocks_model(True)
    products = model._layer_products[0]
    first = model.weights.layer_arguments(products)
    assert first is not None and model.weights.layer_arguments(products) is first
    assert model.weights.layer_arguments(None) is None  # a layer the fused op does not apply to
    model.weights.use_plan(MatmulPlan())  # every product dense again: no blocks to fuse
    assert model.weights.layer_arguments(products) is None
    model.weights.use_plan(MatmulPlan.uniform(BLOCKS, 8, model.weights.shapes))  # the blocks again
    again = model.weights.layer_arguments(products)
    assert again is not first and again == layer_blocks(model.weights.prepared, products)
