"""The data ``specserve train-eagle3`` trains on (engine/training/eagle3.py): the target's own
answers to the shipped prompt set, the features and distributions it computes over them, the draft
vocabulary, and the padded batches of conversation windows the head is unrolled over."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import ConfigError
from ..config import Eagle3Training as TrainSettings
from ..model.model import CausalLM

PROMPTS = Path(__file__).parent / "prompts.jsonl"
PROMPT_TOKENS = 80  # the longest user turn the target writes itself (``own_prompts``)


def load_prompts(path: Path = PROMPTS, limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit]


@torch.inference_mode()
def own_prompts(generator_model, tokenizer, settings: TrainSettings, work: Path) -> list[dict]:
    """``settings.own_prompts`` user turns the target writes itself: its chat template up to a user
    turn's text, sampled at temperature 1 until the turn's end marker, kept where they end within
    ``PROMPT_TOKENS``, are new and hold no markup. The shipped set asks a few hundred things in a few
    ways; these ask what the target itself expects to be asked. Kept in ``work/own_prompts.jsonl``
    and resumed from there; seeded per batch."""
    store = work / "own_prompts.jsonl"
    kept = load_prompts(store) if store.is_file() else []
    if len(kept) >= settings.own_prompts:
        return kept[: settings.own_prompts]
    marker = "\x00turn\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    head, _, tail = text.partition(marker)
    end = tail.strip().split()[0] if tail.strip() else ""
    if not end or head == text:
        raise ConfigError("--own-prompts needs a chat template that ends a user turn with a marker")
    encoded = tokenizer([head] * settings.generate_batch, return_tensors="pt", add_special_tokens=False)
    pad = _pad_id(tokenizer)
    seen = {row["turns"][0].lower() for row in kept}
    bar = tqdm(total=settings.own_prompts, initial=len(kept), desc="eagle3: own prompts", unit="prompt", disable=False)
    # resumed after the last kept turn's batch; a store whose turns carry no batch (kept by hand, or
    # by an older version) after as many batches as it holds turns (a repeated turn is skipped anyway)
    first = (kept[-1]["batch"] + 1 if "batch" in kept[-1] else len(kept)) if kept else 0
    # a batch keeps about half its turns (the rest run past PROMPT_TOKENS): stop at a tenth of that
    for batch in range(first, first + 20 * settings.own_prompts // settings.generate_batch + 1):
        if len(kept) >= settings.own_prompts:
            break
        torch.manual_seed(settings.seed + 1_000_003 * (batch + 1))
        out = generator_model.generate(
            **encoded,
            max_new_tokens=PROMPT_TOKENS,
            do_sample=True,
            temperature=1.0,
            top_p=0.95,
            top_k=0,
            pad_token_id=pad,
        )  # [B, P + N]
        new = []
        for row in out[:, encoded.input_ids.shape[1] :]:
            turn, ended, _ = tokenizer.decode(row, skip_special_tokens=False).partition(end)
            turn = turn.strip()
            if ended and len(turn) >= 12 and "<|" not in turn and turn.lower() not in seen:
                seen.add(turn.lower())
                new.append({"type": "own", "turns": [turn], "batch": batch})
        new = new[: settings.own_prompts - len(kept)]
        with store.open("a") as sink:
            sink.writelines(json.dumps(row) + "\n" for row in new)
        kept += new
        bar.update(len(new))
    bar.close()
    return kept


@torch.inference_mode()
def regenerate(generator_model, tokenizer, prompts: list[dict], settings: TrainSettings, work: Path) -> list[dict]:
    """The target's answers, conversation by conversation ({"ids", "answer"}: ``_tokenise``), batched per
    turn: every prompt answered greedily, then ``samples - 1`` more times sampled (seeded per batch).
    Kept in ``work/answers.jsonl`` in that order and resumed from there."""
    store = work / "answers.jsonl"
    done = [json.loads(line) for line in store.read_text().splitlines()] if store.is_file() else []
    jobs = [(sample, index) for sample in range(settings.samples) for index in range(len(prompts))]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    # disable=False: the CLI turns library bars off (TQDM_DISABLE), not the bars of its own long jobs
    bar = tqdm(total=len(jobs), initial=len(done), desc="eagle3: target answers", unit="conv", disable=False)
    try:
        first = len(done)
        while first < len(jobs):
            # a batch holds one sample round: greedy and sampled answers are never mixed
            batch = [job for job in jobs[first : first + settings.generate_batch] if job[0] == jobs[first][0]]
            torch.manual_seed(settings.seed + first)
            chats = _answer(generator_model, tokenizer, [prompts[i] for _, i in batch], batch[0][0], settings)
            with store.open("a") as sink:
                for chat in chats:
                    sink.write(json.dumps(_tokenise(tokenizer, chat)) + "\n")
            bar.update(len(batch))
            first += len(batch)
    finally:
        tokenizer.padding_side = side
        bar.close()
    return [json.loads(line) for line in store.read_text().splitlines()][: len(jobs)]


def _answer(generator_model, tokenizer, batch: list[dict], sample: int, settings: TrainSettings) -> list[list[dict]]:
    """One batch of conversations answered turn by turn: greedily for sample 0, sampled after."""
    pad = _pad_id(tokenizer)
    how = {"do_sample": True, "temperature": settings.temperature, "top_k": 0} if sample else {"do_sample": False}
    chats = [[{"role": "system", "content": p["system"]}] if p.get("system") else [] for p in batch]
    for turn in range(max(len(p["turns"]) for p in batch)):
        live = [i for i, p in enumerate(batch) if turn < len(p["turns"])]
        for i in live:
            chats[i].append({"role": "user", "content": batch[i]["turns"][turn]})
        texts = [tokenizer.apply_chat_template(chats[i], add_generation_prompt=True, tokenize=False) for i in live]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = generator_model.generate(
            **encoded, max_new_tokens=settings.max_new_tokens, pad_token_id=pad, **how
        )  # [B, P + N]
        for row, i in enumerate(live):
            answer = [t for t in out[row, encoded.input_ids.shape[1] :].tolist() if t != pad]
            chats[i].append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    return chats


def _pad_id(tokenizer) -> int:
    """What ``generate`` pads a batch's finished rows with: the pad token, else the end of text."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _tokenise(tokenizer, chat: list[dict]) -> dict:
    """A whole conversation's ids, with which of them are answers (the rows the head learns)."""
    ids: list[int] = []
    answer_mask: list[int] = []
    for end in range(1, len(chat) + 1):
        text = tokenizer.apply_chat_template(chat[:end], tokenize=False)
        full = tokenizer(text, add_special_tokens=False).input_ids
        new = full[len(ids) :]
        answer_mask += [int(chat[end - 1]["role"] == "assistant")] * len(new)
        ids = full
    return {"ids": ids, "answer": answer_mask}


@torch.inference_mode()
def collect_features(target: CausalLM, conversations: list[dict], aux_layers: tuple[int, ...]) -> list[dict]:
    """Per conversation: ids [N], answer mask [N], features [N, A*E] and the target's normalised
    final hidden states [N, E] (bfloat16 on the host: half the memory, plenty for a target)."""
    target.keep_features(aux_layers)
    rows = []
    for conversation in tqdm(conversations, desc="eagle3: target features", unit="conv", disable=False):
        ids = conversation["ids"][: target.max_len]
        target.cache.rollback(0)
        hidden = target.read(ids)  # [N, E]
        rows.append(
            {
                "ids": torch.tensor(ids),
                "answer": torch.tensor(conversation["answer"][: len(ids)], dtype=torch.bool),
                "features": target.feature_rows(0, len(ids)).to("cpu", torch.bfloat16),
                "hidden": hidden.to("cpu", torch.bfloat16),
            }
        )
    target.cache.rollback(0)
    return rows


def draft_vocabulary(rows: list[dict], draft_vocab: int, vocab_size: int) -> torch.Tensor:
    """The ``draft_vocab`` target ids answers use most, ascending (ties by id: deterministic)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        counts += torch.bincount(row["ids"][row["answer"]], minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[: min(draft_vocab, vocab_size)]))


def windows(rows: list[dict], window: int, context: int = 128) -> list[tuple[int, int, int]]:
    """(row, start, end) pieces of at most ``window`` positions that contain answers, from
    ``context`` positions before a conversation's first answer (a long prompt's start seldom
    decides its answer's next tokens, and every row costs the same to train)."""
    pieces = []
    for index, row in enumerate(rows):
        answers = row["answer"].nonzero()
        if len(answers) == 0:
            continue
        for start in range(max(0, int(answers[0]) - context), len(row["ids"]) - 1, window):
            end = min(start + window, len(row["ids"]))
            if row["answer"][start + 1 : end].any():
                pieces.append((index, start, end))
    return pieces


def make_batch(rows: list[dict], pieces: list[tuple[int, int, int]]) -> dict:
    """Pieces of conversations, right-padded: ids [B, N], features [B, N, A*E], hidden [B, N, E],
    learn [B, N] (positions whose next token is an answer's)."""
    width = max(end - start for _, start, end in pieces)

    def padded(name: str, index: int, start: int, end: int) -> torch.Tensor:
        part = rows[index][name][start:end]
        return F.pad(part, (0, 0) * (part.dim() - 1) + (0, width - (end - start)))

    batch = {name: torch.stack([padded(name, *piece) for piece in pieces]) for name in ("ids", "features", "hidden")}
    answer = torch.stack([padded("answer", *piece) for piece in pieces])  # [B, N] token is an answer's
    batch["learn"] = F.pad(answer[:, 1:], (0, 1))  # position t's distribution is for token t + 1
    batch["features"], batch["hidden"] = batch["features"].float(), batch["hidden"].float()
    return batch
