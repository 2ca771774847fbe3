"""Study: what do the pointwise kernels change on CPU? Answer: docs/benchmarks.md and docs/gpu.md.

What the pointwise kernels (engine/model/kernels.py) change, measured on CPU with the embedded model.

    .venv/bin/python bench/studies/kernels.py          # writes bench/results/kernels.json

- Operations per layer of an eager 1-token step, by name (views left out): each is one kernel
  launch on a GPU, where launches, not bytes, bound a small layer. Counted by a dispatch mode over
  one step, per layer from the difference between the whole model and its first layer alone.
- How many of those the four pointwise functions account for, and how many kernels inductor
  generates for each function when compiled (on CPU: C++ loops; on a GPU it emits Triton kernels,
  whose count bench/gpu.py reports from the profiler).
- The 1-token and 5-token steps with eager and with compiled kernels, interleaved, medians: why
  CPU serving keeps them eager. The host is recorded beside them.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch._inductor.metrics as inductor_metrics
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for bench.host
from bench.host import host  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.kernels import Pointwise  # noqa: E402
from engine.model.loader import load  # noqa: E402
from engine.model.model import CausalLM  # noqa: E402

# operations that make views or bookkeeping, not kernels
VIEWS = frozenset(
    "view _unsafe_view transpose slice select t expand unsqueeze squeeze as_strided split "
    "split_with_sizes chunk alias detach detach_ reshape permute unbind empty lift_fresh".split()
)
# what the pointwise functions replace in the eager count: everything but products, cache writes,
# attention, and the step's own embedding, rotary lookups and mask
NOT_POINTWISE = frozenset("linear index_copy_ scaled_dot_product_attention".split())


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def ops_of_one_step(lm: CausalLM, layers: tuple[int, ...]) -> Counter:
    context = lm.cache.length
    with CountOps() as counter:
        lm.draft_through([2000], context, layers)
    return counter.ops


def step_ms(lm: CausalLM, kernels: dict[str, Pointwise], num_new: int, repeats: int = 25) -> dict[str, float]:
    context = lm.cache.length
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(repeats):
        for name, chosen in kernels.items():
            lm.kernels = chosen
            started = time.perf_counter()
            lm.extend(list(range(2000, 2000 + num_new)), num_logits=num_new)
            times[name].append(time.perf_counter() - started)
            lm.cache.rollback(context)
    return {name: round(statistics.median(values) * 1e3, 2) for name, values in times.items()}


def main() -> None:
    hf_model = load(EngineConfig(draft=None, max_model_len=1024)).target
    lm = CausalLM(hf_model, 1024)
    lm.extend(list(range(1000, 1200)))  # 200 tokens of context
    # counted with every product one F.linear, as on a GPU (the CPU plan's formulations add views and copies)
    whole, first = ops_of_one_step(lm, lm.all_layers), ops_of_one_step(lm, (0,))
    per_layer = {name: (whole[name] - first[name]) // (len(lm.layers) - 1) for name in whole}
    per_layer = {name: count for name, count in sorted(per_layer.items()) if count}
    pointwise = sum(count for name, count in per_layer.items() if name not in NOT_POINTWISE)
    eager = lm.kernels
    lm.use_kernels("compiled")
    compiled = lm.kernels
    generated = {}
    hidden = torch.randn(1, 3, lm.config.hidden_size)
    weight = lm.norm.weight
    qk = torch.randn(1, lm.num_heads + lm.num_kv_heads, 3, lm.head_dim)
    cos, sin = lm.cos[:3], lm.sin[:3]
    gate_up = torch.randn(1, 3, 2 * lm.config.intermediate_size)
    for name, args in {
        "rms_norm": (hidden, weight),
        "add_rms_norm": (hidden, hidden, weight),
        "rotate": (qk, cos, sin),
        "gate": (gate_up,),
    }.items():
        inductor_metrics.reset()
        getattr(compiled, name)(*args)
        generated[name] = inductor_metrics.generated_kernel_count
    lm.weights.plan_matmuls(6)  # timed as CPU serving runs: products through the measured plan
    lm.kernels = compiled
    lm.warm_up_kernels()
    lm.extend(list(range(1000, 1200)))
    kernels = {"eager": eager, "compiled": compiled}
    report = {
        "host": host(),
        "model": "SmolLM2-135M-Instruct, float32, 200 tokens of context",
        "ops_per_layer_eager": per_layer,
        "ops_per_layer_eager_total": sum(per_layer.values()),
        "ops_per_layer_eager_pointwise": pointwise,
        "calls_per_layer_compiled_pointwise": 4,  # two add-and-norms, the rotation, the gate
        "inductor_cpu_kernels_per_function": generated,
        "step_ms": {f"{n} tokens": step_ms(lm, kernels, n) for n in (1, 5)},
    }
    out = Path(__file__).resolve().parents[1] / "results" / "kernels.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({key: value for key, value in report.items() if key != "host"}, indent=2))


if __name__ == "__main__":
    main()
