"""Copies of the target as drafts: int8 rows (``copy:int8``) and the measured choice (``copy:auto``)."""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable

import pytest
import torch

import engine.measure as measure_module
from engine.config import ConfigError, EngineConfig
from engine.cpu.blocks import native_ops_available
from engine.cpu.gguf_file import GGUFFile
from engine.factory import build_engine, warm_up
from engine.measure import KEEP_MARGIN, choose_copy, could_pay
from engine.model.from_gguf import read_gguf_target
from engine.model.loader import CopySource, converted_copy, copy_of_first_layers, load_draft
from engine.model.model import CausalLM
from engine.model.weights import Int8Weight
from engine.request import Request
from engine.sampling import SamplingParams
from tests.conftest import copies_read_while_timing
from tests.model.test_from_gguf import write_model
from tests.tiny import tiny_llama


def test_int8_rows_hold_each_weight_within_half_a_step_of_its_row_scale():
    weight = torch.randn(300, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # [O, I]
    weight[7] = 0  # an all-zero row must not divide by zero
    quantized = Int8Weight.quantize(weight, block_rows=128)  # three blocks, the last one short
    as_float = weight.float()  # [O, I]
    Int8Weight.quantize(as_float, block_rows=128)
    assert torch.equal(as_float, weight.float())  # rounded in place, but in a copy of the rows
    assert quantized.values.dtype == torch.int8 and quantized.scales.shape == (300,)
    scales = quantized.scales.float()[:, None]  # [O, 1]
    restored = quantized.values.float() * scales  # [O, I]
    assert (restored - weight.float()).abs().le(scales * 0.5).all()
    largest = quantized.values.abs().amax(dim=1)[weight.float().abs().amax(dim=1) > 0]
    assert largest.ge(126).all()  # the range is used (the scale is rounded up to the weight's dtype)
    x = torch.randn(3, 64).to(torch.bfloat16)  # [N, I]
    reference = x.float() @ restored.T  # [N, O]
    assert torch.allclose(quantized.linear(x).float(), reference, rtol=0.02, atol=0.05)


def test_a_converted_copy_equals_the_whole_model_converted_and_keeps_tied_weights_tied():
    model = tiny_llama(seed=2, vocab_size=64)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the embedded model's are
    converted = converted_copy(model, torch.bfloat16)
    reference = copy.deepcopy(model).to(torch.bfloat16)
    assert converted.lm_head.weight is converted.model.embed_tokens.weight
    assert all(param.dtype == torch.float32 for param in model.parameters())  # the original is untouched
    ours, theirs = converted.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]) for name in ours)
    ids = torch.tensor([[1, 5, 9]])
    assert torch.equal(converted(ids).logits, reference(ids).logits)


def test_an_int8_model_frees_its_float_weights_and_stays_close_to_bfloat16():
    model = tiny_llama(seed=4, vocab_size=64, init=0.2).to(torch.bfloat16)
    bfloat16 = CausalLM(copy.deepcopy(model), max_len=64)
    int8 = CausalLM(model, max_len=64)
    int8.weights.quantize_int8()
    assert int8.weights.linear_weights() == [] and int8.weights.describe() == "int8 rows"
    assert int8.weight_bytes < 0.7 * bfloat16.weight_bytes  # int8 rows, not a second copy beside the bfloat16 one
    assert int8.embed.weight.numel() > 0  # the table the tied LM head shares stays for lookups
    prompt = [3, 9, 27, 17, 51, 25]
    ours, theirs = int8.extend(prompt, len(prompt)).float(), bfloat16.extend(prompt, len(prompt)).float()  # [T, V]
    assert not torch.equal(ours, theirs)  # really a different product
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.8
    with pytest.raises(ConfigError, match="bfloat16 model on CPU"):
        CausalLM(tiny_llama(seed=4, vocab_size=64), max_len=64).weights.quantize_int8()  # float32


def test_a_copy_names_one_of_the_forms():
    with pytest.raises(ConfigError, match="copy:bfloat16, copy:float16, copy:float32|copy:int8, copy:auto"):
        EngineConfig(draft="copy:int4")
    assert (
        EngineConfig(draft="copy:int8").draft_copy == "int8" and EngineConfig(draft="copy:int8").draft_reads_target_kv
    )
    assert EngineConfig(draft="some/model").draft_copy is None


def test_copy_auto_reads_no_copy_under_a_start_up_drafter_that_never_drafts_with_one(tmp_path, caplog):
    """A target-only server (--drafter none), or one drafting by text or heads, reads no copy and
    times none: the start-up memory is the target's alone, and a request naming "model" is refused."""
    path = tmp_path / "tiny.gguf"
    write_model(path, "llama", 64, 4, 2, tied=True)
    file = GGUFFile(path)
    target, blocks = read_gguf_target(file)
    for drafter, drafts in (("none", "never"), ("suffix", "never"), ("auto", "may"), ("model", "needs")):
        config = EngineConfig(draft="copy:auto", drafter=drafter, device="cpu", max_model_len=128)
        assert config.drafts_with_model == drafts
        assert isinstance(load_draft(config, target, file), CopySource) == (drafts != "never")
    assert EngineConfig(drafter="staged", stages=("ngram", "model")).drafts_with_model == "needs"
    assert EngineConfig(drafter="staged", stages=("ngram", "suffix")).drafts_with_model == "never"
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = build_engine(
            config_none := EngineConfig(draft="copy:auto", drafter="none", device="cpu", max_model_len=128),
            target,
            None,
            set(),
            None,
            path,
            blocks,
        )
    assert config_none.draft == "copy:auto" and engine.config.draft is None and engine.draft is None
    assert "timing a bfloat16" not in caplog.text
    with pytest.raises(ConfigError, match=r"needs a draft model .*start-up drafter \('none'\) never drafts with one"):
        engine.drafter("model")


def copies_of(hf_model: torch.nn.Module, reads: list | None = None, small: list | None = None) -> Callable:
    """copy:auto's ``read_copy`` over an in-process model: a fresh bfloat16 copy at each call,
    each whole one noted in ``reads``, the layer count of each of its first layers in ``small``."""

    def read(layers: int | None = None) -> CausalLM:
        model = CausalLM(copy_of_first_layers(hf_model, layers).to(torch.bfloat16), max_len=64)
        noted, what = (reads, model) if layers is None else (small, len(model.layers))
        if noted is not None:
            noted.append(what)
        return model

    return read


def _chosen_copy(caplog, may_keep_none: bool) -> tuple[CausalLM | None, str, float | None, str, dict]:
    """copy:auto over a tiny target: what it returns, its log line, and the rates the line names.
    It reads one copy to time, as bfloat16 and then as int8 rows, and again only where bfloat16 is kept."""
    target, reads = CausalLM(tiny_llama(seed=5, vocab_size=64, init=0.2), max_len=64), []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.measure"):
        chosen, form, agreed = choose_copy(
            target, copies_of(target.hf_model, reads), num_draft_tokens=3, may_keep_none=may_keep_none
        )
    assert len(reads) == (2 if form == "bfloat16" else 1) and (chosen is None or chosen is reads[-1])
    line = next(r.getMessage() for r in caplog.records if "copy:auto chose" in r.getMessage())
    rates = {name: float(rate) for name, rate in re.findall(r"(int8|bfloat16|none) \(.*?, ([\d.]+) tok/s", line)}
    return chosen, form, agreed, line, rates


def test_copy_auto_times_both_copies_and_keeps_the_faster(caplog):
    """The choice is by measured tokens per second at its best k; the log names both, with what each measured."""
    chosen, form, agreed, line, rates = _chosen_copy(caplog, may_keep_none=False)
    assert set(rates) == {"int8", "bfloat16"} and form == max(rates, key=rates.__getitem__)
    assert line.startswith(f"draft copy:auto chose {form} ")
    assert chosen.weights.int8 == (form == "int8")
    assert f"{form} (step " in line and f"agreement {agreed:.3f}" in line.split(" over ")[0]
    assert re.search(r"tok/s at k = [123]\)", line)


def test_copy_auto_for_the_auto_drafter_keeps_no_copy_where_the_target_alone_is_faster(caplog, monkeypatch):
    """Beside the auto drafter the target alone is a third choice, priced from its own timed step; a
    copy is kept only where it promises KEEP_MARGIN more, and choosing none returns no model. (Every
    form is read whole and timed here: no estimate rules one out at EVEN_IF 0.)"""
    monkeypatch.setattr(measure_module, "EVEN_IF", 0.0)
    chosen, form, agreed, line, rates = _chosen_copy(caplog, may_keep_none=True)
    copies = {"int8", "bfloat16"}
    assert set(rates) == copies | {"none"}
    best = max(copies, key=rates.__getitem__)  # kept only where it promises clearly more than none
    assert form == (best if rates[best] > KEEP_MARGIN * rates["none"] else "none")
    assert re.search(r"none \(the target alone: step [\d.]+ ms, [\d.]+ tok/s\)", line)
    assert (chosen is None) == (form == "none") and (agreed is None) == (form == "none")


def test_copy_auto_reads_no_whole_copy_where_an_estimate_says_none_could_pay(caplog, monkeypatch):
    """Beside the auto drafter, each copy's step is first estimated from copies of its first four
    layers and its first (twice before a form is ruled out); a form that could not pay even if every draft passed is not read whole
    (nor timed, nor measured for agreement). Where neither could, none is read at all. (The bar is
    raised here so that no copy can pay, whatever this host's timings.)"""
    monkeypatch.setattr(measure_module, "KEEP_MARGIN", 1e6)
    target, reads, small = CausalLM(tiny_llama(seed=5, vocab_size=64, init=0.2), max_len=64), [], []
    with caplog.at_level(logging.INFO, logger="engine.measure"):
        chosen, form, agreed = choose_copy(target, copies_of(target.hf_model, reads, small), 3, may_keep_none=True)
    assert (chosen, form, agreed) == (None, "none", None) and reads == []
    layers = len(target.layers)
    # each form, twice (a second look before ruling it out): its first four layers (or all), then its first
    assert layers > 1 and small == [min(4, layers), 1] * 4
    line = next(r.getMessage() for r in caplog.records if "copy:auto chose" in r.getMessage())
    for name in ("bfloat16", "int8"):
        assert re.search(rf"{name} \(step estimated at [\d.]+ ms: no k pays even if every draft passed\)", line)


def test_a_copy_could_pay_only_where_its_step_leaves_room_at_full_acceptance():
    """(k + 1) tokens for k draft steps (taken at EVEN_IF of the estimate) and a verify of k rows,
    against KEEP_MARGIN times the target alone's rate: 20 ms a target step, 2 ms a row, k up to 4."""
    alone, row = 0.020, 0.002
    assert not could_pay(alone, alone, row, 4)  # a copy as slow as the target cannot pay
    assert not could_pay(0.025, alone, 0.0, 1)  # at one draft a step, free rows: 2 tokens in 40 ms, not 1.1 in 20
    assert could_pay(0.005, alone, row, 4) and not could_pay(0.005, alone, 0.030, 4)


def test_an_engine_drafting_with_copy_auto_says_which_copy_and_keeps_the_targets_greedy_output():
    target = tiny_llama(seed=6, vocab_size=96, init=0.2)
    config = EngineConfig(draft="copy:auto", drafter="model", device="cpu", dtype="float32", max_model_len=128)
    # the engine owns what it is given (packing may free it): the target-only engine gets its own
    engine = build_engine(config, copy.deepcopy(target), copy.deepcopy(target).to(torch.bfloat16), set())
    assert engine.config.draft in ("copy:bfloat16", "copy:int8")
    auto = engine.drafter("auto")
    measured = auto.draft_agreement  # by copy:auto's choice; warm-up keeps it rather than measuring again
    warm_up(engine)
    assert measured is not None and auto.draft_agreement == measured and auto.priors["model"] == measured
    alone = build_engine(
        EngineConfig(device="cpu", dtype="float32", max_model_len=128, draft=None, drafter="none"), target, None, set()
    )
    params = SamplingParams(max_tokens=20, temperature=0.0)
    prompt = [4, 8, 15, 16, 23, 42]
    drafted = [t for o in engine.generate(Request("a", prompt, params)) for t in o.token_ids]
    assert drafted == [t for o in alone.generate(Request("b", prompt, params)) for t in o.token_ids]


def test_copy_auto_stores_its_choice_beside_the_plan_and_the_next_start_times_nothing(tmp_path, caplog, monkeypatch):
    """A model loaded from somewhere (it has a name): the first start times the copies and stores
    what it chose; the next start of the same model on this host reads it back, timing nothing, and
    keeps the same copy with the same agreement; --matmul-plan measure times again. A model built
    in-process (no name) is timed at every start."""
    import engine.cpu.matmul as matmul_module
    import engine.measure as measure_module
    from engine.cpu.plan_cache import PlanCache

    monkeypatch.setattr(matmul_module, "UNDISTURBED_SHARE", 0.0)  # storing is tested here, whatever the host's load

    def models(name: str, reads: list | None = None) -> tuple[CausalLM, Callable[[], CausalLM]]:
        hf_model = tiny_llama(seed=5, vocab_size=64, init=0.2)
        hf_model.config._name_or_path = name
        return CausalLM(hf_model, max_len=64), copies_of(hf_model, reads)

    first = choose_copy(*models("tiny/copy-auto"), num_draft_tokens=3, cache=PlanCache(tmp_path), may_keep_none=True)
    assert len(list(tmp_path.glob("copy-auto-*.json"))) == 1

    def no_timing(*args, **kwargs):
        raise AssertionError("a stored choice matched: nothing to time")

    with monkeypatch.context() as patch, caplog.at_level(logging.INFO, logger="engine.measure"):
        patch.setattr(measure_module, "read_seconds", no_timing)
        reads = []  # only the copy it keeps
        again = choose_copy(
            *models("tiny/copy-auto", reads), num_draft_tokens=3, cache=PlanCache(tmp_path), may_keep_none=True
        )
        assert again[1:] == first[1:] and (again[0] is None) == (first[0] is None)
        assert len(reads) == (first[1] != "none") and (again[0] is None or again[0] is reads[0])
        assert again[0] is None or again[0].weights.int8 == (first[1] == "int8")
        assert "(stored, measured " in caplog.text
        with pytest.raises(AssertionError, match="nothing to time"):  # measuring asked for
            choose_copy(*models("tiny/copy-auto"), 3, PlanCache(tmp_path, remeasure=True), may_keep_none=True)
        with pytest.raises(AssertionError, match="nothing to time"):  # another k: another choice
            choose_copy(*models("tiny/copy-auto"), 2, PlanCache(tmp_path), may_keep_none=True)
        with pytest.raises(AssertionError, match="nothing to time"):  # no name: nothing stored for it
            choose_copy(*models(""), 3, PlanCache(tmp_path), may_keep_none=True)


@pytest.mark.skipif(not native_ops_available(), reason="engine/cpu/_blocks was not built")
def test_a_target_built_from_its_file_keeps_copy_auto_s_choice_and_the_next_start_reads_only_that_copy(
    tmp_path, caplog, monkeypatch
):
    """As the server starts the embedded model: the target built from its GGUF file (every product
    its blocks, no matmul plan to store), the draft a copy read from the file when copy:auto asks.
    The first start times a copy, as bfloat16 and as int8 rows, and stores its choice; the next reads it back, times nothing
    and reads only the copy it keeps (none: no copy at all, the memory a target-only server needs)."""
    import engine.cpu.matmul as matmul_module

    monkeypatch.setattr(matmul_module, "UNDISTURBED_SHARE", 0.0)  # storing is tested here, whatever the host's load
    path = tmp_path / "tiny.gguf"
    write_model(path, "llama", 64, 4, 2, tied=True)
    # activations pinned: on a model this small int8 and float32 products time within noise, and a start
    # that chose the other looks for another stored choice (the key names the target's activations)
    plans = str(tmp_path / "plans")
    config = EngineConfig(draft="copy:auto", device="cpu", max_model_len=128, plan_cache=plans, activations="float32")

    def start() -> tuple[str | None, int]:
        """What the engine says its draft is, and how many copies were read from the file."""
        file = GGUFFile(path)
        target, blocks = read_gguf_target(file)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine"):
            engine = build_engine(config, target, CopySource(path, config.draft), set(), None, path, blocks)
        return engine.config.draft, caplog.text.count("loaded draft copy:auto: ")

    kept, reads = start()
    assert "copy:auto: timing a bfloat16 and an int8 copy" in caplog.text
    assert reads == copies_read_while_timing(caplog.text, kept == "copy:bfloat16")
    assert len(list((tmp_path / "plans").glob("copy-auto-*.json"))) == 1
    again, reads = start()
    assert "(stored, measured " in caplog.text and "timing a bfloat16" not in caplog.text
    assert again == kept and reads == (kept is not None)
