"""The lean forward, static KV rollback and prefix reuse, checked against Hugging Face's forward."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.cpu.matmul import FORMULATIONS, LONG, PACKED, MatmulPlan, PackedWeight, can_pack
from engine.factory import warm_up
from engine.model.model import CausalLM
from engine.request import Request
from engine.sampling import SamplingParams
from tests.tiny import perturbed_copy, tiny_engine, tiny_llama, tiny_of_family


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]  # [T, V]


def test_forward_in_chunks_matches_hugging_face():
    model = tiny_llama(seed=0, vocab_size=50)
    ids = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    lm = CausalLM(model, max_len=64)
    ours = torch.cat([lm.extend(ids[:7], 7), lm.extend(ids[7:8], 1), lm.extend(ids[8:], 22)])
    assert torch.allclose(ours, reference_logits(model, ids), atol=1e-5)


@pytest.mark.parametrize("held", ["dense", "packed"])
def test_qwen2_biases_are_used(held):
    model = tiny_of_family("qwen2", vocab_size=40)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.bias.normal_()
    ids = list(range(12))
    reference = reference_logits(model, ids)
    lm = CausalLM(model, 32)
    if held == "packed":  # the bias goes into the packed product
        lm.weights.use_plan(MatmulPlan.uniform(PACKED, 4, lm.weights.linear_weights()))
    assert torch.allclose(lm.extend(ids[:3], 3), reference[:3], atol=1e-5)  # small-row slots
    assert torch.allclose(lm.extend(ids[3:], 9), reference[3:], atol=1e-5)  # the LONG slot


def test_rollback_discards_rejected_positions():
    model = tiny_llama(seed=1, vocab_size=50)
    lm = CausalLM(model, max_len=64)
    lm.extend([1, 2, 3, 4, 5, 6], 1)
    lm.cache.rollback(3)  # as if tokens 4, 5, 6 were rejected drafts
    assert lm.cache.token_ids == [1, 2, 3]
    logits = lm.extend([9, 8], 2)
    assert torch.allclose(logits, reference_logits(model, [1, 2, 3, 9, 8])[-2:], atol=1e-5)


def test_cache_storage_is_allocated_once():
    engine = tiny_engine(tiny_llama(seed=2, vocab_size=50), perturbed_copy(tiny_llama(seed=2, vocab_size=50), 0.05, 0))
    pointers = (engine.target.cache.keys.data_ptr(), engine.draft.cache.values.data_ptr())
    for i in range(3):
        list(engine.generate(Request(str(i), [i + 1, 2, 3], SamplingParams(max_tokens=10))))
    assert (engine.target.cache.keys.data_ptr(), engine.draft.cache.values.data_ptr()) == pointers


def test_prefix_reuse_skips_shared_prompt_and_keeps_output_exact():
    target = tiny_llama(seed=3, vocab_size=60, init=0.2)
    draft = perturbed_copy(target, 0.05, 1)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    warm = tiny_engine(target, draft)
    first = list(warm.generate(Request("1", [5, 6, 7, 8, 9], greedy)))
    turn = [5, 6, 7, 8, 9] + [t for o in first for t in o.token_ids] + [11, 12]
    second = list(warm.generate(Request("2", turn, greedy)))
    assert second[-1].cached_tokens >= 5 + len(first) and second[-1].cached_tokens < len(turn)
    cold = list(tiny_engine(target, draft).generate(Request("2", turn, greedy)))
    assert cold[-1].cached_tokens == 0
    assert [t for o in second for t in o.token_ids] == [t for o in cold for t in o.token_ids]


def test_unrelated_prompt_reuses_nothing():
    engine = tiny_engine(tiny_llama(seed=4, vocab_size=60), None)
    list(engine.generate(Request("1", [1, 2, 3], SamplingParams(max_tokens=4))))
    outputs = list(engine.generate(Request("2", [9, 2, 3], SamplingParams(max_tokens=4))))
    assert outputs[-1].cached_tokens == 0


def onednn_multiplies(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies ``dtype`` on this CPU, as the plan asks before it times a
    packed product (an AVX2-only CPU has no bfloat16 one: the plan then times the others)."""
    try:
        PackedWeight.pack(torch.zeros(8, 16, dtype=dtype)).linear(torch.zeros(2, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("formulation", sorted((*FORMULATIONS, PACKED)))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_matmul_formulation_matches_hugging_face(formulation, dtype):
    """Chunks of 1, 3 and 4 rows take the plan's small-row slots, 22 rows its LONG slot."""
    if formulation == PACKED and not onednn_multiplies(getattr(torch, dtype)):
        pytest.skip(f"oneDNN has no {dtype} product on this CPU (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    model = tiny_llama(seed=0, vocab_size=50).to(getattr(torch, dtype))
    ids = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = reference_logits(model, ids).float()  # before packing frees the model's own weights
    lm = CausalLM(model, max_len=64)
    lm.weights.use_plan(MatmulPlan.uniform(formulation, 4, lm.weights.linear_weights()))
    assert bool(lm.weights.prepared) == (formulation == PACKED)
    chunks = [ids[:1], ids[1:4], ids[4:8], ids[8:]]
    ours = torch.cat([lm.extend(chunk, len(chunk)) for chunk in chunks]).float()
    assert torch.allclose(ours, reference, atol=1e-5 if dtype == "float32" else 0.05)


def test_packed_weights_replace_the_dense_ones_and_come_back_exactly():
    model = tiny_llama(seed=0, vocab_size=50)
    lm = CausalLM(model, max_len=64)
    dense = {(id(module), name): getattr(module, name).clone() for module, name in lm.weights.products}
    before, tied = lm.weight_bytes, lm.lm_head.weight.data_ptr() == lm.embed.weight.data_ptr()
    lm.weights.use_plan(MatmulPlan.uniform(PACKED, 4, lm.weights.linear_weights()))
    assert len(lm.weights.prepared) == len(dense) and lm.weights.linear_weights() == []
    # the dense copies are freed (an embedding table the LM head shares stays), so memory holds one copy
    assert all(module.q_proj.weight.numel() == 0 for module in (layer.self_attn for layer in lm.layers))
    assert lm.weight_bytes == before + tied * lm.weights.prepared[id(lm.lm_head), "weight"].nbytes
    assert torch.equal(lm.weights.dense(lm.lm_head, "weight"), dense[id(lm.lm_head), "weight"])
    lm.weights.use_plan(MatmulPlan())
    assert not lm.weights.prepared and lm.weight_bytes == before
    for module, name in lm.weights.products:
        assert torch.equal(getattr(module, name), dense[id(module), name])
    attn = lm.layers[0].self_attn  # the layers' weights are views of the fused one again
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert torch.equal(
        attn.k_proj.weight, dense[id(attn), "qkv_weight"][attn.q_proj.weight.shape[0] :][: attn.k_proj.weight.shape[0]]
    )


def test_the_measured_plan_covers_every_weight_shape_and_row_count():
    model = tiny_llama(seed=0, vocab_size=50)
    lm = CausalLM(model, max_len=64)
    plan = lm.weights.plan_matmuls(3)
    shapes = {(w.shape[0], w.shape[1], w.dtype) for w in lm.weights.linear_weights()}
    assert set(plan.choices) == {(shape, slot) for shape in shapes for slot in (1, 2, 3, LONG)}
    packed = [PACKED] if can_pack(torch.float32, lm.device) else []
    assert all(set(plan.timings_us[shape, 1]) == {"linear", "weight_first", "padded", *packed} for shape in shapes)
    assert all(set(plan.timings_us[shape, 2]) == {"linear", "weight_first", *packed} for shape in shapes)
    for shape in shapes:  # packed at every row count, or at none; float32's LONG slot: F.linear or packed
        assert len({plan.choices[shape, slot] == PACKED for slot in (1, 2, 3, LONG)}) == 1
        assert plan.choices[shape, LONG] in ("linear", PACKED)
        timings = [plan.timings_us[shape, slot] for slot in (1, 2, 3, LONG)] if packed else []
        ratios = [t[PACKED] / min(us for name, us in t.items() if name != PACKED) for t in timings]
        assert not packed or (plan.choices[shape, 1] == PACKED) == (torch.tensor(ratios).log().mean() < 0)
    # e.g. "onednn 8/16, weight_first 8/16 (measured)"
    won = [part.split() for part in plan.describe().split(" (")[0].split(", ")]
    assert sum(int(count.split("/")[0]) for _, count in won) == len(plan.choices) and lm.weights.plan is plan
    with pytest.raises(ValueError, match="unknown formulation"):
        MatmulPlan.uniform("mystery", 2, lm.weights.linear_weights())


def test_a_cpu_without_a_onednn_kernel_for_the_dtype_keeps_the_blas_formulations(monkeypatch):
    """oneDNN refuses some dtypes on CPUs without the instructions (float16 without avx512_fp16): the
    plan then times and chooses among the others, and the model keeps its dense weights."""

    def refuse(self, x):
        raise RuntimeError("mkldnn_linear_pointwise: this path needs cpu support this one lacks")

    monkeypatch.setattr(PackedWeight, "linear", refuse)
    lm = CausalLM(tiny_llama(seed=0, vocab_size=50), max_len=64)
    plan = lm.weights.plan_matmuls(2)
    assert PACKED not in plan.choices.values() and not any(PACKED in t for t in plan.timings_us.values())
    assert not lm.weights.prepared and len(lm.weights.linear_weights()) == len(lm.weights.products)


def test_warm_up_measures_the_plan_and_greedy_output_stays_the_targets():
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    draft = perturbed_copy(target, noise=0.05, seed=1)
    engine = tiny_engine(copy.deepcopy(target), draft, num_draft_tokens=4, drafter="model")  # packing frees its weights
    assert "matmuls: target" in warm_up(engine).describe()
    assert set(engine.target.weights.plan.choices) and set(engine.draft.weights.plan.choices)
    for formulation in ("weight_first", "padded", "linear", PACKED):  # whichever the host measured, each path is exact
        for model in engine.models:
            model.weights.use_plan(MatmulPlan())  # every weight dense again, so that the plan below sees them all
            model.weights.use_plan(MatmulPlan.uniform(formulation, 6, model.weights.linear_weights()))
        prompt = [5, 9, 11, 5, 9]
        greedy = SamplingParams(max_tokens=20, temperature=0.0)
        outputs = [t for o in engine.generate(Request("g", prompt, greedy)) for t in o.token_ids]
        with torch.inference_mode():
            tokens = list(prompt)
            for _ in range(20):
                tokens.append(int(target(torch.tensor([tokens])).logits[0, -1].argmax()))
        assert outputs == tokens[len(prompt) :]


def test_copy_from_takes_another_caches_positions_in_its_own_dtype():
    model = tiny_llama(seed=0, vocab_size=50)
    target = CausalLM(model, max_len=32)
    draft = CausalLM(perturbed_copy(model, 0.05, seed=1).to(torch.bfloat16), max_len=32)
    target.extend([1, 2, 3, 4, 5, 6])
    draft.extend([1, 2])  # the draft read the first two itself
    draft.cache.copy_from(target.cache, 5, [1, 2, 3, 4, 5, 6, 7])
    assert draft.cache.token_ids == [1, 2, 3, 4, 5]
    assert draft.cache.keys.dtype == torch.bfloat16
    assert torch.equal(draft.cache.keys[:, :, :, 2:5], target.cache.keys[:, :, :, 2:5].to(torch.bfloat16))
    assert not torch.equal(draft.cache.values[:, :, :, :2], target.cache.values[:, :, :, :2].to(torch.bfloat16))
    draft.cache.copy_from(target.cache, 3, [1, 2, 3])  # nothing past its own length: unchanged
    assert draft.cache.length == 5
