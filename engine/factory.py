"""From an ``EngineConfig`` to a running engine: load, wrap, size the caches once, warm up."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import PreTrainedTokenizerBase

from .config import COPY_AUTO, COPY_INT8, COPY_PREFIX, EngineConfig, available_memory
from .cpu.blocks import FileTensors, offer_blocks
from .cpu.int8_blocks import auto_activations, held_activations, int8_activations
from .cpu.memory import release_freed_memory, return_free_pages
from .cpu.plan_cache import PlanCache
from .cpu.threads import set_threads, usable_cpus
from .drafters import check_stages
from .engine import SpecEngine
from .errors import ConfigError
from .measure import choose_copy
from .model.fingerprint import arithmetic, system_fingerprint, weight_files
from .model.loader import CopySource, copy_of_first_layers, eos_token_ids, load
from .model.model import CausalLM
from .model.runner import GraphRunner

log = logging.getLogger(__name__)

STAGES = ("tokenizer", "target", "draft", "caches", "warm-up")


@dataclass(frozen=True, slots=True)
class WarmUp:
    forward: str  # eager, cuda-graphs or compile
    variants: int  # captured graphs
    seconds: float
    graph_bytes: int  # device memory the captures reserved
    matmuls: str = ""  # eager CPU: what the MatmulPlans chose (measured, stored or uniform), per model
    kernels: str = ""  # how the pointwise kernels run, where they were compiled (or failed to be)
    attention: str = ""  # the windows whose attention runs split (runner.choose_attention), per model
    drafters: str = ""  # what drafters decided from their start-up timings (``Drafter.warm_up``)

    def describe(self) -> str:
        kernels = "".join(f"; {part}" for part in (self.kernels, self.attention, self.drafters) if part)
        if self.forward == "cuda-graphs":
            captured = f"{self.variants} captured in {self.seconds:.1f} s, {self.graph_bytes / 2**20:,.0f} MiB"
            return f"CUDA graphs: {captured}{kernels}"
        if self.forward == "compile":
            return f"torch.compile: {self.variants} variants compiled in {self.seconds:.1f} s{kernels}"
        chosen = f" (matmuls: {self.matmuls})" if self.matmuls else ""
        return f"forward {self.forward}{chosen}, warmed up in {self.seconds:.1f} s{kernels}"


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

        models = load(config, progress, direct=True)
        tokenizer, name = models.tokenizer, models.target_name
        eos = eos_token_ids(models.target, models.tokenizer)
        engine = build_engine(
            config, models.target, models.draft, eos, len(models.tokenizer), models.target_file, models.target_blocks
        )
        progress(f"KV caches {engine.cache_bytes / 2**20:,.0f} MB")
        progress(warm_up(engine).describe())
        bits = arithmetic(engine.target, engine.config.activations, config.forward_mode)
        engine.system_fingerprint = system_fingerprint(bits, weight_files(models.target_folder, models.target_file))
    del models  # the draft copy that copy:auto did not keep, among what start-up no longer needs
    release_freed_memory()
    return LoadedEngine(engine, tokenizer, name)


def build_engine(
    config: EngineConfig,
    target_model: torch.nn.Module,
    draft_model: torch.nn.Module | CopySource | None,
    eos_token_ids: set[int],
    tokenizer_size: int | None = None,
    target_file: Path | None = None,
    target_blocks: FileTensors | None = None,
) -> SpecEngine:
    """Wrap loaded Hugging Face models: caches are sized once, here, and reused for every request.
    The engine owns them from now on: on CPU its warm-up may hold their weights in another form and
    free the modules' own (``ProductWeights.use_plan``), so they are not for calling elsewhere after."""
    limit = getattr(target_model.config, "max_position_embeddings", 4096)
    max_len = config.max_model_len or min(limit, 4096)
    target = CausalLM(target_model, max_len)
    if config.activations == "int8" and (target_file is None or target.device.type != "cpu"):
        raise ConfigError(
            "activations int8 multiplies a GGUF target's own quantized blocks, on CPU: this target is not one"
        )
    if target_file is not None and config.gguf_blocks and target.device.type == "cpu":
        release_freed_memory()  # the weights fusing replaced, before the file is read
        repack = {"int8": int8_activations, "auto": auto_activations}.get(config.activations)
        offer_blocks(target, target_blocks or FileTensors.read(target_file), repack)
    config = replace(config, activations=held_activations(target))  # "auto" decided
    release_freed_memory()
    target.use_kernels(config.kernel_mode, config.compile_backend)  # before copy:auto times it
    draft, measured_agreement = None, None
    if draft_model is None:
        config = replace(config, draft=None)  # copy:auto read none (load_draft)
    elif config.draft_copy == COPY_AUTO:  # measured here: bfloat16 or int8 rows
        read = copy_reader(draft_model, target.device)
        cache = PlanCache.configured(config.matmul_plan, config.plan_cache)
        draft, form, measured_agreement = choose_copy(
            target,
            lambda layers=None: CausalLM(read(layers), max_len),
            config.num_draft_tokens,
            cache,
            config.drafts_with_model == "may",
        )
        config = replace(config, draft=None if draft is None else COPY_PREFIX + form)
        del draft_model, read  # a model copied from: the copy kept (or none) is what the engine holds
        release_freed_memory()
    else:
        draft = CausalLM(draft_model, max_len)
        if config.draft_copy == COPY_INT8:
            draft.weights.quantize_int8()
    if draft is not None:
        draft.use_kernels(config.kernel_mode, config.compile_backend)
    mode = config.forward_mode
    if mode != "eager":  # decode-shaped forwards: up to k drafts, a pending token, and a bonus row
        for model in filter(None, (target, draft)):
            model.runner = GraphRunner(model, mode, config.num_draft_tokens + 2, config.compile_backend)
    check_stages(config.stages)  # the configured chain, whether or not the default drafter runs it
    engine = SpecEngine(config, target, draft, eos_token_ids, tokenizer_size, measured_agreement)
    check_memory(engine)
    return engine


def copy_reader(draft_model: torch.nn.Module | CopySource, device: torch.device) -> Callable[..., torch.nn.Module]:
    """How copy:auto reads a bfloat16 copy of the target each time it times or keeps one (given a
    number of layers: only the first so many, to estimate a step): from the target's file; else,
    from the copy loaded, a deep copy of it on CPU (where one copy is timed, let go, and another
    made) or that copy itself elsewhere (where one is taken, untimed)."""
    if isinstance(draft_model, CopySource):
        return draft_model.read
    return partial(copy_of_first_layers, draft_model) if device.type == "cpu" else lambda layers=None: draft_model


def check_memory(engine: SpecEngine) -> None:
    """Refuse, in one line, slots and a prefix store that cannot fit: the slots' KV caches beyond the
    first in the device's free memory, and those plus the store in the host's (on CPU, one memory)."""
    config, slot = engine.config, engine.cache_bytes
    more_slots = (config.max_num_seqs - 1) * slot
    store = engine.store.capacity
    device = engine.target.device
    host_need = store + (more_slots if device.type == "cpu" else 0)
    free = {"host": (host_need, available_memory())}
    if device.type == "cuda":
        free["GPU"] = (more_slots, torch.cuda.mem_get_info(device)[0])
    for where, (need, have) in free.items():
        if need > have:
            raise ConfigError(
                f"{config.max_num_seqs} sequence slots ({slot / 2**20:,.0f} MB of KV caches each) and a "
                f"{store / 2**30:.1f} GB prefix store need {need / 2**30:.1f} GB more {where} memory than the "
                f"{have / 2**30:.1f} GB available; lower --max-num-seqs, --max-model-len or --prefix-cache-gb"
            )


def warm_up(engine: SpecEngine) -> WarmUp:
    """Run every decode shape before the first request. CUDA graphs are captured here; eager
    kernels pay their first-call costs here instead of in the first request, whose step costs
    the auto drafter learns from. Compiled forwards (the CPU proof) compile here, every variant
    once. Then each drafter prepares what it needs (``Drafter.warm_up``)."""
    config = engine.config
    started = time.perf_counter()
    device = engine.target.device
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    kernels = compile_kernels(engine, required=config.kernels == "compiled")  # before any capture
    max_query = config.num_draft_tokens + 2
    plan_cache = PlanCache.configured(config.matmul_plan, config.plan_cache)
    variants = 0
    matmuls, attention = [], []
    release_freed_memory()  # what building the drafters let go, before the warm-up's own temporaries
    for model in engine.models:
        role = "target" if model is engine.target else "draft"
        layer_sets = [model.all_layers]
        if model is engine.target:
            layer_sets += engine.drafters.target_layer_sets()
        if model.runner is None:
            if model.device.type == "cpu":
                model.weights.plan_matmuls(min(max_query, model.max_len), plan_cache)
                matmuls.append(f"{role} {model.weights.describe()}")
            for num_tokens in range(1, min(max_query, model.max_len) + 1):
                model.cache.rollback(0)
                model.extend([0] * num_tokens, num_logits=num_tokens)
        else:
            try:
                model.runner.warm_up(layer_sets)
            except Exception as error:  # whatever capturing or compiling raised: say what to turn off
                hint = "--kernels eager, or --enforce-eager" if model.kernels.mode == "compiled" else "--enforce-eager"
                raise ConfigError(
                    f"preparing the {config.forward_mode} forwards failed ({root_cause(error)}); try {hint}"
                ) from error
            variants += model.runner.num_variants
            split = model.runner.describe_attention()
            if split:
                attention.append(f"{role} {split}")
        model.cache.rollback(0)
    decided = []
    for drafter in engine.drafters.built.values():
        return_free_pages()  # each stage's temporaries freed before the next one's stack on them
        decided.append(drafter.warm_up())
    graph_bytes = torch.cuda.memory_reserved(device) - reserved if device.type == "cuda" else 0
    seconds = time.perf_counter() - started
    engine.compiled = engine.compilations
    chosen = ("; ".join(matmuls), kernels, "; ".join(attention), "; ".join(filter(None, decided)))
    report = WarmUp(config.forward_mode, variants, seconds, graph_bytes, *chosen)
    engine.warm_up_report = report.describe()
    return report


def compile_kernels(engine: SpecEngine, required: bool) -> str:
    """Compile each model's pointwise kernels, where they are compiled, and say how it went.
    Where compiling fails (no C compiler for inductor's code, say), every model runs eager
    kernels instead, unless ``required``: then the failure is a ConfigError."""
    compiled = [model for model in engine.models if model.kernels.mode == "compiled"]
    if not compiled:
        return ""
    started = time.perf_counter()
    try:
        for model in compiled:
            model.warm_up_kernels()
    except Exception as error:  # whatever torch.compile or its backend raised
        reason = root_cause(error)
        if required:
            raise ConfigError(f"compiling the pointwise kernels failed ({reason}); use --kernels eager") from error
        for model in compiled:
            model.use_kernels("eager")
        log.warning("compiling the pointwise kernels failed (%s); they run eagerly (slower on a GPU)", reason)
        return f"pointwise kernels eager: compiling them failed ({reason})"
    count = sum(sum(model.kernels.compilations.values()) for model in compiled)
    return f"pointwise kernels compiled: {count} compilations in {time.perf_counter() - started:.1f} s"


def root_cause(error: BaseException) -> str:
    """The innermost error under dynamo's wrapping, as "Type: first line of its message"."""
    while getattr(error, "inner_exception", None) or error.__cause__:
        error = getattr(error, "inner_exception", None) or error.__cause__
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
