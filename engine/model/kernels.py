"""The pointwise work between a layer's products, as four functions, run eagerly or compiled.

Between its matrix products and attention, a Llama layer normalises twice, adds two residuals,
rotates queries and keys, and gates its MLP: most of the kernels a layer launches eagerly, each
reading and writing a few KB. On a GPU each costs a few microseconds of launch latency even inside a
CUDA graph. Compiled by inductor, each function becomes one fused kernel, so a layer launches about
eleven: four products, the rotation, two cache writes, attention, two add-and-norms and the gate.
The counts and timings are in docs/gpu.md.

Each model gets its own compiled copies (``Pointwise.compiled``): dynamo keeps its cache and its
recompile limit per code object, so models sharing one would evict each other's variants. Each
function is compiled with dynamic shapes, so any number of tokens runs one compiled variant (dynamo
specialises one more for a single token): two compilations per function and model, counted in
``compilations``. The captured CUDA graphs (``engine/model/runner.py``) replay the fused kernels like any
others. On CPU the calls into compiled code cost more than the kernels they fuse
(``bench/studies/kernels.py``), so CPU serving stays eager.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def fresh(function: Callable) -> Callable:
    """A copy of ``function`` with its own code object, so it has its own dynamo cache."""
    code = function.__code__.replace()
    return types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )


def counted_backend(backend: str, counts: dict, key) -> Callable:
    """torch.compile's ``backend``, counting each compilation under ``key`` in ``counts``."""
    inner = torch._dynamo.lookup_backend(backend)

    def compile_counted(graph_module, example_inputs):
        counts[key] = counts.get(key, 0) + 1
        return inner(graph_module, example_inputs)

    return compile_counted


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., E] normalised as the checkpoints round it: in float32, cast to x's dtype, then scaled
    by weight [E]. In half precision, normalising in the input's dtype instead turned the embedded
    model's bfloat16 answers into nonsense."""
    normalised = F.rms_norm(x.float(), weight.shape, None, eps)  # [..., E] float32
    return weight * normalised.to(x.dtype)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, that sum normalised): a residual connection and the next norm, fused."""
    total = residual + delta  # [..., E]
    return total, rms_norm(total, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with half-split pairs, as in the Llama checkpoints. x [1, H, T, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def gate(gate_up: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A gated MLP's middle: gate_up [..., 2I] (the gate's rows, then up's) -> act(gate) * up [..., I]."""
    gated, up = gate_up.chunk(2, dim=-1)
    return activation(gated) * up


@dataclass(slots=True)
class Pointwise:
    """The pointwise functions one model's forward calls, with its norms' epsilon and its MLP's
    activation bound in (constants of the compiled code, not inputs that dynamo would trace)."""

    mode: str  # "eager" or "compiled"
    rms_norm: Callable  # (x, weight) -> normalised
    add_rms_norm: Callable  # (residual, delta, weight) -> (sum, normalised sum)
    rotate: Callable  # (x, cos, sin) -> rotated
    gate: Callable  # gate_up -> act(gate) * up
    compilations: dict[str, int] = field(default_factory=dict)  # compiled: how often each function compiled
    native: bool = False  # the norms and the rotation run engine/cpu/csrc's ops

    @classmethod
    def eager(cls, eps: float, activation: Callable, native: bool = False, silu: bool = False) -> Pointwise:
        """Eager functions; ``native``: the norms, the rotation and a SiLU gate by engine/cpu/csrc's ops
        (CPU float32; the gate where ``activation`` is SiLU), one call each where torch launches several (a norm is about eight), each
        splitting its work between threads by whole rows (so a row's bits never depend on the rows
        beside it or on the thread count)."""
        functions = _bound(eps, activation)
        if native:
            ops = torch.ops.specserve
            norm, add_norm = ops.rms_norm.default, ops.add_rms_norm.default
            functions["rms_norm"] = lambda x, weight: norm(x, weight, eps)
            functions["add_rms_norm"] = lambda residual, delta, weight: add_norm(residual, delta, weight, eps)
            functions["rotate"] = ops.rotate.default
            if silu:
                functions["gate"] = ops.silu_gate.default
        return cls("eager", **functions, native=native)

    @classmethod
    def compiled(cls, eps: float, activation: Callable, backend: str = "inductor") -> Pointwise:
        """Each function compiled for this model alone (``fullgraph=True``: a graph break raises)."""
        counts: dict[str, int] = {}
        # the epsilon as a constant: traced as a symbolic float, it restarts the first trace
        constant_floats = torch._dynamo.config.patch(specialize_float=True)
        compiled = {
            name: constant_floats(
                torch.compile(
                    fresh(function), backend=counted_backend(backend, counts, name), fullgraph=True, dynamic=True
                )
            )
            for name, function in _bound(eps, activation).items()
        }
        return cls("compiled", **compiled, compilations=counts)


def _bound(eps: float, activation: Callable) -> dict[str, Callable]:
    """The four functions with ``eps`` and ``activation`` bound, by name."""

    def norm_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_norm_bound(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor):
        return add_rms_norm(residual, delta, weight, eps)

    def gate_bound(gate_up: torch.Tensor) -> torch.Tensor:
        return gate(gate_up, activation)

    return {"rms_norm": norm_bound, "add_rms_norm": add_norm_bound, "rotate": rotate, "gate": gate_bound}
