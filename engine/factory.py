"""From an ``EngineConfig`` to a running engine: load, wrap, size the caches once."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
from dataclasses import dataclass

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import PreTrainedTokenizerBase

from .config import EngineConfig
from .engine import SpecEngine, build_engine
from .loader import eos_token_ids, load
from .threads import set_threads, usable_cpus

STAGES = ("tokenizer", "target", "draft", "caches", "warm-up")


@dataclass(slots=True)
class LoadedEngine:
    engine: SpecEngine
    tokenizer: PreTrainedTokenizerBase
    model_name: str


def load_engine(config: EngineConfig, show_progress: bool | None = None) -> LoadedEngine:
    """Load and wrap, in the thread that will run the forward passes; on a terminal a progress bar
    shows each stage with its size and the time taken."""
    set_threads(config.threads or usable_cpus())
    show = sys.stderr.isatty() if show_progress is None else show_progress
    # On a terminal, one bar; log lines are written above it instead of through it. Elsewhere, lines only.
    redirect = logging_redirect_tqdm() if show else contextlib.nullcontext()
    bar = tqdm(total=len(STAGES), desc="specserve: loading", unit="stage", disable=not show, leave=False)
    with redirect, bar:

        def progress(done: str) -> None:
            bar.set_postfix_str(done)  # e.g. "target 135M params, 513 MB float32 on cpu"
            bar.update(1)

        models = load(config, progress)
        tokenizer, name = models.tokenizer, models.target_name
        eos = eos_token_ids(models.target, models.tokenizer)
        engine = build_engine(config, models.target, models.draft, eos, len(models.tokenizer))
        progress(f"KV caches {engine.cache_bytes / 2**20:,.0f} MB")
        progress(engine.warm_up().describe())
    del models  # the draft copy that copy:auto did not keep, among what start-up no longer needs
    release_freed_memory()
    return LoadedEngine(engine, tokenizer, name)


def release_freed_memory() -> None:
    """Hand memory that start-up freed back to the system. glibc keeps freed heap pages mapped:
    after copy:auto dropped the bfloat16 copy of the embedded model, the server held about 430 MB
    more than it used (resident 1,977 MB, 1,547 MB after ``malloc_trim``)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
