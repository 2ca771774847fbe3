"""Server settings, the one source of every ``specserve serve`` option.

Each field is one setting: a ``--flag`` (generated from the field by ``add_arguments``: its help,
choices and default), a ``SPECSERVE_<NAME>`` environment variable and a key of a YAML preset.
Precedence: flags > preset (--config) > environment > defaults. A setting the engine reads takes
its default from ``EngineConfig`` (``engine_field``), and ``engine_config`` builds the engine's
configuration from the fields both share, so no default is written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.config import ACTIVATIONS, DRAFT_KV, DTYPES, KERNEL_MODES, PLAN_MODES, ConfigError, EngineConfig

DEFAULT_DRAFT = "copy:auto"  # a copy of the target, bfloat16 or int8 rows, whichever measures faster here
ENGINE_DEFAULTS: dict[str, Any] = {field.name: field.default for field in dataclasses.fields(EngineConfig)}
PRODUCTION = "production"  # the help's group of the production settings


def engine_field(name: str, description: str, shown: Any = None, **constraints) -> Any:
    """A setting the engine reads, with ``EngineConfig``'s default (``shown``: that default as the
    setting holds it, where the setting's form differs: "ngram,model" for a tuple)."""
    default = ENGINE_DEFAULTS[name] if shown is None else shown
    return Field(default=default, description=description, json_schema_extra={"engine": True}, **constraints)


def production(default: Any, description: str, **constraints) -> Any:
    return Field(default=default, description=description, json_schema_extra={"group": PRODUCTION}, **constraints)


def _int_list(text: str | None, name: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated integers, got {text!r}") from None


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_", extra="forbid")

    target: str | None = engine_field(
        "target", "model folder, hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    draft: str | None = Field(
        default="auto",
        description="draft model ref, copy:FORM (the target as bfloat16, float16, float32, int8 rows, or auto: "
        "the faster of bfloat16 and int8 here), none, or auto (copy:auto for the embedded model, else none)",
    )
    drafter: str = engine_field("drafter", "drafting strategy (none: the target alone unless a request asks)")
    num_draft_tokens: int = engine_field("num_draft_tokens", "tokens drafted per speculative step", ge=0, le=64)
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="port")
    device: Literal["auto", "cpu", "cuda"] = engine_field("device", "where the models run")
    dtype: Literal[("auto", *DTYPES)] = engine_field("dtype", "weights' dtype (auto: bfloat16 on GPU, float32 on CPU)")
    max_model_len: int | None = engine_field(
        "max_model_len", "context length; KV caches are sized to it once (default: the model's, at most 4096)", ge=2
    )
    served_model_name: str | None = Field(default=None, description="model id clients use (default: the target ref)")
    seed: int | None = engine_field("seed", "seed for requests that bring none")
    threads: int | None = engine_field("threads", "CPU threads (default: the CPUs this process may use)", ge=1)
    needs: str | None = Field(
        default=None,
        description="what a preset needs to run, said when it cannot start",
        json_schema_extra={"cli": False},
    )
    gguf_blocks: bool = engine_field(
        "gguf_blocks", "a GGUF target on CPU multiplies its file's own quantized blocks where faster (exact, float32)"
    )
    activations: Literal[ACTIVATIONS] = engine_field(
        "activations",
        "what a GGUF target's Q4_0/Q4_1/Q8_0 products multiply on CPU: float32 activations (exact), int8 per "
        "block of 32 as llama.cpp does (a slightly different model), or auto: int8 where start-up measures it faster",
    )
    matmul_plan: Literal[PLAN_MODES] = engine_field(
        "matmul_plan",
        "CPU: read the matmul plan stored for this host and model (cached), or measure it again and store it",
    )
    plan_cache: str | None = engine_field(
        "plan_cache", "folder of stored matmul plans (default: $XDG_CACHE_HOME/specserve/matmul-plans, or ~/.cache/...)"
    )
    adaptive_k: bool = engine_field("adaptive_k", "choose k per step (up to --num-draft-tokens) from measured costs")
    enforce_eager: bool = Field(
        default=False,
        description="on a GPU, run every forward eagerly: no CUDA graphs, no compiled kernels "
        "(on CPU forwards are always eager)",
    )
    kernels: Literal[KERNEL_MODES] = engine_field(
        "kernels",
        "the norms, rotary and MLP gate between products: fused by torch.compile, or eager "
        "(auto: compiled under CUDA graphs, eager where compiling fails and on CPU)",
    )
    min_draft_confidence: float = engine_field(
        "min_draft_confidence", "model drafts stop below this top probability", ge=0.0, lt=1.0
    )
    self_layers: str | None = engine_field(
        "self_layers", "layers the self drafter runs, e.g. 0,1,2,20,21 (default: calibrated)"
    )
    medusa_heads: str | None = engine_field(
        "medusa_heads", "Medusa head checkpoint folder (default: the heads shipped for the target)"
    )
    draft_head: str | None = engine_field(
        "draft_head",
        "an EAGLE-3 head for --drafter eagle3: a folder (EAGLE, SpecForge or speculators layout) or hub id",
    )
    stages: str = engine_field(
        "stages", "the staged drafter's chain, cheapest first", shown=",".join(ENGINE_DEFAULTS["stages"])
    )
    draft_kv: Literal[DRAFT_KV] = engine_field(
        "draft_kv",
        "where a draft model's keys and values for accepted tokens come from: its own forward, or the target's "
        "cache (one draft row per step); auto: the target's when the draft is a copy:FORM of it",
    )
    suffix_global: bool = engine_field(
        "suffix_global", "suffix drafter: also match recent outputs of the same API key and user"
    )
    suffix_cache_requests: int = engine_field(
        "suffix_cache_requests", "suffix drafter: recent outputs kept, all tenants", ge=0
    )
    generation_config: Literal["auto", "none"] = Field(
        default="auto",
        description="auto: a request that leaves temperature, top_p, top_k, min_p, repetition_penalty or "
        "(chat) its length unset gets the model's generation config's value, as in vLLM (the embedded "
        "model: temperature 0.1, top_p 0.9, repetition_penalty 1.1, 512 tokens, and a system message asking for short, direct "
        "answers where a chat request sends none); none: OpenAI's defaults (temperature 1, chat to the end of the "
        "context) and the chat template's own system message",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="prompts are logged at debug only"
    )
    log_format: Literal["text", "json"] = Field(default="text", description="json: one JSON object per log line")
    api_key: Annotated[list[str], NoDecode] = production(
        [],
        "require 'Authorization: Bearer KEY' on every API route; KEY or KEY:TENANT, repeat for more tenants "
        "(prefer SPECSERVE_API_KEY or --api-key-file: flags show in ps)",
    )
    api_key_file: str | None = production(None, "a file of KEY or KEY:TENANT lines, one tenant each")
    share_cache: Literal["auto", "on", "off"] = production(
        "auto",
        "whether requests of one tenant (API key, user, cache_salt) share the KV prefix and recent outputs; "
        "auto: on with keys, or without keys on a loopback address; off: no request shares with another",
    )
    max_queue: int = production(64, "generation requests allowed to wait; past it 429", ge=0)
    max_num_seqs: int = engine_field(
        "max_num_seqs",
        "sequences resident at once, each with its own KV caches; requests take turns step by step",
        ge=1,
        le=256,
    )
    prefix_cache_gb: float | None = engine_field(
        "prefix_cache_gb",
        "host memory for the prefix store, which keeps reused slots' prompts for later requests of their scope "
        "(default: an eighth of the available memory, at most 4; 0: none)",
        ge=0,
    )
    prefill_chunk: int = engine_field(
        "prefill_chunk", "while other requests wait, a long prompt is read this many tokens per turn", ge=1
    )
    request_timeout: float | None = production(600.0, "seconds per request, waiting included", gt=0)
    max_request_bytes: int = production(4 * 2**20, "largest request body accepted", ge=1024)
    cors_allow_origins: str | None = production(None, "comma-separated origins allowed by CORS (default: CORS off)")
    shutdown_timeout: float = production(10.0, "on SIGTERM, seconds to let requests finish", ge=0)

    @model_validator(mode="before")
    @classmethod
    def _empty_means_default(cls, values: Any) -> Any:
        """An empty value means the setting's default, from every source alike: compose passes
        ``SPECSERVE_TARGET=`` as an empty string where .env leaves it blank, and that is the
        embedded model, as no target at all is."""
        if isinstance(values, dict):
            return {name: value for name, value in values.items() if not (isinstance(value, str) and not value.strip())}
        return values

    @field_validator("api_key", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        """SPECSERVE_API_KEY, or a preset's ``api-key``, may hold one key."""
        return [value] if isinstance(value, str) else value

    @property
    def cors_origins(self) -> list[str]:
        return [origin.strip() for origin in (self.cors_allow_origins or "").split(",") if origin.strip()]

    @property
    def resolved_draft(self) -> str | None:
        """'auto': the embedded model's default draft, whatever the start-up drafter, so that requests
        may still ask for the drafters that use it; other targets have no default draft."""
        if self.draft is None or self.draft.lower() == "none":
            return None
        if self.draft == "auto":
            return DEFAULT_DRAFT if self.target is None else None
        return self.draft

    def engine_config(self, shares: bool = True) -> EngineConfig:
        """The engine's configuration: every field the two share, in the engine's form. ``shares``:
        whether requests share any scope (``Tenancy.share``); where none does, no prefix is stored."""
        shared = {name: getattr(self, name) for name in type(self).model_fields if name in ENGINE_DEFAULTS}
        if not shares:
            shared["prefix_cache_gb"] = 0.0
        shared.update(
            draft=self.resolved_draft,
            self_layers=_int_list(self.self_layers, "self_layers"),
            stages=tuple(name.strip() for name in self.stages.split(",") if name.strip()),
            forward="eager" if self.enforce_eager else ENGINE_DEFAULTS["forward"],
            kernels="eager" if self.enforce_eager else self.kernels,
        )
        return EngineConfig(**shared)

    @classmethod
    def load(cls, config_file: str | None, overrides: dict) -> ServeSettings:
        values: dict = {}
        if config_file is not None:
            path = Path(config_file)
            if not path.is_file():
                raise ConfigError(f"config file not found: {config_file}")
            loaded = yaml.safe_load(path.read_text()) or {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"{config_file}: expected a mapping of setting names to values")
            values = {key.replace("-", "_"): value for key, value in loaded.items()}
        values.update(overrides)
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"invalid settings: {problems}") from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli_fields() -> dict[str, FieldInfo]:
    """The settings that are also flags: all but the preset-only ones."""
    return {name: info for name, info in ServeSettings.model_fields.items() if _extra(info).get("cli", True)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting. An absent flag sets nothing (the preset, environment or default
    stands); its help names the default."""
    groups: dict[str | None, argparse._ActionsContainer] = {None: parser}
    for name, info in cli_fields().items():
        group = _extra(info).get("group")
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        kind, choices = _kind(info.annotation)
        default = info.default
        shown = ("on" if default else "off") if kind is bool else (default or None) if kind is list else default
        help_text = info.description or name
        if "(default" not in help_text:  # where it does not say what its default means
            help_text += f" (default {shown if shown is not None else 'none'})"
        options: dict[str, Any] = {"help": help_text, "default": argparse.SUPPRESS}
        if kind is bool:  # --adaptive-k alone turns it on; --suffix-global off turns it off
            options.update(nargs="?", const=True, type=_on_off, metavar="on|off")
        elif kind is list:  # repeated: --api-key A --api-key B
            options.update(action="append", type=str)
        else:
            options.update(type=kind, choices=choices)
        groups[group].add_argument(flag(name), **options)


def _extra(info: FieldInfo) -> dict:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def _kind(annotation: Any) -> tuple[type, tuple | None]:
    """(the type a flag's text converts to, its choices) for a field's annotation."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _kind(args[0])
    if typing.get_origin(annotation) is list:
        return list, None
    if typing.get_origin(annotation) is Literal:
        return str, tuple(args)
    return annotation, None


def _on_off(text: str) -> bool:
    words = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return words[text.lower()]
