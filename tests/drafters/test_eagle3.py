"""The eagle3 drafter: heads in the EAGLE/SpecForge and speculators layouts, over tiny Llama and
Qwen2 targets. Exactness at temperature 0 here; the chi-square suite (test_lossless.py) runs it too."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from engine.config import ConfigError
from engine.drafters.eagle3_head import load_head
from engine.model.model import CausalLM
from engine.request import Request
from engine.sampling import RequestSampler, SamplingParams
from tests.conftest import REPO
from tests.test_lossless import greedy_reference
from tests.tiny import random_eagle3_head, tiny_engine, tiny_llama, tiny_of_family


def eagle_engine(target, head, num_draft_tokens: int = 4, **options):
    return tiny_engine(
        target, None, num_draft_tokens=num_draft_tokens, drafter="eagle3", draft_head=str(head), **options
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("num_draft_tokens", [1, 2, 4])
def test_greedy_output_is_the_targets_with_either_layout(family, num_draft_tokens):
    target = tiny_llama(seed=3, vocab_size=96, layers=4, init=0.2) if family == "llama" else tiny_of_family("qwen2", 96)
    layers = (0, 1, 3) if family == "llama" else (0, 1)
    stats = []
    for layout in ("eagle", "speculators"):
        engine = eagle_engine(target, random_eagle3_head(target, layers, layout, seed=1, scale=2.0), num_draft_tokens)
        for prompt in ([5, 6, 7, 8], [9, 10, 9, 10, 9]):
            outputs = list(engine.generate(Request("g", prompt, SamplingParams(max_tokens=16, temperature=0.0))))
            assert [t for o in outputs for t in o.token_ids] == greedy_reference(target, prompt, 16)
            stats.append(outputs[-1].stats.drafted_tokens)
    assert stats[:2] == stats[2:] and sum(stats) > 0  # the same weights propose the same in both layouts


def test_q_is_zero_outside_the_draft_vocabulary():
    target_hf = tiny_llama(seed=3, vocab_size=96, layers=4, init=0.2)
    engine = eagle_engine(target_hf, random_eagle3_head(target_hf, (0, 1, 3), draft_vocab=40))
    drafter = engine.drafter("eagle3")
    drafter.begin([1, 2, 3, 4])
    sampler = RequestSampler(SamplingParams(max_tokens=8, temperature=1.0), 96, torch.device("cpu"), [1, 2, 3, 4], 0)
    proposal = drafter.propose([1, 2, 3, 4], 4, sampler)
    outside = torch.ones(96, dtype=torch.bool)
    outside[drafter.head.draft_to_target] = False
    assert proposal.probs.shape == (4, 96) and torch.all(proposal.probs[:, outside] == 0)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(4))
    assert all(int(t) in set(drafter.head.draft_to_target.tolist()) for t in proposal.token_ids)


def test_the_heads_start_up_price_is_a_proposal_of_one_draft(monkeypatch):
    """``auto`` prices the head's step from start-up until its first live step: the head's layer alone
    read 0.69 ms where a proposal of one draft, q drawn over the target's vocabulary, took 1.1-1.3 on
    a Zen 4 host. The price times the draw too: here a draw made 20 ms dearer."""
    target_hf = tiny_llama(seed=3, vocab_size=96, layers=4, init=0.2)
    drafter = eagle_engine(target_hf, random_eagle3_head(target_hf, (0, 1, 3))).drafter("eagle3")
    probs = RequestSampler.probs

    def slow(self, *args, **kwargs):
        time.sleep(0.02)
        return probs(self, *args, **kwargs)

    monkeypatch.setattr(RequestSampler, "probs", slow)
    calls = []  # live, the head runs right after a target step, which leaves it cold: so it is timed

    def recorded(name, method):
        def call(*args, **kwargs):
            calls.append(name)
            return method(*args, **kwargs)

        return call

    monkeypatch.setattr(drafter.target, "extend", recorded("extend", drafter.target.extend))
    monkeypatch.setattr(drafter.head, "step", recorded("step", drafter.head.step))
    drafter.target.extend([5, 6, 7])
    costs = drafter.own_costs()
    assert costs.step_seconds >= 0.02 and costs.seconds_per_token < 0.02 / 64  # a prompt's read draws nothing
    assert drafter.head.cache.length == 0 and drafter.target.cache.length == 3  # scratch entries, undone
    timed = [i for i, call in enumerate(calls) if call == "step" and calls[i - 1] != "step"]  # each timing's first
    assert len(timed) == 6 and all(calls[i - 1] == "extend" for i in timed)


def test_the_heads_cache_after_many_steps_is_the_one_computed_at_once():
    """Catching up, drafting and rolling back leave for each committed position exactly the keys and
    values a fresh head computes over the whole sequence from the target's features."""
    target_hf = tiny_llama(seed=3, vocab_size=96, layers=4, init=0.2)
    folder = random_eagle3_head(target_hf, (0, 1, 3), seed=2, scale=2.0)
    engine = eagle_engine(target_hf, folder)
    prompt = [5, 6, 7, 8, 5, 6]
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3)
    sequence = prompt + [t for o in engine.generate(Request("s", prompt, params)) for t in o.token_ids]
    head = engine.drafter("eagle3").head
    kept = head.cache.length
    assert kept > len(prompt)
    fresh_target = CausalLM(target_hf, 256)
    fresh_target.keep_features(head.aux_layers)
    fresh_target.extend(sequence[:kept], num_logits=0)
    fresh = load_head(str(folder), fresh_target)
    fresh.step(sequence[1 : kept + 1], fresh.fuse(fresh_target.feature_rows(0, kept)))
    keys, values = head.cache.keys[..., :kept, :], head.cache.values[..., :kept, :]
    assert torch.allclose(keys, fresh.cache.keys[..., :kept, :], atol=1e-5)
    assert torch.allclose(values, fresh.cache.values[..., :kept, :], atol=1e-5)


def test_a_head_that_does_not_fit_the_target_is_refused():
    target = CausalLM(tiny_llama(seed=3, vocab_size=96, layers=4), 64)
    other_size = tiny_llama(seed=3, vocab_size=96, layers=4, hidden=64)
    with pytest.raises(ConfigError, match="hidden size 64 differs from the target's 32"):
        load_head(str(random_eagle3_head(other_size, (0, 1, 3))), target)
    with pytest.raises(ConfigError, match="vocabulary of 80 tokens"):
        load_head(str(random_eagle3_head(tiny_llama(seed=3, vocab_size=80, layers=4), (0, 1, 3))), target)
    with pytest.raises(ConfigError, match=r"aux layers \[0, 1, 7\] must be distinct layers of the target's 0..3"):
        load_head(str(random_eagle3_head(tiny_llama(seed=3, vocab_size=96, layers=8), (0, 1, 7))), target)
    folder = random_eagle3_head(tiny_llama(seed=3, vocab_size=96, layers=4), (0, 1, 3))  # its checkpoint assigned:
    config = json.loads((folder / "config.json").read_text())  # a tensor of another shape is refused in one line
    (folder / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 40}))
    with pytest.raises(ConfigError, match=r"draft_head: d2t is \[48\]; the config makes it \[40\]"):
        load_head(str(folder), target)


def test_a_misfit_head_stops_start_up_in_one_line(tiny_model_dirs, tmp_path):
    import subprocess

    target, _ = tiny_model_dirs
    head = random_eagle3_head(tiny_llama(seed=3, vocab_size=258, layers=2, hidden=32), (0, 1))  # target: 64
    command = [sys.executable, "-m", "server.cli", "serve", "--target", str(target), "--draft", "none"]
    command += ["--drafter", "eagle3", "--draft-head", str(head), "--device", "cpu", "--port", "0"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert lines[-1].startswith("specserve: ") and "hidden size 32 differs from the target's 64" in lines[-1]


def test_compiled_forwards_keep_the_features_and_the_targets_output():
    """The static/compiled forward writes the head's features too: greedy output is the target's,
    and the features it kept are those an eager forward computes over the whole sequence."""
    target = tiny_llama(seed=3, vocab_size=96, layers=4, init=0.2)
    head = random_eagle3_head(target, (0, 1, 3), seed=1, scale=2.0)
    engine = eagle_engine(target, head, forward="compile", compile_backend="aot_eager")
    assert engine.target.runner is not None
    prompt = [5, 6, 7, 8, 5, 6]
    outputs = list(engine.generate(Request("c", prompt, SamplingParams(max_tokens=20, temperature=0.0))))
    sequence = prompt + [t for o in outputs for t in o.token_ids]
    assert sequence[len(prompt) :] == greedy_reference(target, prompt, 20)
    assert outputs[-1].stats.drafted_tokens > 0 and engine.target.runner.num_variants > 0
    committed = engine.target.cache.length
    kept = engine.target.feature_rows(0, committed).clone()
    eager = CausalLM(target, 256)
    eager.keep_features((0, 1, 3))
    eager.extend(sequence[:committed], num_logits=0)
    assert torch.allclose(kept, eager.feature_rows(0, committed), atol=1e-5)


def test_a_served_head_is_named_at_start_up_in_models_usage_and_metrics(tiny_model_dirs, tmp_path):
    import httpx
    from transformers import AutoModelForCausalLM

    from tests.conftest import start_server, stop_server

    target, _ = tiny_model_dirs
    head = random_eagle3_head(AutoModelForCausalLM.from_pretrained(target), (0, 1), seed=1, scale=2.0)
    log = tmp_path / "server.log"
    args = ["--target", str(target), "--draft", "none", "--drafter", "auto", "--draft-head", str(head)]
    server = start_server([*args, "--device", "cpu"], log)
    try:
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        assert "eagle3" in card["drafters"] and card["drafter_models"]["eagle3"].startswith("EAGLE-3 head ")
        body = {
            "model": card["id"],
            "prompt": "hello",
            "max_tokens": 24,
            "temperature": 0,
            "speculative": {"drafter": "eagle3"},
        }
        usage = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"]
        assert usage["speculative"]["drafter"] == "eagle3" and usage["speculative"]["drafted_tokens"] > 0
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'drafter="eagle3"' in metrics
    finally:
        stop_server(server)
    startup = next(line for line in log.read_text().splitlines() if "ready: serving" in line)
    assert "eagle3: EAGLE-3 head" in startup and "params, draft vocabulary" in startup


def test_beside_a_cpu_float32_target_the_head_multiplies_q8_0_blocks():
    """Its products are Q8_0 blocks of its weights (a quarter of the bytes a step reads): its logits
    stay within Q8_0's rounding of the float32 head's, and the greedy output is still the target's."""
    target_hf = tiny_llama(seed=3, vocab_size=96, layers=4, init=0.2)
    folder = random_eagle3_head(target_hf, (0, 1, 3), seed=1, scale=2.0)
    engine = eagle_engine(target_hf, folder)
    head = engine.drafter("eagle3").head
    assert set(head.blocks) == {"fc", "qkv", "o", "gate_up", "down", "lm_head"}
    assert "Q8_0 products" in head.describe()
    assert all(module.weight.is_meta for modules in head.stacked.values() for module in modules)  # let go
    features = torch.randn(5, head.fc.in_features)
    quantized, _ = head.step([1, 2, 3, 4, 5], head.fuse(features))  # [1, V]
    head.cache.rollback(0)
    float_head = load_head(str(folder), engine.target, blocks=False)
    assert not float_head.blocks
    exact, _ = float_head.step([1, 2, 3, 4, 5], float_head.fuse(features))
    inside = torch.isfinite(exact)
    assert torch.equal(inside, torch.isfinite(quantized)) and not torch.equal(quantized, exact)
    assert torch.allclose(quantized[inside], exact[inside], rtol=0.05, atol=0.05 * float(exact[inside].abs().max()))
    prompt = [5, 6, 7, 8]
    outputs = list(engine.generate(Request("g", prompt, SamplingParams(max_tokens=16, temperature=0.0))))
    assert [t for o in outputs for t in o.token_ids] == greedy_reference(target_hf, prompt, 16)


def test_auto_leaves_out_a_head_whose_start_up_price_cannot_pay(monkeypatch):
    """On a CPU host the shipped head's step (1.0-1.7 ms) beside a verify of one draft (5-6 ms) makes at
    most 1.02x plain decoding's tokens a second at its recorded acceptance: ``auto`` leaves it out at
    start-up and says so (its pricing cost every step, and its live steps cost more than that price); a
    request may still name it. One whose step is cheap enough stays a candidate."""
    from engine import measure
    from engine.drafters.base import OwnCosts
    from engine.drafters.eagle3 import Eagle3Drafter
    from engine.factory import warm_up

    target_hf = tiny_llama(seed=3, vocab_size=96, layers=4, init=0.2)
    head = random_eagle3_head(target_hf, (0, 1, 3), seed=1, scale=2.0)
    prices = {0: 5.0e-3, 1: 5.5e-3, 2: 6.0e-3, 3: 6.5e-3, 4: 7.0e-3}  # a plain step, a verify of k drafts
    monkeypatch.setattr(measure, "verify_prices", lambda timed: dict(prices))
    for step, kept in ((1.3e-3, False), (0.1e-3, True)):  # 0.98x and 1.19x plain decoding at acceptance 0.33
        monkeypatch.setattr(Eagle3Drafter, "own_costs", lambda self, step=step: OwnCosts(step, 1e-5, 0.33))
        engine = tiny_engine(target_hf, None, drafter="auto", draft_head=str(head))
        report = warm_up(engine).describe()
        auto = engine.drafter("auto")
        assert ("eagle3" in auto.candidates) is kept and ("eagle3" in auto.draft_costs) is kept
        assert ("auto leaves out eagle3 (1.30 ms a draft at acceptance 0.33: 0.98x)" in report) is not kept
        prompt = [5, 6, 7, 8, 5, 6]
        for drafter in ("auto", "eagle3"):  # named, it still runs; either way the output is the target's
            request = Request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0), drafter=drafter)
            outputs = list(engine.generate(request))
            assert [t for o in outputs for t in o.token_ids] == greedy_reference(target_hf, prompt, 12)
            stats = outputs[-1].stats
            assert stats.drafted_tokens > 0 if drafter == "eagle3" else kept or "eagle3" not in stats.steps_by_drafter
