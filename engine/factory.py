"""From an ``EngineConfig`` to a running engine: load, wrap, size the caches once."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from .config import EngineConfig
from .engine import SpecEngine, build_engine
from .loader import eos_token_ids, load


@dataclass(slots=True)
class LoadedEngine:
    engine: SpecEngine
    tokenizer: PreTrainedTokenizerBase
    model_name: str


def load_engine(config: EngineConfig) -> LoadedEngine:
    models = load(config)
    engine = build_engine(config, models.target, models.draft, eos_token_ids(models.target, models.tokenizer))
    return LoadedEngine(engine, models.tokenizer, models.target_name)
