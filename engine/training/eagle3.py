"""Training an EAGLE-3 head for a target by self-distillation (``specserve train-eagle3``).

1. **Data.** The target answers the shipped prompt set (``engine/training/prompts.jsonl``: chat,
   code, summaries and edits, JSON and tool calls, multi-turn; disjoint from the bench's prompts)
   greedily, in batches, turn by turn. Answers are kept in ``OUT/work/answers.jsonl`` as they come,
   so a second run resumes where the first stopped.
2. **Features.** The target reads every conversation once, keeping the residual streams entering
   the head's layers (its features) and its normalised final hidden state (its distribution).
3. **Vocabulary.** The draft vocabulary is the most frequent tokens of the answers (``d2t``/``t2d``).
4. **Training, as EAGLE-3.** Soft cross-entropy against the target's distribution over the draft
   vocabulary, with the head unrolled over ``ttt_steps`` draft steps (training-time test): step j
   feeds the head its own output of step j - 1 and attends to the steps before it at its own row,
   exactly the cache it sees when it drafts. Checkpoints go to ``OUT/work/checkpoint.pt``.

It writes the EAGLE layout (``save_head``), which ``load_head`` reads back. Seeded: the same data,
seed and steps give the same head.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import ConfigError
from ..config import Eagle3Training as TrainSettings
from ..drafters.eagle3_head import Eagle3Head, default_aux_layers, draft_target_ids, load_head, save_head, shipped_head
from ..model.kernels import rotate
from ..model.model import CausalLM
from .eagle3_data import (
    collect_features,
    draft_vocabulary,
    load_prompts,
    make_batch,
    own_prompts,
    regenerate,
    windows,
)

log = logging.getLogger(__name__)

STEP_WEIGHT = 0.8  # step j of the unrolled head weighs 0.8^j: later drafts count only if earlier ones held


def head_config(target: CausalLM, draft_vocab: int, aux_layers: tuple[int, ...]) -> dict:
    """The head's config.json: one layer of the target's own shape."""
    config = target.config
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": dict(rope),
        "max_position_embeddings": target.max_len,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": config.hidden_size,
        "num_hidden_layers": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
    }


def new_head(target: CausalLM, config: dict, draft_ids: torch.Tensor, seed: int) -> Eagle3Head:
    """A trainable head: its layer initialised as Llama's, its norm and LM head rows the target's."""
    torch.manual_seed(seed)
    head = Eagle3Head(config, target, tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]), False)
    head.to(torch.float32)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.weights.dense(target.lm_head, "weight").float()[draft_ids])
        head.norm.weight.copy_(target.norm.weight.float())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    return head


def unrolled_loss(
    head: Eagle3Head, target: CausalLM, batch: dict, target_rows: torch.Tensor, steps: int
) -> tuple[torch.Tensor, list[float]]:
    """The head unrolled ``steps`` draft steps over a padded batch. Row t of step j is drafting
    position t + 1 + j from committed position t: it reads token t + 1 + j at position t + j, with
    features fc(target's of t) at step 0 and the head's own output of step j - 1 after; it attends
    to step 0's rows 0..t and to steps 1..j at row t. Returns (loss, top-1 agreement per step)."""
    ids, features, hidden, learn = batch["ids"], batch["features"], batch["hidden"], batch["learn"]
    count, length = ids.shape[0], ids.shape[1] - 1  # rows: committed positions 0..N-2
    layer, attn, mlp = head.midlayer, head.midlayer.self_attn, head.midlayer.mlp
    heads, kv_heads, dim = head.num_heads, head.num_kv_heads, head.head_dim
    causal = torch.ones(length, length, dtype=torch.bool).tril()  # [T, T]
    feature = head.fc(features[:, :-1])  # [B, T, H]
    # the target's distribution over the draft vocabulary at positions 1..N-1: row t of step j reads t + j
    target_probs = torch.softmax(hidden[:, 1:].float() @ target_rows.T, dim=-1)  # [B, T, Vd]
    keys, values, total, agreement = [], [], 0.0, []
    for step in range(min(steps, length)):
        tokens = F.pad(ids[:, 1 + step :], (0, step))  # [B, T] token t + 1 + j at row t
        positions = torch.arange(length) + step  # [T]
        normed = layer.hidden_norm(feature)
        embedded = target.embedding(tokens.flatten()).view(count, length, -1)  # [B, T, H] as serving reads it
        x = torch.cat([layer.input_layernorm(embedded), normed], dim=-1)  # [B, T, 2H]
        q = attn.q_proj(x).view(count, length, heads, dim).transpose(1, 2)  # [B, Hq, T, D]
        k = attn.k_proj(x).view(count, length, kv_heads, dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = attn.v_proj(x).view(count, length, kv_heads, dim).transpose(1, 2)
        cos, sin = head.cos[positions], head.sin[positions]  # [T, D]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        repeat = heads // kv_heads
        keys.append(k.repeat_interleave(repeat, 1))
        values.append(v.repeat_interleave(repeat, 1))
        scale = dim**-0.5
        first = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, Hq, T, T]
        own = torch.stack([(q * key).sum(-1) * scale for key in keys[1:]], dim=-1) if step else None  # [B, Hq, T, j]
        weights = torch.softmax(first if own is None else torch.cat([first, own], dim=-1), dim=-1)
        out = weights[..., :length] @ values[0]  # [B, Hq, T, D]
        for i, value in enumerate(values[1:]):
            out = out + weights[..., length + i, None] * value
        residual = feature  # norm_before_residual off, as the EAGLE repository trains
        h = attn.o_proj(out.transpose(1, 2).reshape(count, length, heads * dim)) + residual
        normed = layer.post_attention_layernorm(h)
        h = mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed)) + h  # [B, T, H] pre-norm
        draft_logits = head.lm_head(head.norm(h))  # [B, T, Vd]
        p = F.pad(target_probs[:, step:], (0, 0, 0, step))  # [B, T, Vd]
        mask = F.pad(learn[:, 1 + step :], (0, step))  # [B, T] rows whose drafted position is an answer's
        log_q = torch.log_softmax(draft_logits, dim=-1)
        rows = mask.sum().clamp(min=1)
        total = total + STEP_WEIGHT**step * -((p * log_q).sum(-1) * mask).sum() / rows
        agreement.append(float(((draft_logits.argmax(-1) == p.argmax(-1)) & mask).sum() / rows))
        feature = h
    return total, agreement


def held_out_prompts(num_prompts: int) -> set[int]:
    """The prompts whose answers training never sees: five of every fifty, in runs of five, so
    that a topic the prompt set asks about in several ways (its neighbours) is held out whole; none
    from a set of under fifty."""
    return {p for p in range(num_prompts) if p % 50 < 5} if num_prompts >= 50 else set()


# Settings a checkpoint continues under when they change: more passes, or more data. The prompts
# the target writes itself and the sampled answers come after the ones before them, so every
# prompt keeps its index and the held-out ones stay held out.
CONTINUED_ACROSS = ("epochs", "own_prompts", "samples")


def _continues(saved: dict, settings: dict) -> bool:
    """Whether a checkpoint trained under ``saved`` continues under ``settings``: the same settings
    resume it; more epochs or more data continue it under a learning-rate schedule of their own. A
    setting the checkpoint predates counts as its default."""
    kept = [name for name in settings if name not in CONTINUED_ACROSS]
    defaults = {name: field.default for name, field in TrainSettings.__dataclass_fields__.items()}
    return all(saved.get(name, defaults.get(name)) == settings[name] for name in kept)


def started_head(folder: str, target: CausalLM, aux_layers: tuple[int, ...]) -> tuple[dict, torch.Tensor]:
    """``--start-from``: a saved head's weights (float32) and the target ids of its draft vocabulary,
    read and checked against the target as serving reads it (``load_head``), and of the shape this
    training gives a head, to continue training where it stopped."""
    head = load_head(folder, target, blocks=False)
    expected = head_config(target, len(head.draft_to_target), aux_layers)
    found = {
        "num_attention_heads": head.num_heads,
        "num_key_value_heads": head.num_kv_heads,
        "head_dim": head.head_dim,
        "intermediate_size": head.midlayer.mlp.gate_proj.out_features,
    }
    differs = [key for key, value in found.items() if value != expected[key]]
    if head.aux_layers != aux_layers or differs:
        raise ConfigError(
            f"start_from: {folder} is not a head of this target's shape (differs in {differs or 'aux layers'})"
        )
    weights = {
        name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in head.state_dict().items()
    }
    return weights, head.draft_to_target


def train(target: CausalLM, rows: list[dict], settings: TrainSettings, out: Path, num_prompts: int) -> dict:
    """Train, checkpointing to ``out/work``; writes the head to ``out`` and returns a report. Row i
    answers prompt i % ``num_prompts`` (``regenerate``'s order)."""
    work = out / "work"
    aux_layers = default_aux_layers(len(target.layers))
    # held out by prompt, every answer to it: windows of one answer, or answers to one prompt or
    # topic, are too alike to test on (a twentieth of the windows held out scored 0.38 where unseen
    # prompts gave 0.1-0.17)
    unseen = held_out_prompts(num_prompts)
    pieces = windows(rows, settings.window)
    held_out = [piece for piece in pieces if piece[0] % num_prompts in unseen]
    pieces = [piece for piece in pieces if piece[0] % num_prompts not in unseen]
    per_batch = max(1, settings.batch_tokens // settings.window)
    batches_per_epoch = math.ceil(len(pieces) / per_batch)
    total_steps = max(1, int(settings.epochs * batches_per_epoch))
    checkpoint = work / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=False) if checkpoint.is_file() else None
    resumed = state is not None and _continues(state["settings"], asdict(settings)) and state["step"] <= total_steps
    same = resumed and state["settings"] == asdict(settings)
    started_from = None
    if resumed:  # the checkpoint's vocabulary, whatever data was added
        draft_ids = draft_target_ids(state["head"]["d2t"])
    elif settings.start_from:
        started_from, draft_ids = started_head(settings.start_from, target, aux_layers)
    else:
        seen = [row for index, row in enumerate(rows) if index % num_prompts not in unseen]
        draft_ids = draft_vocabulary(seen, settings.draft_vocab, target.vocab_size)
    config = head_config(target, len(draft_ids), aux_layers)
    head = new_head(target, config, draft_ids, settings.seed)
    target_rows = target.weights.dense(target.lm_head, "weight").float()[draft_ids]  # [Vd, E]
    trainable = list(head.parameters())  # the target's embedding is read, not held: it is no parameter here
    optimiser = torch.optim.AdamW(trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, started, begun = 0, time.monotonic(), 0  # begun: the step this run's learning-rate schedule starts at
    if started_from is not None:
        head.load_state_dict(started_from)
    if resumed:
        head.load_state_dict(state["head"])
        optimiser.load_state_dict(state["optimiser"])
        step = state["step"]
        begun = state.get("begun", 0) if same else step
        log.info("resuming at step %d of %d", step, total_steps)
    span, warmup = total_steps - begun, max(1, (total_steps - begun) // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / span)))
    )
    if same:
        schedule.load_state_dict(state["schedule"])
    history: list[list[float]] = []
    recent: list[float] = []
    first_step = step
    bar = tqdm(total=total_steps, initial=step, desc="eagle3: training", unit="step", disable=False)
    head.train()
    while step < total_steps:
        epoch, index = divmod(step, batches_per_epoch)
        order = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(settings.seed + epoch))
        chosen = [pieces[int(i)] for i in order[index * per_batch : (index + 1) * per_batch]]
        loss, agreement = unrolled_loss(head, target, make_batch(rows, chosen), target_rows, settings.ttt_steps)
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimiser.step()
        schedule.step()
        step += 1
        history.append(agreement)
        recent = [sum(a[j] for a in history[-20:] if j < len(a)) / len(history[-20:]) for j in range(len(agreement))]
        bar.set_postfix_str(f"loss {float(loss.detach()):.3f} top-1 " + "/".join(f"{a:.2f}" for a in recent))
        bar.update(1)
        if step % 50 == 0 or step == total_steps:
            work.mkdir(parents=True, exist_ok=True)
            state = {"head": head.state_dict(), "optimiser": optimiser.state_dict(), "schedule": schedule.state_dict()}
            torch.save({**state, "step": step, "begun": begun, "settings": asdict(settings)}, checkpoint)
    bar.close()
    head.eval()
    with torch.no_grad():
        held = [
            unrolled_loss(head, target, make_batch(rows, [piece]), target_rows, settings.ttt_steps)[1]
            for piece in held_out
        ]
    held_top1 = [round(sum(a[j] for a in held if j < len(a)) / max(1, len(held)), 3) for j in range(settings.ttt_steps)]
    weights = {
        name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        for name, tensor in head.state_dict().items()
        if name.split(".")[0] in ("fc", "midlayer", "norm", "lm_head", "d2t")
    }
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    save_head({**weights, "t2d": t2d}, config, out)
    tokens = sum(int(row["answer"].sum()) for row in rows)
    covered = sum(int(t2d[row["ids"][row["answer"]]].sum()) for row in rows)
    return {
        "steps": step,
        "continued_from_step": first_step,
        "conversations": len(rows),
        "answer_tokens": tokens,
        "draft_vocab_coverage": round(covered / max(1, tokens), 4),
        "train_top1_per_step": [round(a, 3) for a in recent],
        "held_out_top1_per_step": held_top1,
        # the acceptance auto starts the head from: its first draft's agreement on unseen answers
        "held_out_acceptance": held_top1[0] if held else None,
        "train_seconds": round(time.monotonic() - started, 1),
    }


def int8_target(target_ref: str | None, max_len: int) -> CausalLM:
    """The target ``specserve serve --activations int8`` serves, loaded as the server loads it: its
    GGUF blocks multiplied with int8 activations (a ConfigError for a target that has none)."""
    from ..config import EngineConfig
    from ..factory import load_engine

    config = EngineConfig(target=target_ref, drafter="none", activations="int8", max_model_len=max_len)
    return load_engine(config, show_progress=False).engine.target


def train_eagle3(target_ref: str | None, out: Path | None, settings: TrainSettings) -> dict:
    """The whole recipe: answers, features, vocabulary, training; resumable from ``out/work``."""
    from ..model.loader import EMBEDDED_NAME, load_model, load_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = out or shipped_head(target_ref or EMBEDDED_NAME)
    (out / "work").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    started = time.monotonic()
    tokenizer = load_tokenizer(target_ref)
    model = load_model(target_ref, device, torch.float32)
    max_len = min(4096, getattr(model.config, "max_position_embeddings", 4096))
    # the features' target: int8 first, so that one which cannot be is refused before any answer is written
    features_from = int8_target(target_ref, max_len) if settings.activations == "int8" else None
    prompts = load_prompts(limit=settings.limit)
    prompts += own_prompts(model, tokenizer, settings, out / "work") if settings.own_prompts else []
    conversations = regenerate(model, tokenizer, prompts, settings, out / "work")
    generated = time.monotonic()
    target = features_from if features_from is not None else CausalLM(model, max_len=max_len)
    rows = collect_features(target, conversations, default_aux_layers(len(target.layers)))
    report = train(target, rows, settings, out, len(prompts))
    report = {
        "command": f"specserve train-eagle3 --target {target_ref or 'embedded'} --out {out}",
        "settings": asdict(settings),
        **report,
        "data_seconds": round(generated - started, 1),
        "wall_seconds": round(time.monotonic() - started, 1),
        "device": str(device),
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
