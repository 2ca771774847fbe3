"""Small-row matrix products on CPU, in the formulation measured fastest on this host.

A decode step multiplies 1 row by every weight; a verify multiplies k+1 rows. On the CPUs this
project runs on, ``F.linear`` with 2 to 9 rows takes a BLAS path that costs 2-3x one row (SmolLM2's
LM head: 35 ms for 5 rows against 13 ms for 1), while the same product with the weight first,
``(W @ x.T).T``, costs 12 ms. In bfloat16 the same host has no fast many-row kernel: a draft
reading a 512-token prompt through a 1536 x 576 weight took 58 ms, and 8 ms when the product ran in
float32 (weight and input upcast on the fly). Which formulation wins depends on the CPU, the dtype
and the row count, so a ``MatmulPlan`` is measured at start-up on the model's own weights, one
choice per (weight shape, dtype, rows) for 1..max_rows rows and one for anything longer (measured
at LONG_ROWS rows: prompts and a draft's catch-up). Upcasting only pays over many rows (converting
the weight costs more than a few rows' product), and reversing the product only over a few (for a
1,500-token float32 prompt it was 1.3x slower), so each is measured only where it can win.

The formulations compute the same product; they may round differently in the last bit, as any two
BLAS paths do (as the 1-row and the k+1-row paths always did).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

Key = tuple[int, int, torch.dtype]  # (out features, in features, dtype) of a weight
LONG = 0  # the row-count slot of inputs longer than max_rows
LONG_ROWS = 64  # the row count the LONG slot is measured at
GROUP_BYTES = 48 * 2**20  # weights timed per shape: more than a CPU's last-level cache holds


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)  # [N, I] -> [N, O]


def _weight_first(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight @ x.T).T.contiguous()  # [O, N] -> [N, O]


def _padded(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One row computed as two: a 2-row product skips the matrix-vector path, which read the LM
    head at half the speed of the 2-row one on this project's CPUs."""
    # the product's first column alone is made contiguous; cat copies the row in a fifth of repeat's time
    return (weight @ torch.cat([x, x]).T)[:, :1].T.contiguous()  # [O, 2] -> [1, O]


def _upcast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float()).to(x.dtype)  # [N, O], accumulated in float32 as before


FORMULATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "linear": _linear,
    "weight_first": _weight_first,
    "padded": _padded,  # one row only
    "upcast": _upcast,  # half-precision weights only
}


def candidates(dtype: torch.dtype, rows: int) -> list[str]:
    """The formulations that can win at ``rows`` (LONG: many) for weights of ``dtype``."""
    if rows == 1:
        return ["linear", "weight_first", "padded"]
    if rows != LONG:
        return ["linear", "weight_first"]
    return ["linear"] if dtype == torch.float32 else ["linear", "upcast"]


@dataclass(slots=True)
class MatmulPlan:
    """``x @ weight.T + bias`` in the formulation chosen per (weight shape, dtype, rows), rows
    1..max_rows or LONG. Weights the plan has not seen go through ``F.linear``."""

    max_rows: int = 0
    choices: dict[tuple[Key, int], str] = field(default_factory=dict)
    timings_us: dict[tuple[Key, int], dict[str, float]] = field(default_factory=dict)  # what the choice rests on

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., N, I] -> [..., N, O]."""
        rows = x.numel() // x.shape[-1]
        name = self.choices.get((_key(weight), rows if rows <= self.max_rows else LONG))
        if name is None or name == "linear":
            return F.linear(x, weight, bias)
        out = FORMULATIONS[name](x.reshape(rows, x.shape[-1]), weight)  # [N, O]
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], weight.shape[0])

    @classmethod
    def uniform(cls, name: str, max_rows: int, weights: Iterable[torch.Tensor]) -> MatmulPlan:
        """One formulation wherever it is a candidate, F.linear elsewhere (tests force each path)."""
        if name not in FORMULATIONS:
            raise ValueError(f"unknown formulation {name!r}; known: {sorted(FORMULATIONS)}")
        keys = {_key(weight) for weight in weights}
        slots = [*range(1, max_rows + 1), LONG]
        return cls(max_rows, {(key, slot): name for key in keys for slot in slots if name in candidates(key[2], slot)})

    @classmethod
    def measure(cls, weights: Iterable[torch.Tensor], max_rows: int, repeats: int = 2) -> MatmulPlan:
        """Time every formulation on ``weights`` (grouped by shape and dtype, each group applied in
        full, so the weights come from memory as in a forward) for 1..max_rows and LONG_ROWS rows;
        keep the fastest (best of ``repeats`` after one untimed round, formulations interleaved so
        that drift hits them alike)."""
        groups: dict[Key, list[torch.Tensor]] = {}
        for weight in weights:
            group = groups.setdefault(_key(weight), [])
            if sum(w.nbytes for w in group) < GROUP_BYTES:
                group.append(weight)
        plan = cls(max_rows)
        with torch.inference_mode():
            for key, group in groups.items():
                for slot in [*range(1, max_rows + 1), LONG]:
                    x = torch.randn(slot or LONG_ROWS, key[1], dtype=key[2], device=group[0].device)  # [N, I]
                    best = dict.fromkeys(candidates(key[2], slot), float("inf"))
                    if len(best) == 1:
                        plan.choices[key, slot] = next(iter(best))
                        continue
                    # Round 0 pays first-call costs, untimed; over LONG_ROWS rows they are negligible
                    # and one timed round suffices (the formulations differ by 2x or more there).
                    rounds = [False, *[True] * repeats] if slot != LONG else [True]
                    for timed in rounds:
                        for name in best:
                            started = time.perf_counter()
                            for weight in group:
                                FORMULATIONS[name](x, weight)
                            if timed:
                                best[name] = min(best[name], time.perf_counter() - started)
                    plan.timings_us[key, slot] = {name: seconds * 1e6 for name, seconds in best.items()}
                    plan.choices[key, slot] = min(best, key=best.__getitem__)
        return plan

    def describe(self) -> str:
        """How many (shape, rows) cases each formulation won, e.g. "weight_first 28/36"."""
        if not self.choices:
            return "F.linear"
        won = {name: sum(choice == name for choice in self.choices.values()) for name in FORMULATIONS}
        return ", ".join(f"{name} {count}/{len(self.choices)}" for name, count in won.items() if count)


def _key(weight: torch.Tensor) -> Key:
    return weight.shape[0], weight.shape[1], weight.dtype
