"""Server settings: defaults < SPECSERVE_* environment < YAML preset (--config) < command-line flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import ConfigError, EngineConfig

DEFAULT_DRAFT = "copy:auto"  # a copy of the target, bfloat16 or int8 rows, whichever measures faster here


def _int_list(text: str | None, name: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated integers, got {text!r}") from None


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_", extra="forbid")

    target: str | None = Field(default=None, description="model folder, hub id or .gguf file; none: embedded SmolLM2")
    draft: str | None = Field(default="auto", description="draft model ref, copy:FORM, none, or auto")
    drafter: str = "auto"
    num_draft_tokens: int = Field(default=4, ge=0, le=64)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(default=None, ge=2)
    served_model_name: str | None = None
    seed: int | None = None
    threads: int | None = Field(default=None, ge=1, description="CPU threads; none: the CPUs this process may use")
    needs: str | None = Field(default=None, description="what a preset needs to run, said when it cannot start")
    adaptive_k: bool = False
    enforce_eager: bool = Field(
        default=False, description="never capture CUDA graphs or compile kernels; every forward runs eagerly"
    )
    kernels: Literal["auto", "eager", "compiled"] = Field(
        default="auto",
        description="the pointwise kernels between products: compiled (auto: under CUDA graphs) or eager",
    )
    min_draft_confidence: float = Field(default=0.0, ge=0.0, lt=1.0)
    self_layers: str | None = Field(default=None, description="comma-separated layer indices for --drafter self")
    medusa_heads: str | None = None
    stages: str = "ngram,model"
    draft_kv: Literal["auto", "own", "target"] = Field(
        default="auto", description="a draft model's keys and values: its own, or the target's (auto: for copies)"
    )
    suffix_global: bool = Field(
        default=True, description="suffix drafter: also match recent outputs of the same tenant"
    )
    suffix_cache_requests: int = Field(default=64, ge=0, description="suffix drafter: recent outputs kept, all tenants")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    # production
    api_key: str | None = Field(default=None, description="require 'Authorization: Bearer KEY' on the API routes")
    max_queue: int = Field(default=64, ge=0, description="generation requests allowed to wait; more get 429")
    request_timeout: float | None = Field(default=600.0, gt=0, description="seconds a request may take, queue included")
    max_request_bytes: int = Field(default=4 * 2**20, ge=1024, description="largest accepted request body")
    cors_allow_origins: str | None = Field(default=None, description="comma-separated origins; none: CORS off")
    shutdown_timeout: float = Field(default=10.0, ge=0, description="grace period for in-flight requests on SIGTERM")
    fault_injection: bool = False  # test hook, from SPECSERVE_FAULT_INJECTION=1 only; never for production

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

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            target=self.target,
            draft=self.resolved_draft,
            drafter=self.drafter,
            num_draft_tokens=self.num_draft_tokens,
            device=self.device,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            threads=self.threads,
            adaptive_k=self.adaptive_k,
            min_draft_confidence=self.min_draft_confidence,
            self_layers=_int_list(self.self_layers, "self_layers"),
            medusa_heads=self.medusa_heads,
            stages=tuple(name.strip() for name in self.stages.split(",") if name.strip()),
            suffix_global=self.suffix_global,
            draft_kv=self.draft_kv,
            suffix_cache_requests=self.suffix_cache_requests,
            fault_injection=self.fault_injection,
            forward="eager" if self.enforce_eager else "auto",
            kernels="eager" if self.enforce_eager else self.kernels,
        )

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
