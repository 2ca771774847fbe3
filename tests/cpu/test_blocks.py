"""Products over GGUF quantized blocks (engine/cpu/blocks.py, engine/cpu/csrc): the weights each format
decodes to are exactly the gguf package's, on files the tests write and on the embedded one; the
products agree with float64 within float32 summation bounds at every row count and on every
instruction set this CPU runs; the plan holds the blocks only by a margin; and an engine without
the kernels says so and runs float32. With int8 activations (Q4_0, Q4_1 and Q8_0 repacked): the same
weights, every row computed alike whatever the row count, the vector and portable paths the same bits,
and the products llama.cpp's law (activations rounded to int8 per block of 32). The chi-square and greedy suites run the blocks too
(``model-blocks`` in tests/tiny.py)."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from engine.cpu import blocks as blocks_module
from engine.cpu import matmul as matmul_module
from engine.cpu.blocks import (
    DIRECT_ROWS,
    FORMATS,
    INT8_Q4,
    INT8_Q8,
    BlockPart,
    BlockWeight,
    FileTensors,
    decode,
    kernel_isa,
    offer_blocks,
)
from engine.cpu.int8_blocks import int8_part, int8_weight
from engine.cpu.matmul import (
    BLOCKS,
    CROSSING_ROWS,
    HELD_MARGIN,
    LONG,
    UNBOUNDED,
    MatmulPlan,
    _held_choice,
    measure_direct_rows,
    with_direct_rows,
)
from engine.model.loader import embedded_gguf
from tests.conftest import EMBEDDED_FLOAT32
from tests.tiny import quantize_in_place, tiny_engine, tiny_llama

ISAS = list(range(kernel_isa() + 1))  # every instruction set this CPU runs, the portable reference first
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # formats the gguf package can also write
SUPER_BLOCK = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}  # bytes per 256 weights, offsets of its fp16 scales


def written_blocks(name: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Blocks [rows, row bytes] of format ``name``: what the gguf package writes for random weights
    (some rows tiny, for subnormal half-precision scales), or, for the K formats it cannot write,
    random bytes with finite half-precision scales."""
    generator = np.random.default_rng(seed)
    kind = getattr(gguf.GGMLQuantizationType, name)
    if name in QUANTIZABLE:
        weights = generator.standard_normal((rows, columns)).astype(np.float32)
        weights[0] *= 1e-6  # scales below float16's normal range
        weights[1] = 0.0
        return gguf.quants.quantize(weights, kind)
    size, scale_offsets = SUPER_BLOCK[name]
    data = generator.integers(0, 256, (rows, columns // 256, size), dtype=np.uint8)
    for offset in scale_offsets:
        scales = generator.standard_normal((rows, columns // 256)).astype(np.float16)
        scales[0] = np.float16(3e-6)  # subnormal
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, columns // 256, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_decodes_to_the_gguf_packages_float32_values(name, isa):
    data = written_blocks(name, rows=6, columns=512, seed=len(name))
    expected = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, name)).reshape(6, 512)
    decoded = decode(BlockPart(torch.from_numpy(data), FORMATS[name]), 512, isa)
    assert torch.equal(decoded, torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_products_agree_with_float64_within_float32_summation_bounds(name):
    """Every row count from 1 past DIRECT_ROWS (the kernel, then decoded tiles), on every
    instruction set: |error| <= n u sum|x||w| (n = in features, u = 2^-24), the bound of a float32
    sum of n products in any order."""
    out_features, in_features = 40, 512
    data = torch.from_numpy(written_blocks(name, out_features, in_features, seed=3))
    generator = torch.Generator().manual_seed(0)
    for isa in ISAS:
        weight = BlockWeight((BlockPart(data, FORMATS[name]),), in_features, None, isa)
        dense = weight.dense().double()  # [O, I]
        for rows in [*range(1, DIRECT_ROWS + 2), 64]:
            x = torch.randn(rows, in_features, generator=generator)  # [N, I]
            product = weight.linear(x).double()  # [N, O]
            exact = x.double() @ dense.T
            bound = in_features * 2.0**-24 * (x.double().abs() @ dense.abs().T) + 1e-30
            assert (product - exact).abs().le(bound).all(), f"{name}, isa {isa}, {rows} rows"


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_int8_repacking_keeps_the_weights_and_their_rows(name):
    data = torch.from_numpy(written_blocks(name, rows=48, columns=256, seed=7))
    original = BlockPart(data, FORMATS[name])
    repacked = int8_part(original, 256)
    block_bytes = 36 if name == "Q8_0" else 20  # Q4_1's size; Q8_0's and its m
    assert repacked.format == (INT8_Q8 if name == "Q8_0" else INT8_Q4)
    assert repacked.rows == 48 and repacked.blocks.nbytes == 48 * 8 * block_bytes
    assert torch.equal(decode(repacked, 256, kernel_isa()), decode(original, 256, kernel_isa()))
    ids = torch.tensor([0, 17, 47, 17, 5])
    for part, isa in [(part, isa) for part in (original, repacked) for isa in ISAS]:  # a lookup: each row alone
        weight = BlockWeight((part,), 256, None, isa)
        assert torch.equal(weight.rows(ids), decode(original, 256, kernel_isa())[ids]), f"{part.format}, isa {isa}"
        with pytest.raises(RuntimeError, match="row 48 of 48 rows"):
            weight.rows(torch.tensor([3, 48]))
    assert int8_part(BlockPart(data[:40], FORMATS[name]), 256) is None  # rows not in sixteens
    q6 = BlockPart(torch.from_numpy(written_blocks("Q6_K", 16, 256, seed=1)), FORMATS["Q6_K"])
    assert int8_part(q6, 256) is None and int8_weight(BlockWeight((q6,), 256, None, 0)).parts == (q6,)


def int8_law(x: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8-activation product in float64, and its error scale: each row of x [N, I] rounded
    to int8 per block of 32 in float32 as the kernels round it (scale max|x| / 127, values
    rint(x * (127 / max|x|))), then sum_b scale_b * (w_b . x_q,b) [N, O] and sum_b |scale_b| |w_b| . |x_q,b|."""
    blocks = x.numpy().reshape(x.shape[0], -1, 32)  # [N, B, 32] float32
    largest = np.abs(blocks).max(-1, keepdims=True)  # [N, B, 1]
    with np.errstate(divide="ignore"):
        inverse = np.where(largest > 0, np.float32(127) / largest, np.float32(0)).astype(np.float32)
    values = np.rint(blocks * inverse)  # [N, B, 32], float32 products rounded half to even
    scales = torch.from_numpy((largest / np.float32(127)).astype(np.float32)).double()  # [N, B, 1]
    per_block = torch.einsum(
        "nbj,obj->nob", torch.from_numpy(values).double(), dense.double().view(dense.shape[0], -1, 32)
    )
    magnitude = torch.einsum(
        "nbj,obj->nob", torch.from_numpy(values).double().abs(), dense.double().abs().view(dense.shape[0], -1, 32)
    )
    return (per_block * scales.transpose(1, 2)).sum(-1), (magnitude * scales.transpose(1, 2)).sum(-1)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_int8_products_follow_llama_cpps_law_the_same_for_every_row_and_path(name):
    """Every row count from 1 to 20 and 64 (the kernel at every length), on every path this CPU runs
    (portable, AVX2, AVX-512 VNNI): a row's product is the same bits whatever rows it is multiplied
    with, the paths give the same bits, and the value is the int8 law's within float32 rounding of its sum
    (and about 1% from the float32 product's)."""
    out_features, in_features = 48, 512
    part = int8_part(
        BlockPart(torch.from_numpy(written_blocks(name, out_features, in_features, seed=3)), FORMATS[name]), in_features
    )
    weights = [BlockWeight((part,), in_features, None, isa) for isa in ISAS]  # portable, AVX2, AVX-512 VNNI
    dense = weights[0].dense()  # [O, I]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, in_features, generator=generator)  # [64, I]
    x[3, :32] = 0.0  # a block of zeros: scale 0
    x[5, :32] = torch.tensor([127.0] + [k + 0.5 for k in range(-15, 16)])  # ties, each rounded to the even value
    alone = torch.cat([weights[-1].linear(x[i : i + 1]) for i in range(64)])  # [64, O], one row at a time
    for weight in weights:
        for rows in [*range(1, 21), 64]:
            assert torch.equal(weight.linear(x[:rows]), alone[:rows]), f"{name}, isa {weight.isa}, {rows} rows"
    exact, magnitude = int8_law(x, dense)
    assert (alone.double() - exact).abs().le(1e-5 * magnitude + 1e-30).all()
    float32 = x @ dense.T
    assert 0 < float((alone - float32).norm() / float32.norm()) < 0.03


def test_fused_parts_and_bias_land_in_their_columns():
    """A fused product (q, k, v as parts of other formats) equals the parts' products side by side."""
    parts = tuple(
        BlockPart(torch.from_numpy(written_blocks(name, rows, 64, seed=rows)), FORMATS[name])
        for name, rows in (("Q4_1", 8), ("Q8_0", 4), ("Q5_0", 4))
    )
    bias = torch.randn(16)
    fused = BlockWeight(parts, 64, bias, kernel_isa())
    x = torch.randn(3, 64)
    expected = torch.cat([x @ decode(part, 64, kernel_isa()).T for part in parts], dim=1) + bias
    torch.testing.assert_close(fused.linear(x), expected, rtol=1e-5, atol=1e-5)
    assert fused.dense().shape == (16, 64)


def test_long_inputs_go_through_the_kernel_up_to_the_rows_measured_for_their_shape(monkeypatch):
    """Past DIRECT_ROWS an input goes through the kernel up to the weight's direct_rows, then by
    decoded tiles (the same product within float32 rounding); measure_direct_rows finds the most
    rows of CROSSING_ROWS where the kernel was no slower (a count the tiles win once is timed
    again), and with_direct_rows times each shape once, never a weight whose rows must be computed
    alike."""
    data = torch.from_numpy(written_blocks("Q4_1", 40, 512, seed=5))
    weight = BlockWeight((BlockPart(data, FORMATS["Q4_1"]),), 512, None, kernel_isa())
    x = torch.randn(64, 512)
    calls = []
    direct, tiled = BlockWeight.direct, BlockWeight.tiled
    monkeypatch.setattr(BlockWeight, "direct", lambda self, *a: (calls.append("direct"), direct(self, *a))[1])
    monkeypatch.setattr(BlockWeight, "tiled", lambda self, *a: (calls.append("tiled"), tiled(self, *a))[1])
    by_tiles = weight.linear(x)
    assert calls == ["tiled"]
    calls.clear()
    by_kernel = replace(weight, direct_rows=64).linear(x)
    assert calls == ["direct"]
    torch.testing.assert_close(by_kernel, by_tiles, rtol=1e-5, atol=1e-4)
    calls.clear()
    replace(weight, direct_rows=63).linear(x)
    assert calls == ["tiled"]

    # timings made up, on a clock only the products move (a sleep overran under load and failed it):
    # the kernel's grow with the rows (0.02 ms each), the tiles' are fixed at 2 ms, so the kernel is
    # no slower up to 100 rows
    clock = [0.0]
    monkeypatch.setattr(matmul_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def takes(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(BlockWeight, "direct", lambda self, rows, *a: takes(2e-5 * rows.shape[0]))
    monkeypatch.setattr(BlockWeight, "tiled", lambda self, *a: takes(2e-3))
    assert measure_direct_rows(weight) == max(rows for rows in CROSSING_ROWS if rows <= 100)
    tiled_calls = iter(range(10**6))  # three per timing; the 4th to 6th: the first timing at 64 rows
    monkeypatch.setattr(BlockWeight, "tiled", lambda self, *a: takes(1e-6 if 3 <= next(tiled_calls) < 6 else 2e-3))
    assert measure_direct_rows(weight) == 64  # that timing disturbed: timed again, the kernel won
    monkeypatch.setattr(BlockWeight, "tiled", lambda self, *a: takes(1e-6))
    assert measure_direct_rows(weight) == DIRECT_ROWS  # the tiles won from the first
    monkeypatch.setattr(BlockWeight, "tiled", lambda self, *a: takes(0.03))
    assert measure_direct_rows(weight) == UNBOUNDED  # the kernel won at every count

    timed = []
    monkeypatch.setattr(matmul_module, "measure_direct_rows", lambda w: timed.append(w.crossing_key) or 128)
    alike = int8_weight(
        BlockWeight(
            (BlockPart(torch.from_numpy(written_blocks("Q4_0", 32, 64, 1)), FORMATS["Q4_0"]),), 64, None, kernel_isa()
        )
    )
    measured = {}
    held = with_direct_rows({"a": weight, "b": replace(weight), "c": alike}, measured)
    assert timed == [weight.crossing_key]  # one shape timed once; the int8 weight not at all
    assert held["a"].direct_rows == held["b"].direct_rows == 128 and held["c"].direct_rows == DIRECT_ROWS
    assert measured == {weight.crossing_key: 128, alike.crossing_key: DIRECT_ROWS}
    assert with_direct_rows({"a": weight}, {weight.crossing_key: 32})["a"].direct_rows == 32  # known: not timed
    assert timed == [weight.crossing_key]


def test_the_embedded_file_decodes_to_the_gguf_packages_values():
    reader = gguf.GGUFReader(embedded_gguf())
    kinds = set()
    for tensor in reader.tensors:
        if int(tensor.tensor_type) not in FORMATS.values():
            continue
        kinds.add(tensor.tensor_type.name)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [O, I]
        part = BlockPart(torch.from_numpy(np.array(tensor.data)), int(tensor.tensor_type))
        assert torch.equal(decode(part, expected.shape[1], kernel_isa()), torch.from_numpy(expected)), tensor.name
    assert kinds == {"Q4_1", "Q8_0"}


def test_an_engine_holds_its_products_as_blocks_and_matches_the_loaded_rows():
    """Blocks offered for a quantized tiny model match every product (q and k rows included) and
    are held at once (every row through them: rows alike), the float32 weights freed; dense gives
    them back exactly, and so does a plan without the blocks."""
    target = tiny_llama(seed=5, vocab_size=64)
    file = quantize_in_place(target)
    engine = tiny_engine(target, None)
    weights = engine.target.weights
    before = {key: getattr(module, name).clone() for module, name in weights.products for key in [(id(module), name)]}
    offer_blocks(engine.target, file)
    assert len(weights.blocks) == len(weights.products)
    assert weights.blocks_line.startswith(f"{len(weights.products)}/{len(weights.products)} products")
    assert all(getattr(module, name).numel() == 0 for module, name in weights.products)
    assert all((id(module), name) in weights.prepared for module, name in weights.products)
    assert weights.nbytes < sum(weight.nbytes for weight in before.values())
    for module, name in weights.products:
        assert torch.equal(weights.dense(module, name), before[id(module), name])
    weights.use_plan(MatmulPlan())  # back to float32, exactly as loaded
    for module, name in weights.products:
        assert torch.equal(getattr(module, name), before[id(module), name])


def test_a_tied_embedding_table_is_freed_for_the_heads_blocks_and_lookups_decode_the_same_rows():
    """The embedded model's LM head is its embedding table: held as the head's Q8_0 blocks, the
    float32 table goes too, and lookups decode their rows from the blocks, bit for bit."""
    target = tiny_llama(seed=8, vocab_size=64)
    target.lm_head.weight = target.model.embed_tokens.weight  # tied, as the embedded model's are
    file = quantize_in_place(target)
    engine = tiny_engine(target, None)
    model, ids = engine.target, torch.tensor([3, 7, 7, 63, 0])
    table, rows = model.embed.weight.detach().clone(), model.embedding(ids)  # [V, E], [T, E]
    offer_blocks(model, file)  # held at once
    assert model.embed.weight.numel() == 0 and model.lm_head.weight is model.embed.weight
    assert torch.equal(model.embedding(ids), rows)
    assert torch.equal(model.weights.dense(model.lm_head, "weight"), table)
    model.weights.use_plan(MatmulPlan())  # back to float32: the table is restored exactly
    assert torch.equal(model.embed.weight, table) and model.weights.embedding_rows(ids) is None


def test_a_product_whose_blocks_differ_from_the_loaded_weight_stays_float32():
    target = tiny_llama(seed=6, vocab_size=64)
    file = quantize_in_place(target)
    with torch.no_grad():
        target.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0  # no longer what its blocks decode to
    engine = tiny_engine(target, None)
    offer_blocks(engine.target, file)
    weights = engine.target.weights
    assert len(weights.blocks) == len(weights.products) - 1
    assert "model.layers.0.mlp.down_proj" in weights.blocks_line


def test_without_the_kernels_the_engine_says_so_and_runs_float32(monkeypatch):
    def missing() -> int:
        raise blocks_module.BlocksUnavailable("engine/cpu/_blocks was not built at install (no C++ compiler?)")

    monkeypatch.setattr(blocks_module, "kernel_isa", missing)
    target = tiny_llama(seed=7, vocab_size=64)
    file = quantize_in_place(target)
    engine = tiny_engine(target, None)
    offer_blocks(engine.target, file)
    assert engine.target.weights.blocks == {}
    assert "float32 products: engine/cpu/_blocks was not built" in engine.target.weights.describe()


def _timings(ratio: float) -> dict:
    return {"linear": 100.0, "weight_first": 120.0, BLOCKS: 100.0 * ratio}


@pytest.mark.parametrize(
    "ratio,choice", [(0.5, BLOCKS), (1 - HELD_MARGIN / 2, "retime"), (1.0, "retime"), (1 + 2 * HELD_MARGIN, None)]
)
def test_a_held_form_is_taken_only_by_a_margin(ratio, choice):
    """Within the margin the plan times again, and keeps float32 if still within it: the choice
    between two forms that run alike does not flip from one start to the next."""
    key = (8, 8, torch.float32)
    plan = MatmulPlan(2, timings_us={(key, slot): _timings(ratio) for slot in (1, 2, LONG)})
    assert _held_choice(plan, key, [1, 2, LONG], [BLOCKS]) == choice


def test_file_tensors_read_the_embedded_files_blocks():
    file = FileTensors.read(embedded_gguf())
    assert file.arch == "llama"
    kinds = {kind for kind, _ in file.tensors.values()}
    assert kinds == {FORMATS["Q4_1"], FORMATS["Q8_0"]}
    assert sum(blocks.nbytes for _, blocks in file.tensors.values()) < 100 * 2**20


PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Summarise in one sentence: the meeting moved to Thursday because the room was booked.",
)


@pytest.mark.slow
def test_greedy_output_on_the_embedded_model_equals_the_float32_paths(embedded):
    """The embedded model served from its blocks and from float32 copies of them: the same greedy
    tokens, or a first divergence at a near-tie, whose logit gap (float32 path) is reported."""
    from engine.request import Request
    from engine.sampling import SamplingParams

    outputs, engines = {}, {}
    for held in (True, False):
        loaded = embedded(**{**EMBEDDED_FLOAT32, "gguf_blocks": held})
        engines[held] = loaded
        if held:
            assert "blocks" in loaded.engine.warm_up_report and "121/121 products" in loaded.engine.warm_up_report
        outputs[held] = []
        for i, text in enumerate(PROMPTS):
            chat = [{"role": "user", "content": text}]
            prompt = loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            ids = loaded.tokenizer(prompt)["input_ids"]
            params = SamplingParams(max_tokens=48, temperature=0.0)
            request = Request(str(i), ids, params, drafter="none")
            tokens = [t for out in loaded.engine.generate(request) for t in out.token_ids]
            outputs[held].append((ids, tokens))
    float32 = engines[False].engine.target
    for (ids, from_blocks), (_, from_float32) in zip(outputs[True], outputs[False], strict=True):
        at = next((i for i, (a, b) in enumerate(zip(from_blocks, from_float32, strict=False)) if a != b), None)
        if at is None:
            assert from_blocks == from_float32
            continue
        float32.cache.rollback(0)
        logits = float32.extend(ids + from_float32[:at])[-1]  # [V]
        top = logits.topk(2).values
        gap = float(top[0] - top[1])
        print(f"first divergence at token {at}: float32 top-2 logit gap {gap:.2e}")
        assert gap < 1e-3, f"the paths diverge at token {at} where the float32 path's top-2 gap is {gap:.2e}"
        assert int(logits.topk(2).indices[1]) == from_blocks[at]  # the blocks took the runner-up


def test_a_stored_plan_is_read_back_at_the_next_start_and_measured_again_on_request(tmp_path, monkeypatch):
    from engine.cpu.plan_cache import PlanCache

    # reading back is tested here, whatever else runs on the host: the test below keeps busy plans out
    monkeypatch.setattr(matmul_module, "UNDISTURBED_SHARE", 0.0)
    target = tiny_llama(seed=8, vocab_size=64)
    pristine = copy.deepcopy(target)  # copied before the first engine plans: a packed weight frees its dense copy
    first = tiny_engine(target, None).target
    cache = PlanCache(tmp_path)
    measured = first.weights.plan_matmuls(6, cache)
    assert len(list(tmp_path.glob("*.json"))) == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("a stored plan matched: nothing to measure")

    again = tiny_engine(copy.deepcopy(pristine), None).target
    with monkeypatch.context() as patch:
        patch.setattr(MatmulPlan, "measure", no_measuring)
        assert again.weights.plan_matmuls(6, cache).choices == measured.choices
    assert "stored plan, measured" in again.weights.describe()  # the start-up line says it was read back
    assert "stored plan" not in first.weights.describe()

    def held(model) -> list[bool]:
        return [(id(module), name) in model.weights.prepared for module, name in model.weights.products]

    assert held(again) == held(first)  # the weights held packed are the same ones
    other_rows = tiny_engine(copy.deepcopy(pristine), None).target
    with monkeypatch.context() as patch:  # another key (other row counts): measured
        patch.setattr(MatmulPlan, "measure", no_measuring)
        with pytest.raises(AssertionError, match="nothing to measure"):
            other_rows.weights.plan_matmuls(4, cache)
    remeasured = tiny_engine(copy.deepcopy(pristine), None).target
    with monkeypatch.context() as patch:
        patch.setattr(MatmulPlan, "measure", no_measuring)
        with pytest.raises(AssertionError, match="nothing to measure"):
            remeasured.weights.plan_matmuls(6, PlanCache(tmp_path, remeasure=True))
    (next(tmp_path.glob("*.json"))).write_text("not json")  # unreadable: measured again, with a warning
    broken = tiny_engine(copy.deepcopy(pristine), None).target
    assert broken.weights.plan_matmuls(6, cache).choices

    # a GGUF target's products are held as its blocks, each row through the kernel at every row
    # count: nothing to measure, nothing stored
    blocks = tiny_engine(copy.deepcopy(pristine), None).target
    offer_blocks(blocks, quantize_in_place(blocks.hf_model))
    with monkeypatch.context() as patch:
        patch.setattr(MatmulPlan, "measure", no_measuring)
        patch.setattr(matmul_module, "measure_direct_rows", no_measuring)
        blocks.weights.plan_matmuls(6, PlanCache(tmp_path / "blocks"))
    assert not (tmp_path / "blocks").exists() or not list((tmp_path / "blocks").glob("*.json"))
    assert all(held(blocks)) and all(weight.rows_alike for weight in blocks.weights.prepared.values())


def test_a_plan_timed_while_other_processes_have_the_cores_is_not_stored(tmp_path, caplog):
    """Beside one process per core and one more, all computing, the timing thread runs well under
    UNDISTURBED_SHARE of the time (0.3-0.6 measured): the plan runs but is not stored, and the start
    says so; timed on the idle host it is stored with its share. A plan stored without a share
    (before shares were recorded) is measured again."""
    from engine.cpu.plan_cache import PlanCache

    def weights() -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(3)
        return [torch.randn(out, 256, generator=generator) for out in (256, 256, 768, 768, 4096)]

    cache = PlanCache(tmp_path)
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(len(os.sched_getaffinity(0)) + 1)
    ]
    try:
        time.sleep(0.5)  # the burners are running, not starting
        busy = MatmulPlan.measure(weights(), 6)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    print(f"timing thread's share beside {len(burners)} busy processes: {busy.cpu_share:.2f}")
    assert busy.disturbed and busy.choices
    assert "busy host" in busy.describe()
    with caplog.at_level(logging.WARNING, logger="engine.cpu.plan_cache"):
        cache.save("k", busy)
    assert not list(tmp_path.glob("*.json"))
    assert "not stored" in caplog.text

    idle = MatmulPlan.measure(weights(), 6)
    print(f"timing thread's share on the idle host: {idle.cpu_share:.2f}")
    if idle.disturbed:
        pytest.skip(f"the host is busy (the timing thread ran {idle.cpu_share:.0%} of the time)")
    cache.save("k", idle)
    assert cache.load("k").choices == idle.choices
    stored = json.loads((tmp_path / "k.json").read_text())
    assert stored["cpu_share"] == round(idle.cpu_share, 3)
    del stored["cpu_share"]  # as plans were stored before
    (tmp_path / "k.json").write_text(json.dumps(stored))
    assert cache.load("k") is None  # measured again
    # --matmul-plan measure on a busy host: the plan stored before is dropped, not kept as if new
    PlanCache(tmp_path, remeasure=True).save("k", busy)
    assert not (tmp_path / "k.json").exists()


def test_int8_activations_are_refused_where_they_cannot_apply():
    from engine.config import EngineConfig
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="activations must be one of auto, float32, int8"):
        EngineConfig(activations="int4")
    with pytest.raises(ConfigError, match="needs gguf_blocks"):
        EngineConfig(activations="int8", gguf_blocks=False)
    with pytest.raises(ConfigError, match="GGUF target.s own quantized blocks"):
        tiny_engine(tiny_llama(seed=1, vocab_size=64), None, activations="int8")  # not read from a GGUF file
    assert tiny_engine(tiny_llama(seed=1, vocab_size=64), None).config.activations == "float32"  # auto: no blocks


def test_auto_activations_time_both_forms_on_one_thread(monkeypatch):
    """A host whose cores another process keeps busy: timed on all of them, each form's product waited
    on its thread team, and int8 measured at 0.98-1.33x float32's where idle it is 0.52x (two servers
    starting together took float32, three times in three); on one thread, 0.49-0.55x. The thread
    count is given back."""
    import engine.cpu.int8_blocks as int8_blocks

    seen = []

    class Clock:  # the timing's clock, read at each product's start and end
        @staticmethod
        def perf_counter():
            seen.append(torch.get_num_threads())
            return time.perf_counter()

    monkeypatch.setattr(int8_blocks, "time", Clock)
    model = tiny_engine(tiny_llama(seed=1, vocab_size=64, hidden=64), None).target
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        chosen = []
        offer_blocks(
            model,
            quantize_in_place(model.hf_model, ("Q4_0", "Q8_0")),
            lambda found: (found, chosen.append(int8_blocks.faster_activations(found)[0]) or ""),
        )
        assert chosen and seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_auto_activations_take_int8_only_where_start_up_measures_it_faster(monkeypatch, caplog):
    """The decision is the measurement's: forced either way by the threshold, the model holds int8
    or float32 blocks accordingly, and the blocks line says what was measured."""
    import engine.cpu.int8_blocks as int8_blocks
    from engine.cpu.blocks import INT8_FORMATS
    from engine.cpu.int8_blocks import auto_activations, held_activations

    for threshold, expected in ((100.0, "int8"), (0.0, "float32")):
        monkeypatch.setattr(int8_blocks, "FASTER", threshold)
        model = tiny_engine(tiny_llama(seed=1, vocab_size=64, hidden=64), None).target
        caplog.clear()
        with caplog.at_level("INFO", logger="engine.cpu.blocks"):
            offer_blocks(model, quantize_in_place(model.hf_model, ("Q4_0", "Q8_0")), auto_activations)
        assert held_activations(model) == expected
        assert f"activations auto: {expected} (int8 products measured at" in caplog.text
        formats = {part.format for weight in model.weights.blocks.values() for part in weight.parts}
        assert bool(formats & set(INT8_FORMATS)) == (expected == "int8"), formats
