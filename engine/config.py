"""Engine configuration: what to load and how to speculate. Importing it loads no torch (the CLI
reads it to refuse a bad setting or a busy port in a moment); the properties that need torch import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

FORWARD_MODES = ("auto", "eager", "cuda-graphs", "compile")
KERNEL_MODES = ("auto", "eager", "compiled")  # the pointwise work between products (engine/model/kernels.py)
# CPU matmul plans (engine/cpu/plan_cache.py): read the one stored for this host and model where one matches
# (else measure and store it), or measure again and replace it
PLAN_MODES = ("cached", "measure")
# What a GGUF target's Q4_0, Q4_1 and Q8_0 block products multiply: float32 activations (exact to the file's
# float32 model), or activations quantized to int8 per block of 32, as llama.cpp does (engine/cpu/csrc/blocks_int8.cpp);
# "auto": int8 where start-up measures its products faster here, else float32 (and float32 for other targets)
ACTIVATIONS = ("auto", "float32", "int8")
NO_DRAFTER = "none"  # as a drafter's name: the target alone (a request's, or the engine's default)
DRAFT_KV = ("auto", "own", "target")
COPY_PREFIX = "copy:"  # draft ref "copy:bfloat16" = the target's weights in another dtype
DTYPES = ("float32", "bfloat16", "float16")  # by torch's names (torch_dtype_of)
# "copy:int8": the target's weights as int8 rows with a scale each, bfloat16 activations (CPU);
# "copy:auto": bfloat16 or int8, whichever start-up measures faster here (engine/measure.py)
COPY_INT8 = "int8"
COPY_AUTO = "auto"
COPY_FORMS = (*DTYPES, COPY_INT8, COPY_AUTO)


@dataclass(slots=True)
class EngineConfig:
    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    draft: str | None = None  # a model ref, "copy:DTYPE" (the target in another dtype), or None for target alone
    drafter: str = "auto"  # the default for requests that name none; NO_DRAFTER: the target alone
    num_draft_tokens: int = 4
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own limit, capped at 4096
    seed: int | None = None
    threads: int | None = None  # CPU intra-op threads; None: the CPUs this process may use (engine/cpu/threads.py)
    adaptive_k: bool = False  # choose k per step (up to num_draft_tokens) from measured costs
    min_draft_confidence: float = 0.0  # model drafts stop when their top probability falls below this
    ngram_sizes: tuple[int, int] = (1, 4)  # n-gram lookup tries the longest n first
    self_layers: tuple[int, ...] | None = None  # layers the self drafter runs; None: calibrated or measured best
    medusa_heads: str | None = None  # a Medusa head checkpoint folder; None: the one shipped for the target
    draft_head: str | None = None  # an EAGLE-3 head (folder or hub id) for the eagle3 drafter
    stages: tuple[str, ...] = ("ngram", "model")  # the staged drafter's chain, cheapest first
    suffix_global: bool = True  # the suffix drafter also matches recent outputs of the same tenant
    suffix_cache_requests: int = 64  # how many recent outputs it keeps, across tenants; the oldest go first
    # Where a draft model's keys and values for committed tokens come from: "own" (it reads every
    # token itself), "target" (copied from the target's cache, cast to the draft's dtype: the draft
    # reads one token per step), "auto" ("target" when the draft is a copy of the target).
    draft_kv: str = "auto"
    # How decode-shaped forwards run (engine/model/runner.py): "auto" is CUDA graphs on a GPU and eager on
    # CPU; "eager" (--enforce-eager) never records; "compile" is torch.compile, for proving on CPU.
    forward: str = "auto"
    # The norms, residuals, rotary and MLP gate between products: "compiled" fuses them with
    # torch.compile; "auto" compiles them where forwards are captured as CUDA graphs and falls back
    # to eager kernels, with a warning, where compiling fails; "eager" never compiles them.
    kernels: str = "auto"
    # A GGUF target on CPU may hold its products as the file's own quantized blocks, multiplied in
    # float32 by engine/cpu/csrc's kernels, where the matmul plan measures them faster (engine/cpu/blocks.py)
    gguf_blocks: bool = True
    # one of ACTIVATIONS; "int8" needs gguf_blocks. "auto": int8 where start-up measures it faster (a GGUF
    # target on CPU with the kernels built), else float32 (docs/internals.md#int8-activations)
    activations: str = "auto"
    # CPU matmul plans (engine/cpu/plan_cache.py): "cached" reads the plan stored for this host and model
    # where there is one (else measures and stores it), "measure" measures and replaces it;
    # plan_cache is the folder (None: $XDG_CACHE_HOME/specserve/matmul-plans, ~/.cache/... where unset)
    matmul_plan: str = "cached"
    plan_cache: str | None = None
    compile_backend: str = "inductor"  # torch.compile's backend for compiled forwards and kernels (tests: aot_eager)
    # Sequences resident at once (engine/model/slots.py): each slot has its own KV caches, allocated on first use
    max_num_seqs: int = 4
    # The host-memory prefix store's bound (engine/model/prefix_store.py); None: an eighth of the memory
    # available at start-up, at most 4 GiB; 0: no store
    prefix_cache_gb: float | None = None
    prefill_chunk: int = 128  # while other requests wait, a prompt is read this many tokens per turn

    def __post_init__(self) -> None:
        if not 1 <= self.max_num_seqs <= 256:
            raise ConfigError(f"max_num_seqs must be between 1 and 256, got {self.max_num_seqs}")
        if self.prefix_cache_gb is not None and self.prefix_cache_gb < 0:
            raise ConfigError(f"prefix_cache_gb must be at least 0, got {self.prefix_cache_gb}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be at least 1, got {self.prefill_chunk}")
        if self.suffix_cache_requests < 0:
            raise ConfigError(f"suffix_cache_requests must be at least 0, got {self.suffix_cache_requests}")
        if self.matmul_plan not in PLAN_MODES:
            raise ConfigError(f"matmul_plan must be one of {', '.join(PLAN_MODES)}, got {self.matmul_plan!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be at least 1, got {self.threads}")
        if self.num_draft_tokens < 0 or self.num_draft_tokens > 64:
            raise ConfigError(f"num_draft_tokens must be between 0 and 64, got {self.num_draft_tokens}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not 0.0 <= self.min_draft_confidence < 1.0:
            raise ConfigError(f"min_draft_confidence must be in [0, 1), got {self.min_draft_confidence}")
        low, high = self.ngram_sizes
        if not 1 <= low <= high:
            raise ConfigError(f"ngram sizes must satisfy 1 <= min <= max, got {self.ngram_sizes}")
        if self.draft is not None and self.draft.lower() == "none":
            self.draft = None
        if self.draft_copy is not None and self.draft_copy not in COPY_FORMS:
            raise ConfigError(
                f"draft {self.draft!r}: a copy of the target is one of {', '.join(COPY_PREFIX + form for form in COPY_FORMS)}"
            )
        if self.draft_kv not in DRAFT_KV:
            raise ConfigError(f"draft_kv must be one of {', '.join(DRAFT_KV)}, got {self.draft_kv!r}")
        if self.forward not in FORWARD_MODES:
            raise ConfigError(f"forward must be one of {', '.join(FORWARD_MODES)}, got {self.forward!r}")
        if self.kernels not in KERNEL_MODES:
            raise ConfigError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")
        if self.activations not in ACTIVATIONS:
            raise ConfigError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}")
        if self.activations == "int8" and not self.gguf_blocks:
            raise ConfigError("activations int8 multiplies a GGUF target's own blocks, so it needs gguf_blocks")

    @property
    def prefix_cache_bytes(self) -> int:
        if self.prefix_cache_gb is not None:
            return int(self.prefix_cache_gb * 2**30)
        return min(4 * 2**30, available_memory() // 8)

    @property
    def draft_copy(self) -> str | None:
        """What a ``copy:FORM`` draft is made of ("bfloat16", "int8", ...); None for other drafts."""
        if self.draft is None or not self.draft.startswith(COPY_PREFIX):
            return None
        return self.draft[len(COPY_PREFIX) :]

    @property
    def drafts_with_model(self) -> str:
        """What the start-up drafter does with a draft model: "needs" one ("model", a staged chain
        with a model stage), "may" use one ("auto", where its measured cost pays) or "never" does
        (the rest: copy:auto then reads no copy)."""
        if self.drafter == "model" or (self.drafter == "staged" and "model" in self.stages):
            return "needs"
        return "may" if self.drafter == "auto" else "never"

    @property
    def draft_reads_target_kv(self) -> bool:
        if self.draft_kv == "auto":
            return self.draft_copy is not None
        return self.draft_kv == "target"

    @property
    def forward_mode(self) -> str:
        """What "auto" means on this device: "cuda-graphs" on CUDA, else "eager"."""
        if self.forward == "auto":
            return "cuda-graphs" if self.torch_device.type == "cuda" else "eager"
        return self.forward

    @property
    def kernel_mode(self) -> str:
        """What "auto" means here: "compiled" under CUDA graphs (inside a captured graph a compiled
        call costs only its fused kernels), else "eager" (on CPU the calls cost more than they fuse,
        and a compiled forward fuses them itself)."""
        if self.kernels == "auto":
            return "compiled" if self.forward_mode == "cuda-graphs" else "eager"
        return self.kernels

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch_dtype_of("bfloat16" if self.torch_device.type == "cuda" else "float32")
        return torch_dtype_of(self.dtype)


def available_memory() -> int:
    """Bytes of memory the machine has available now (MemAvailable), else its physical memory."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def torch_dtype_of(name: str) -> torch.dtype:
    """torch's dtype of one of DTYPES' names."""
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """How logs and descriptions name a dtype: "float32" for torch.float32."""
    return str(dtype).removeprefix("torch.")


def _help(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class Eagle3Training:
    """How ``specserve train-eagle3`` trains a head (engine/training/eagle3.py)."""

    draft_vocab: int = _help(4096, "the head's vocabulary: the target tokens its answers use most")
    ttt_steps: int = _help(4, "draft steps the head is unrolled over in training (training-time test)")
    # 12, not 3: on the embedded target's 152k answer tokens, 912 steps against 228 lifted held-out
    # top-1 from 0.35 to 0.46 (docs/drafters.md); a few hundred steps leave the head underfit
    epochs: float = _help(12.0, "passes over the regenerated answers")
    lr: float = _help(1e-3, "peak learning rate (AdamW, warm-up then cosine)")
    batch_tokens: int = _help(4096, "positions per optimiser step")
    window: int = _help(512, "positions of one conversation the head sees at once")
    max_new_tokens: int = _help(320, "the longest answer the target writes per turn")
    generate_batch: int = _help(32, "conversations the target answers together")
    samples: int = _help(1, "answers per prompt: the first greedy, the others sampled at --temperature")
    own_prompts: int = _help(0, "more prompts the target writes itself, sampled from its chat template's user turn")
    temperature: float = _help(0.8, "the temperature of the sampled answers")
    limit: int | None = _help(None, "only the first N prompts of the set")
    seed: int = _help(0, "seeds initialisation and batch order")
    # int8: the features and distributions of the target `--activations int8` serves (a GGUF target on
    # CPU), whose products round the activations as llama.cpp does; a head trained on float32
    # features drafts that target a little worse (docs/drafters.md#eagle-3-heads)
    activations: str = _help("float32", "the target whose features the head learns: float32 or int8 activations")
    start_from: str | None = _help(None, "a head folder to continue from: its weights and draft vocabulary")

    def __post_init__(self) -> None:
        for name in (
            "draft_vocab",
            "ttt_steps",
            "batch_tokens",
            "window",
            "max_new_tokens",
            "generate_batch",
            "samples",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.epochs <= 0 or self.lr <= 0 or self.temperature <= 0:
            raise ConfigError(
                f"epochs, lr and temperature must be positive, got {self.epochs}, {self.lr} and {self.temperature}"
            )
        if self.own_prompts < 0:
            raise ConfigError(f"own_prompts must be at least 0, got {self.own_prompts}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be at least 1, got {self.limit}")
        if self.activations not in ("float32", "int8"):
            raise ConfigError(f"activations must be float32 or int8, got {self.activations!r}")
