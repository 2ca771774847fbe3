"""Offline preparation of drafters on CPU: Medusa head training and self-speculation calibration.

Text comes from what every machine has: the Python standard library's own source, plus the
target's own greedy answers to a few chat prompts (self-distillation). Labels are the target's
greedy predictions, so the heads learn to guess what the target will say, not what the corpus says.
"""

from __future__ import annotations

import json
import logging
import sysconfig
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from ..drafters.medusa import MedusaHeads
from ..drafters.self_spec import calibrate, calibration_file
from ..engine import Request, SpecEngine
from ..model.model import CausalLM
from ..sampling import SamplingParams

log = logging.getLogger(__name__)

STDLIB_MODULES = [
    "json/__init__.py",
    "textwrap.py",
    "argparse.py",
    "collections/__init__.py",
    "dataclasses.py",
    "functools.py",
    "pathlib.py",
    "csv.py",
    "string.py",
    "heapq.py",
    "shutil.py",
    "random.py",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for better sleep.",
    "Summarise the plot of Romeo and Juliet.",
    "How do I read a file line by line in Python?",
    "What is the difference between a list and a tuple?",
    "Write a haiku about autumn.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
]


def stdlib_text(max_chars: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / name).read_text(errors="ignore") for name in STDLIB_MODULES if (root / name).is_file()]
    return "\n\n".join(parts)[:max_chars]


def chat_transcripts(
    engine: SpecEngine, tokenizer: PreTrainedTokenizerBase, count: int, max_tokens: int
) -> list[list[int]]:
    """The target's own greedy answers, with their chat-formatted prompts."""
    sequences = []
    for i, prompt in enumerate(CHAT_PROMPTS[:count]):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
        answer = [
            t
            for out in engine.generate(
                Request(f"distil-{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            )
            for t in out.token_ids
        ]
        sequences.append(ids + answer)
    return sequences


@torch.inference_mode()
def collect(
    target: CausalLM, sequences: list[list[int]], num_heads: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced hidden states [N, E] and labels [N, H]: head i at position t must guess the
    target's greedy prediction at t + 1 + i (the token t + 2 + i); -100 where none exists."""
    features, labels = [], []
    for sequence in sequences:
        for start in range(0, len(sequence) - 1, chunk):
            ids = sequence[start : start + chunk]
            target.cache.rollback(0)
            greedy = target.extend(ids, num_logits=len(ids)).argmax(-1)  # [T]; row t predicts token t + 1
            hidden = target.last_hidden  # [T, E]
            rows = torch.full((len(ids), num_heads), -100, dtype=torch.long)
            for head in range(num_heads):
                shift = 1 + head
                rows[: len(ids) - shift, head] = greedy[shift:]
            features.append(hidden.float().clone())
            labels.append(rows)
    target.cache.rollback(0)
    return torch.cat(features), torch.cat(labels)


def train_heads(
    target: CausalLM, features: torch.Tensor, labels: torch.Tensor, num_heads: int, seconds: float, batch: int = 64
) -> tuple[MedusaHeads, dict]:
    heads = MedusaHeads(num_heads, features.shape[1])
    lm_head = target.weights.dense(target.lm_head, "weight").detach().float()  # [V, E], frozen and shared
    optimiser = torch.optim.AdamW(heads.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    # Hold out the last tenth as one block: neighbouring positions of one text are too alike to test on.
    held_out = torch.arange(len(features)) >= len(features) * 9 // 10
    train_x, train_y = features[~held_out], labels[~held_out]
    started, steps = time.monotonic(), 0
    while time.monotonic() - started < seconds:
        index = torch.randint(0, len(train_x), (batch,), generator=generator)
        logits = heads(train_x[index]) @ lm_head.T  # [B, H, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), train_y[index].flatten(), ignore_index=-100)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        steps += 1
        if steps % 50 == 0:
            log.info("step %d loss %.3f", steps, float(loss))
    with torch.no_grad():
        predictions = (heads(features[held_out]) @ lm_head.T).argmax(-1)  # [N, H]
        wanted = labels[held_out]
        valid = wanted != -100
        accuracy = [float(((predictions == wanted) & valid)[:, h].sum() / valid[:, h].sum()) for h in range(num_heads)]
    return heads.eval(), {
        "steps": steps,
        "seconds": round(time.monotonic() - started, 1),
        "examples": len(features),
        "held_out_accuracy": [round(a, 4) for a in accuracy],
    }


def train_medusa(
    engine: SpecEngine,
    tokenizer,
    model_name: str,
    out: Path,
    num_heads: int,
    minutes: float,
    max_chars: int,
    chat_samples: int,
) -> dict:
    sequences = chat_transcripts(engine, tokenizer, chat_samples, max_tokens=96)
    sequences.append(tokenizer(stdlib_text(max_chars)).input_ids)
    features, labels = collect(engine.target, sequences, num_heads, chunk=256)
    log.info("collected %d positions", len(features))
    heads, report = train_heads(engine.target, features, labels, num_heads, seconds=minutes * 60)
    report.update({"corpus": f"stdlib source ({max_chars} chars) + {chat_samples} greedy chat answers"})
    heads.save(out, model_name, report)
    return report


def calibrate_self(
    engine: SpecEngine, tokenizer, model_name: str, keep: int, max_chars: int, out: Path | None, tokens: int = 256
) -> dict:
    ids = tokenizer(stdlib_text(max_chars)).input_ids[: engine.max_model_len]
    sequences = chat_transcripts(engine, tokenizer, 2, max_tokens=64)
    sample = (sum(sequences, []) + ids)[:tokens]  # half chat answers, half source code
    layers, score = calibrate(engine.target, sample, keep)
    result = {
        "model": model_name,
        "layers": list(layers),
        "teacher_forced_greedy_agreement": round(score, 4),
        "tokens": len(sample),
    }
    path = out or calibration_file(model_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result
