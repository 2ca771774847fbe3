"""Decode-shaped forwards, compiled or captured once per shape and then replayed.

A decode-shaped forward feeds at most ``max_query`` tokens: a draft step (1), the target's verify
(k + 1), a draft catching up after a fully accepted run, the self drafter's partial pass. Each
launches about 24 kernels per layer eagerly (about 11 with ``engine/model/kernels.py``'s compiled
pointwise kernels); on a GPU, dispatching them one by one costs more than the kernels themselves,
so these forwards are recorded once and replayed. Prefill is long and rare and stays eager.

A variant is one (query length, window, layer set). Attention reads the first ``window`` cache
positions under a causal mask (``CausalLM.static_forward``), the window being the smallest of a few
sizes (powers of two from 256, and the cache length) that holds the last query position: reads stay
within twice the live context however large ``--max-model-len`` is, at one variant per size.

Attention over a long window (``SPLIT_MIN`` positions or more) may run as ``split_attention``
instead of one SDPA call: at one decode query, a fused attention kernel parallelises over KV heads
and query rows only, so it leaves most of a GPU idle over a long window (docs/gpu.md). On CUDA, warm-up times one layer's attention both ways for each
long window and keeps the faster (``attention``: window -> chunks, 0 for SDPA), so it can only help.

Two ways to run the variants (``EngineConfig.forward``):
- ``cuda-graphs``: each variant is a ``torch.cuda.CUDAGraph`` over static input buffers, all
  captured at start-up into one memory pool; a step copies its token ids and positions in, replays,
  and copies the outputs out before another graph can reuse the pool.
- ``compile``: ``torch.compile(fullgraph=True, dynamic=False)`` per variant. Each variant compiles
  its own copy of the step function (its own code object): dynamo keeps compiled code and its
  recompile limit per code object, so models and query lengths sharing one would evict each other
  and stall at the limit. A recompile then shows as a second compilation of one variant
  (``compilations``). On CPU this proves the static forward traces without graph breaks; compiled
  float32 measured slower than eager there, so CPU serving stays eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .attention import attention_chunks, split_attention
from .kernels import counted_backend, fresh
from .timing import median_seconds

log = logging.getLogger(__name__)

MIN_WINDOW = 256
SPLIT_MIN = 4096  # windows from this long may attend by split_attention, where warm-up measures it faster
MODES = ("cuda-graphs", "compile")

Key = tuple[int, int, tuple[int, ...]]  # (query length, window, layers)


def windows(max_len: int) -> list[int]:
    """The attention windows for a cache of ``max_len``: 256, 512, ... and ``max_len`` itself."""
    sizes, size = [], MIN_WINDOW
    while size < max_len:
        sizes.append(size)
        size *= 2
    return [*sizes, max_len]


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [T] static input buffer
    positions: torch.Tensor  # [T] static input buffer
    hidden: torch.Tensor  # [T, E] static output
    logits: torch.Tensor  # [T, V] static output


class GraphRunner:
    """Runs one model's decode-shaped forwards as compiled or captured variants."""

    def __init__(self, model, mode: str, max_query: int, backend: str = "inductor") -> None:
        if mode not in MODES:
            raise ConfigError(f"forward mode must be one of {MODES}, got {mode!r}")
        if mode == "cuda-graphs" and model.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device; the model is on {model.device}")
        if model.kernels.native:  # the compiler fuses the pointwise work itself; engine/cpu/csrc's ops are opaque to it
            model.use_kernels(model.kernels.mode, backend, native=False)
        self.model = model
        self.mode = mode
        self.max_query = max_query
        self.windows = windows(model.max_len)
        self.backend = backend
        self.compilations: dict[Key, int] = {}  # compile mode: how often each variant compiled
        self.seconds = 0.0  # spent compiling or capturing
        self._variants: dict[Key, Callable | _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda-graphs" else None
        self.attention: dict[int, int] = {}  # window -> split_attention's chunks; absent or 0: one SDPA call
        self.attention_ms: dict[int, tuple[float, float]] = {}  # window -> measured (SDPA, split) ms

    def forget(self) -> None:
        """Drop every variant: what the model's forward does changed (``CausalLM.keep_features``)."""
        self._variants.clear()

    def handles(self, num_tokens: int) -> bool:
        """Decode-shaped: few enough new tokens to have a variant (prefill stays eager)."""
        return num_tokens <= self.max_query

    def window(self, end: int) -> int:
        return next(size for size in self.windows if size >= end)

    @property
    def num_variants(self) -> int:
        return len(self._variants)

    def run(self, input_ids: torch.Tensor, start: int, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] at positions [start, start+T) -> (normalised hidden [T, E], logits [T, V])."""
        num_tokens = input_ids.shape[0]
        key = (num_tokens, self.window(start + num_tokens), layers)
        positions = self.model.positions[start : start + num_tokens]  # [T]
        variant = self._variants.get(key)
        if variant is None:
            variant = self._prepare(key, input_ids, positions)
        if self.mode == "compile":  # fresh inputs: views of other tensors would be guarded apart
            return variant(input_ids.clone(), positions.clone())
        variant.input_ids.copy_(input_ids)
        variant.positions.copy_(positions)
        variant.graph.replay()
        # every graph shares one pool: copy out before another replay can reuse this memory
        return variant.hidden.clone(), variant.logits.clone()

    def choose_attention(self, repeats: int = 10) -> None:
        """For each long window, time one layer's attention at a decode query as one SDPA call and
        as ``split_attention``, and keep the faster for every variant of that window."""
        for window in self.windows:
            if window >= SPLIT_MIN and window not in self.attention:
                try:
                    fused, split = measure_attention(self.model, window, repeats)
                except Exception as error:  # an optimisation that cannot run here: one SDPA call, as without it
                    log.warning("split attention failed at window %d (%s); attention stays one call", window, error)
                    self.attention[window] = 0
                    continue
                self.attention_ms[window] = (round(fused * 1e3, 3), round(split * 1e3, 3))
                self.attention[window] = attention_chunks(window) if split < fused else 0

    def describe_attention(self) -> str:
        split = [window for window, chunks in sorted(self.attention.items()) if chunks]
        return f"split attention at windows {', '.join(map(str, split))}" if split else ""

    @torch.inference_mode()  # as serving calls run: a compiled variant is guarded on the grad mode
    def warm_up(self, layer_sets: Iterable[tuple[int, ...]]) -> None:
        """Capture (or compile) every variant serving can ask for, so none is made while serving. It
        writes scratch keys and values at the first positions of the cache: call it before any
        request, then roll the cache back. On CUDA it first chooses each long window's attention."""
        if self.mode == "cuda-graphs":
            self.choose_attention()
        for layers in layer_sets:
            for num_tokens in range(1, self.max_query + 1):
                for window in self.windows:
                    key = (num_tokens, window, layers)
                    if num_tokens <= window and key not in self._variants:
                        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.model.device)
                        positions = self.model.positions[:num_tokens]
                        variant = self._prepare(key, input_ids, positions)
                        if self.mode == "compile":  # compiling happens on the first call
                            started = time.perf_counter()
                            variant(input_ids.clone(), positions.clone())
                            self.seconds += time.perf_counter() - started

    def _prepare(self, key: Key, input_ids: torch.Tensor, positions: torch.Tensor):
        started = time.perf_counter()
        variant = self._compile(key) if self.mode == "compile" else self._capture(key, input_ids, positions)
        self._variants[key] = variant
        self.seconds += time.perf_counter() - started
        return variant

    def _compile(self, key: Key) -> Callable:
        _, window, layers = key
        model, chunks = self.model, self.attention.get(window, 0)

        def step(input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return model.static_forward(input_ids, positions, window, layers, chunks)

        # a fresh code object per variant: its own dynamo cache, so one compilation each
        backend = counted_backend(self.backend, self.compilations, key)
        return torch.compile(fresh(step), backend=backend, fullgraph=True, dynamic=False)

    def _capture(self, key: Key, input_ids: torch.Tensor, positions: torch.Tensor) -> _Captured:
        """Run the variant once for real (which also makes this call's keys and values right), then
        record it. Recording executes nothing, so the cache keeps what the real run wrote."""
        _, window, layers = key
        chunks = self.attention.get(window, 0)
        static_ids, static_positions = input_ids.clone(), positions.clone()  # [T], [T]
        side = torch.cuda.Stream(self.model.device)  # warm-up off the capturing stream, as capture requires
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            self.model.static_forward(static_ids, static_positions, window, layers, chunks)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, logits = self.model.static_forward(static_ids, static_positions, window, layers, chunks)
        return _Captured(graph, static_ids, static_positions, hidden, logits)


@torch.inference_mode()
def measure_attention(model, window: int, repeats: int = 10) -> tuple[float, float]:
    """Median seconds of one layer's attention for a 1-token query over the first ``window``
    positions of ``model``'s cache: (one SDPA call, ``split_attention``)."""
    device, groups = model.device, model.num_heads // model.num_kv_heads
    query = torch.randn(1, model.num_kv_heads, groups, model.head_dim, device=device, dtype=model.dtype)
    keys, values = model.cache.keys[0, :, :, :window], model.cache.values[0, :, :, :window]  # [1, H_kv, W, D]
    mask = torch.ones(groups, window, dtype=torch.bool, device=device)  # [G, W]
    chunks = attention_chunks(window)
    ways = (
        lambda: F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=model.scaling),
        lambda: split_attention(query, keys, values, mask, model.scaling, chunks),
    )
    fused, split = (median_seconds(way, device, repeats) for way in ways)
    return fused, split
