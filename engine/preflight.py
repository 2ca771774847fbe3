"""Everything about a configuration that can be checked before any weights load.

Each problem is one line a person can act on; loading a model only to fail on a setting wastes
seconds to minutes and ends in a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import COPY_PREFIX, NO_DRAFTER, ConfigError, EngineConfig, available_memory
from .drafters import available, check_stages
from .drafters.medusa import check_checkpoint
from .model.loader import locate


def check_device(config: EngineConfig) -> list[str]:
    if not config.device.startswith("cuda") or torch.cuda.is_available():
        return []
    why = "is a CPU-only build" if torch.version.cuda is None else "sees no NVIDIA GPU here"
    return [
        f"device {config.device!r}: no CUDA GPU can be used (torch {torch.__version__} {why}); "
        "use --device cpu, or a CUDA build of torch on a machine with an NVIDIA GPU"
    ]


def model_size(ref: str | None, config_key: str, gguf_key: str) -> int | None:
    """One of the model's sizes, from its config.json (``config_key``) or its GGUF metadata
    (``{architecture}.{gguf_key}``), without loading weights; None where neither says."""
    where, extra = locate(ref)
    if "gguf_file" in extra:
        from gguf import GGUFReader

        reader = GGUFReader(Path(where) / extra["gguf_file"])
        architecture = reader.fields["general.architecture"]
        name = bytes(architecture.parts[architecture.data[0]]).decode()
        field = reader.fields.get(f"{name}.{gguf_key}")
        return None if field is None else int(field.parts[field.data[0]][0])
    config_file = Path(where) / "config.json"
    return json.loads(config_file.read_text()).get(config_key) if config_file.is_file() else None


def num_layers(ref: str | None) -> int | None:
    return model_size(ref, "num_hidden_layers", "block_count")


def check_context(config: EngineConfig) -> list[str]:
    """A context longer than the positions the target was trained on is refused (as vLLM does):
    the caches would be sized for it, and the positions past the model's are ones it never saw."""
    limit = model_size(config.target, "max_position_embeddings", "context_length")
    if config.max_model_len is None or limit is None or config.max_model_len <= limit:
        return []
    return [
        f"max_model_len {config.max_model_len} exceeds the target's {limit} positions; use --max-model-len {limit} or less"
    ]


def preflight(config: EngineConfig) -> list[str]:
    """The problems with ``config`` that would stop it from serving, one line each (empty: go ahead)."""
    problems = check_device(config)
    refs = [("target", config.target)]
    if config.draft is not None and not config.draft.startswith(COPY_PREFIX):
        refs.append(("draft", config.draft))
    missing = set()
    for role, ref in refs:
        try:
            locate(ref)
        except ConfigError as exc:
            missing.add(role)
            problems.append(f"{role}: {exc}")
    if "target" not in missing:
        problems += check_context(config)
    if config.drafter not in (*available(), NO_DRAFTER):
        problems.append(f"unknown drafter {config.drafter!r}; available: {', '.join([*available(), NO_DRAFTER])}")
    try:
        check_stages(config.stages)
    except ConfigError as exc:
        problems.append(str(exc))
    if config.self_layers is not None:
        if not config.self_layers:
            problems.append("self_layers: give at least one layer index, e.g. 0,1,2,20,21")
        count = num_layers(config.target) if "target" not in missing else None
        bad = [layer for layer in config.self_layers if layer < 0 or (count is not None and layer >= count)]
        if bad:
            within = f"0..{count - 1}" if count is not None else "non-negative"
            problems.append(f"self_layers: {bad} out of range; the target's layers are {within}")
    if config.medusa_heads is not None:
        try:
            check_checkpoint(Path(config.medusa_heads))
        except ConfigError as exc:
            problems.append(f"medusa_heads: {exc}")
    if config.prefix_cache_bytes > (have := available_memory()):  # the slots are checked once their size is known
        problems.append(
            f"prefix_cache_gb {config.prefix_cache_gb:g} is more than the {have / 2**30:.1f} GB of memory available; "
            "lower --prefix-cache-gb"
        )
    return problems
