"""specserve train-eagle3 on a tiny target: the recipe end to end (answers, features, vocabulary,
training), its output read back by the eagle3 drafter, resuming, seeding, and that training
teaches the head the target's next tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, replace

import pytest
import torch
from safetensors.torch import load_file

from engine.config import ConfigError, Eagle3Training, EngineConfig
from engine.drafters.eagle3_head import default_aux_layers
from engine.factory import load_engine
from engine.model.model import CausalLM
from engine.request import Request
from engine.sampling import SamplingParams
from engine.training.eagle3 import (
    _continues,
    head_config,
    held_out_prompts,
    int8_target,
    new_head,
    train_eagle3,
    unrolled_loss,
)
from engine.training.eagle3_data import (
    collect_features,
    draft_vocabulary,
    load_prompts,
    make_batch,
    own_prompts,
    regenerate,
    windows,
)
from tests.model.test_from_gguf import needs_kernels, write_model
from tests.test_lossless import greedy_reference
from tests.tiny import byte_tokenizer, save_tiny, tiny_engine, tiny_llama

SMALL = dict(limit=3, max_new_tokens=12, epochs=2.0, draft_vocab=64, generate_batch=2, batch_tokens=256, window=64)


def test_the_prompt_set_is_varied_and_disjoint_from_the_bench():
    from tests.conftest import REPO

    prompts = load_prompts()
    kinds = {p["type"] for p in prompts}
    assert {"chat", "code", "summarise", "edit", "json", "tools", "multi-turn"} <= kinds and len(prompts) >= 400
    bench = (REPO / "bench" / "prompts.yaml").read_text()
    for prompt in prompts:
        for turn in prompt["turns"]:
            assert turn.strip()[:60] not in bench


def test_train_writes_a_head_the_drafter_reads_back_and_resumes(tmp_path):
    model_dir = save_tiny(tmp_path / "target", seed=3, tokenizer=byte_tokenizer(), layers=6, init=0.2)
    out = tmp_path / "head"
    settings = Eagle3Training(**{**SMALL, "own_prompts": 2})  # three shipped prompts and two of its own
    report = train_eagle3(str(model_dir), out, settings)
    assert report["conversations"] == 5 and report["steps"] > 0 and report["answer_tokens"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(default_aux_layers(6))
    weights = load_file(out / "model.safetensors")
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d", "midlayer.self_attn.q_proj.weight"} <= set(weights)
    # the head drafts for its target, and the output stays the target's own
    target = tiny_llama(3, len(byte_tokenizer()), layers=6, init=0.2)
    engine = tiny_engine(target, None, num_draft_tokens=3, drafter="eagle3", draft_head=str(out))
    prompt = list(b"hello there")
    outputs = list(engine.generate(Request("t", prompt, SamplingParams(max_tokens=16, temperature=0.0))))
    assert [t for o in outputs for t in o.token_ids] == greedy_reference(target, prompt, 16)
    # a second run finds the prompts, answers and the finished checkpoint: nothing regenerated or retrained
    answers = (out / "work" / "answers.jsonl").read_text()
    assert len((out / "work" / "own_prompts.jsonl").read_text().splitlines()) == 2
    again = train_eagle3(str(model_dir), out, settings)
    assert (out / "work" / "answers.jsonl").read_text() == answers and again["steps"] == report["steps"]
    assert again["train_seconds"] < report["train_seconds"] or again["train_seconds"] < 1.0
    # more epochs continue the finished run from its checkpoint
    longer = train_eagle3(str(model_dir), out, replace(settings, epochs=4.0))
    assert longer["steps"] == 2 * report["steps"] and (out / "work" / "answers.jsonl").read_text() == answers
    assert longer["continued_from_step"] == report["steps"]
    # more prompts continue it too, in the checkpoint's vocabulary: the new answers come after the old
    vocabulary = load_file(out / "model.safetensors")["d2t"]
    more = train_eagle3(str(model_dir), out, replace(settings, epochs=6.0, own_prompts=3))
    assert more["conversations"] == 6 and (out / "work" / "answers.jsonl").read_text().startswith(answers)
    assert more["continued_from_step"] == longer["steps"] < more["steps"]
    assert torch.equal(load_file(out / "model.safetensors")["d2t"], vocabulary)
    # seeded: another folder, the same head
    other = tmp_path / "other"
    train_eagle3(str(model_dir), other, settings)
    assert torch.equal(load_file(other / "model.safetensors")["fc.weight"], weights["fc.weight"])


def test_held_out_prompts_are_whole_runs_of_neighbours_from_every_part_of_the_set():
    """Neighbouring prompts ask about one topic in several ways, so they are held out together; the
    shipped set's types lose some (they come in runs), and a set too small to spare any keeps all."""
    unseen = held_out_prompts(459)
    assert len(unseen) == 50 and {0, 1, 2, 3, 4, 450, 454} <= unseen and not {5, 49, 455} & unseen
    kinds = [prompt["type"] for prompt in load_prompts()]
    assert {kinds[p] for p in unseen} >= {"chat", "code", "summarise", "edit", "json", "multi-turn"}
    assert held_out_prompts(3) == set()


def test_more_samples_add_seeded_sampled_answers_after_the_greedy_ones(tmp_path):
    """--samples 3: every prompt answered greedily first (as --samples 1 answers it), then twice
    sampled; a stopped run resumes to the same file, batch by batch."""
    tokenizer = byte_tokenizer()
    model = tiny_llama(3, len(tokenizer), layers=2, init=0.2)
    prompts = load_prompts(limit=3)
    settings = Eagle3Training(**{**SMALL, "samples": 3, "temperature": 1.0})
    (tmp_path / "greedy").mkdir()
    (tmp_path / "all").mkdir()
    greedy = regenerate(model, tokenizer, prompts, Eagle3Training(**SMALL), tmp_path / "greedy")
    answers = regenerate(model, tokenizer, prompts, settings, tmp_path / "all")
    assert len(answers) == 9 and answers[:3] == greedy
    assert all(a["ids"] != g["ids"] for a, g in zip(answers[3:6], greedy, strict=True))  # sampled, not greedy
    assert answers[3:6] != answers[6:]  # each round its own draws
    store = tmp_path / "all" / "answers.jsonl"
    whole = store.read_text()
    store.write_text("".join(whole.splitlines(keepends=True)[:5]))  # stopped after three batches (2, 1, 2)
    assert regenerate(model, tokenizer, prompts, settings, tmp_path / "all") == answers
    assert store.read_text() == whole
    # fewer samples than the store holds: the first rounds only
    assert regenerate(model, tokenizer, prompts, Eagle3Training(**SMALL), tmp_path / "all") == greedy


def test_the_target_writes_prompts_of_its_own_seeded_new_and_resumed(tmp_path):
    """--own-prompts 6: user turns sampled from the template's user turn, each ended by the turn's
    marker, without markup, none twice; the same seed writes the same ones; a stopped run resumes."""
    tokenizer = byte_tokenizer()
    model = tiny_llama(3, len(tokenizer), layers=2, init=0.2)
    biased = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features)
    with torch.no_grad():  # a target that ends its turns within a few dozen bytes, as a chat model does
        biased.weight.copy_(model.lm_head.weight)
        biased.bias.zero_()
        biased.bias[tokenizer.convert_tokens_to_ids("<|im_end|>")] = 2.0
    model.lm_head = biased
    settings = Eagle3Training(**{**SMALL, "own_prompts": 6, "generate_batch": 8})
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    prompts = own_prompts(model, tokenizer, settings, tmp_path / "a")
    assert len(prompts) == 6 and all(p["type"] == "own" and len(p["turns"]) == 1 for p in prompts)
    turns = [p["turns"][0] for p in prompts]
    assert all(len(t) >= 12 and "<|" not in t and t == t.strip() for t in turns)
    assert len({t.lower() for t in turns}) == 6
    assert own_prompts(model, tokenizer, settings, tmp_path / "b") == prompts
    store = tmp_path / "b" / "own_prompts.jsonl"
    first = [line for line in store.read_text().splitlines(keepends=True) if json.loads(line)["batch"] == 0]
    assert 0 < len(first) < 6  # more than one batch was written
    store.write_text("".join(first))  # stopped after the first batch
    batches, generate = [], model.generate
    model.generate = lambda **kwargs: batches.append(1) or generate(**kwargs)
    assert own_prompts(model, tokenizer, settings, tmp_path / "b") == prompts
    assert len(batches) == prompts[-1]["batch"]  # from the second batch on: the first is not redone
    assert own_prompts(model, tokenizer, Eagle3Training(**{**SMALL, "own_prompts": 3}), tmp_path / "b") == prompts[:3]
    # a store whose turns carry no batch (kept by hand or an older version) is continued, not refused
    bare = [{k: v for k, v in json.loads(line).items() if k != "batch"} for line in first]
    store.write_text("".join(json.dumps(row) + "\n" for row in bare))
    more = own_prompts(model, tokenizer, settings, tmp_path / "b")
    assert more[: len(bare)] == bare and len(more) == 6 and len({p["turns"][0].lower() for p in more}) == 6


def test_the_features_pass_reads_what_extend_computes_without_logits():
    """``CausalLM.read`` (the features pass) gives extend's hidden states and features, bit for bit."""
    target = CausalLM(tiny_llama(seed=5, vocab_size=64, layers=6, init=0.2), 512)
    target.keep_features(default_aux_layers(6))
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    target.extend(ids, num_logits=len(ids))
    hidden, features = target.last_hidden.clone(), target.feature_rows(0, 40).clone()  # [40, E], [40, A*E]
    target.cache.rollback(0)
    assert torch.equal(target.read(ids), hidden) and torch.equal(target.feature_rows(0, 40), features)
    assert target.cache.length == 40


def test_training_teaches_the_head_the_targets_next_tokens():
    """On sequences the tiny target wrote itself, a few dozen steps lift every unrolled step's
    top-1 agreement with the target well above the untrained head's."""
    hf = tiny_llama(seed=5, vocab_size=64, layers=6, init=0.2)
    target = CausalLM(hf, 512)
    torch.manual_seed(0)
    conversations = []
    for _ in range(12):
        prompt = torch.randint(0, 64, (6,)).tolist()
        answer = greedy_reference(hf, prompt, 40)
        conversations.append({"ids": prompt + answer, "answer": [0] * 6 + [1] * 40})
    rows = collect_features(target, conversations, default_aux_layers(6))
    draft_ids = draft_vocabulary(rows, 64, 64)
    target_rows = target.weights.dense(target.lm_head, "weight").float()[draft_ids]
    head = new_head(target, head_config(target, len(draft_ids), default_aux_layers(6)), draft_ids, seed=0)
    batch = make_batch(rows, windows(rows, 64))
    with torch.no_grad():
        before = unrolled_loss(head, target, batch, target_rows, 3)[1]
    optimiser = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(60):
        loss, _ = unrolled_loss(head, target, batch, target_rows, 3)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        after = unrolled_loss(head, target, batch, target_rows, 3)[1]
    assert all(a > b + 0.2 for a, b in zip(after, before, strict=True)), (before, after)


def test_the_command_shows_its_progress_bars_though_library_bars_are_off(tmp_path):
    """The CLI sets TQDM_DISABLE before anything imports (no library's bars on a server's log);
    train-eagle3's own bars, with their ETA, must still show."""
    from tests.conftest import REPO

    model_dir = save_tiny(tmp_path / "target", seed=3, tokenizer=byte_tokenizer(), layers=6, init=0.2)
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in SMALL.items()]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli",
            "train-eagle3",
            "--target",
            str(model_dir),
            "--out",
            str(tmp_path / "head"),
        ]
        + flags,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for bar in ("eagle3: target answers", "eagle3: target features", "eagle3: training"):
        assert re.search(re.escape(bar) + r":\s+100%.*<00:00", result.stderr), f"no finished {bar!r} bar with an ETA"


def test_a_head_continues_from_a_saved_one_in_its_vocabulary_and_only_from_one_of_its_targets_shape(tmp_path):
    """``--start-from``: training begins at the saved head's weights and draft vocabulary (at a
    learning rate too small to move them, what it writes is that head again); a head of another
    target's shape is refused."""
    model_dir = save_tiny(tmp_path / "target", seed=3, tokenizer=byte_tokenizer(), layers=6, init=0.2)
    first = tmp_path / "first"
    train_eagle3(str(model_dir), first, Eagle3Training(**SMALL))
    saved = load_file(first / "model.safetensors")
    # another vocabulary size and seed: what the continued run writes can only be the saved head's
    continued = replace(Eagle3Training(**SMALL), start_from=str(first), lr=1e-12, draft_vocab=32, seed=7)
    report = train_eagle3(str(model_dir), tmp_path / "continued", continued)
    again = load_file(tmp_path / "continued" / "model.safetensors")
    assert report["steps"] > 0 and set(again) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(again[name], tensor), name
    other_dir = save_tiny(tmp_path / "other", seed=3, tokenizer=byte_tokenizer(), layers=4, init=0.2)
    with pytest.raises(ConfigError, match="not a head of this target's shape"):
        train_eagle3(str(other_dir), tmp_path / "refused", replace(continued, start_from=str(first)))


@needs_kernels
def test_int8_features_come_from_the_target_that_int8_activations_serve(tmp_path):
    """``--activations int8``: the features pass reads the GGUF target whose products take int8
    activations (llama.cpp's arithmetic), as ``serve --activations int8`` builds it; a target
    without GGUF blocks is refused before any answer is written."""
    path = tmp_path / "tiny.gguf"
    write_model(path, "llama", hidden=64, heads=4, kv_heads=2, tied=True, tokenizer="smollm")
    target = int8_target(str(path), 256)
    assert "int8 activations in" in target.weights.blocks_line

    def served(activations: str) -> CausalLM:
        config = EngineConfig(target=str(path), drafter="none", activations=activations, max_model_len=256)
        return load_engine(config, show_progress=False).engine.target

    ids = list(range(3, 40))
    hidden = target.read(ids)  # [N, E]
    assert torch.equal(hidden, served("int8").read(ids)) and not torch.equal(hidden, served("float32").read(ids))
    model_dir = save_tiny(tmp_path / "target", seed=3, tokenizer=byte_tokenizer(), layers=6, init=0.2)
    with pytest.raises(ConfigError, match="activations int8"):
        train_eagle3(str(model_dir), tmp_path / "head", replace(Eagle3Training(**SMALL), activations="int8"))
    assert not (tmp_path / "head" / "work" / "answers.jsonl").exists()


def test_the_commands_flags_read_the_new_settings_as_text():
    from server.cli import _parser

    args = vars(_parser().parse_args(["train-eagle3", "--activations", "int8", "--start-from", "some/head"]))
    settings = Eagle3Training(**{name: args[name] for name in Eagle3Training.__dataclass_fields__})
    assert settings.activations == "int8" and settings.start_from == "some/head" and settings.epochs == 12.0
    with pytest.raises(ConfigError, match="activations must be float32 or int8"):
        Eagle3Training(activations="int4")


def test_a_checkpoint_from_before_a_setting_existed_resumes_at_its_default_only():
    """A ``work/checkpoint.pt`` saved before ``activations`` and ``start_from`` existed resumes under
    their defaults, and only under them: float32 features it never saw as int8."""
    settings = asdict(Eagle3Training(**SMALL))
    older = {name: value for name, value in settings.items() if name not in ("activations", "start_from")}
    assert _continues(older, settings)
    assert not _continues(older, {**settings, "activations": "int8"})
    assert not _continues(older, {**settings, "start_from": "some/head"})
    assert _continues(settings, {**settings, "epochs": 4.0}) and not _continues(settings, {**settings, "lr": 2e-3})
