"""Study: can a forward over the GGUF file's 4-bit blocks beat float32 on CPU? Answer: docs/benchmarks.md.

Issue 13, item 4: can a forward that reads the GGUF file's 4-bit Q4_1 blocks beat float32 on CPU?

The embedded target's projections are Q4_1: blocks of 32 weights, each an fp16 scale d, an fp16
minimum m and 16 bytes of 4-bit codes q (low nibbles are weights 0..15, high nibbles 16..31), weight
= d * q + m. Reading them moves about 6x fewer bytes than float32. This measures, for the seven
projections of one layer at 1 and 5 rows (a decode step and a k = 4 verify):
- float32 ``F.linear`` on the dequantised weights (what the engine runs);
- ``torch.compile`` (inductor) of dequantise-then-multiply over the packed bytes, which inductor
  may fuse into one kernel that never writes the float32 weights out;
and checks that the dequantised blocks equal the float32 weights transformers loaded, bit for bit,
and that the outputs agree within 1e-4.

    .venv/bin/python bench/studies/q4.py      # about 2 minutes; writes bench/results/q4.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import host  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.loader import embedded_gguf, load  # noqa: E402

# GGUF tensor -> the HF parameter it becomes (q and k are permuted by the loader: compared after it)
PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpack_q4_1(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw [O, blocks * 20] uint8 -> codes [O, blocks, 16] uint8, scales and minima [O, blocks, 1] fp16."""
    rows = raw.shape[0]
    blocks = torch.from_numpy(raw.copy()).view(rows, -1, 20)  # [O, B, 20]
    scales = blocks[..., 0:2].contiguous().view(torch.float16)  # [O, B, 1]
    minima = blocks[..., 2:4].contiguous().view(torch.float16)  # [O, B, 1]
    return blocks[..., 4:].contiguous(), scales, minima


def dequantise(codes: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor) -> torch.Tensor:
    """-> float32 weights [O, I]: low nibbles are a block's first 16 weights, high nibbles the rest."""
    values = torch.cat([codes & 0xF, codes >> 4], dim=-1).float()  # [O, B, 32]
    return (values * scales.float() + minima.float()).flatten(1)  # [O, I]


def q4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantise(codes, scales, minima))


def median_us(fn, repeats: int = 200) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.manual_seed(0)
    model = load(EngineConfig()).target
    layer = model.model.layers[0]
    reader = GGUFReader(str(embedded_gguf()))
    raw = {t.name: t for t in reader.tensors if t.name.startswith("blk.0.")}
    compiled = torch.compile(q4_linear, dynamic=False)
    rows: list[dict] = []
    totals = {rows_: {"float32_us": 0.0, "q4_compiled_us": 0.0} for rows_ in (1, 5)}
    for name, attr in PROJECTIONS.items():
        tensor = raw[f"blk.0.{name}.weight"]
        codes, scales, minima = unpack_q4_1(tensor.data)
        weight = layer.get_submodule(attr).weight.detach()  # [O, I] float32, as the engine holds it
        dequantised = dequantise(codes, scales, minima)
        exact = (
            torch.equal(dequantised, weight)
            if name not in ("attn_q", "attn_k")
            else torch.equal(torch.sort(dequantised.flatten()).values, torch.sort(weight.flatten()).values)
        )
        for count in (1, 5):
            x = torch.randn(count, weight.shape[1])
            reference = F.linear(x, dequantised)
            error = float((compiled(x, codes, scales, minima) - reference).abs().max())
            f32 = median_us(lambda x=x, weight=weight: F.linear(x, weight))
            q4 = median_us(lambda x=x, q=(codes, scales, minima): compiled(x, *q))
            totals[count]["float32_us"] += f32
            totals[count]["q4_compiled_us"] += q4
            rows.append(
                {
                    "tensor": name,
                    "shape": list(weight.shape),
                    "rows": count,
                    "blocks_equal_float32_weights": exact,
                    "max_abs_error": error,
                    "float32_us": round(f32, 1),
                    "q4_compiled_us": round(q4, 1),
                    "q4_over_float32": round(q4 / f32, 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    verdict = {
        str(count): {
            **{k: round(v, 1) for k, v in t.items()},
            "q4_over_float32": round(t["q4_compiled_us"] / t["float32_us"], 2),
        }
        for count, t in totals.items()
    }
    adopt = all(v["q4_over_float32"] < 1.0 for v in verdict.values()) and all(r["max_abs_error"] <= 1e-4 for r in rows)
    report = {"host": host(), "layer": 0, "per_tensor": rows, "layer_total": verdict, "adopt": adopt}
    out = Path(__file__).resolve().parents[1] / "results" / "q4.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"layer_total": verdict, "adopt": adopt}, indent=2))


if __name__ == "__main__":
    main()
