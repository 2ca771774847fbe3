"""Small-row matrix products on CPU, in the formulation measured fastest on this host.

A decode step multiplies 1 row by every weight; a verify multiplies k+1 rows. On the CPUs this
project runs on, ``F.linear`` with a few rows can take a BLAS path that costs several times one
row, while the same product with the weight first, ``(W @ x.T).T``, does not; in bfloat16 a long
input can run faster upcast to float32. Which formulation wins depends on the CPU, the dtype and
the row count, so a ``MatmulPlan`` is measured at start-up on the model's own weights, one choice
per (weight shape, dtype, rows) for 1..max_rows rows and one for anything longer (measured at
LONG_ROWS rows: prompts and a draft's catch-up). Upcasting only pays over many rows and reversing
the product only over a few, so each is measured only where it can win.

A fifth candidate reads a copy of the weight that oneDNN reordered once into its own blocked layout
(``PackedWeight``). Where it wins, the model holds only that copy (``ProductWeights.use_plan``), so
it is chosen per shape for every row count at once. What the plan chose and measured on one host is
in docs/internals.md ("The matmul plan").

The formulations compute the same product; they may round differently in the last bit, as any two
BLAS paths do (as the 1-row and the k+1-row paths always did).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.nn.functional as F

from .blocks import DIRECT_ROWS, BlockWeight
from .memory import return_free_pages

Key = tuple[int, int, torch.dtype]  # (out features, in features, dtype) of a weight
LONG = 0  # the row-count slot of inputs longer than max_rows
LONG_ROWS = 64  # the row count the LONG slot is measured at
GROUP_BYTES = 48 * 2**20  # weights timed per shape: more than a CPU's last-level cache holds
# A plan timed while its thread ran for less than this share of the time (other processes had the
# cores) is not stored for the next start: the choices of such a run are noise (plan_cache.py).
# The timing thread runs throughout (computing, or feeding the thread team): an idle host gives
# 0.96-1.0, one where another process computes on every core 0.40-0.59.
UNDISTURBED_SHARE = 0.75
CROSSING_ROWS = (32, 64, 128, 256, 512)  # row counts a BlockWeight's kernel and tiles are timed at, in order
UNBOUNDED = 2**31 - 1  # direct_rows of a weight whose kernel beat its tiles at every CROSSING_ROWS


def busy(cpu_share: float | None) -> bool:
    """Whether a measurement whose timing thread had ``cpu_share`` of the time (None: not known) ran
    while other processes had the cores."""
    return cpu_share is not None and cpu_share < UNDISTURBED_SHARE


def thread_clock() -> tuple[float, float]:
    """(this thread's CPU time, wall time) now, for ``thread_share``."""
    return time.thread_time(), time.perf_counter()


def thread_share(since: tuple[float, float]) -> float:
    """This thread's CPU time over the wall time since ``since`` (``thread_clock``): about 1 where it
    had a core throughout, less where other processes took it."""
    cpu, wall = since
    return (time.thread_time() - cpu) / max(time.perf_counter() - wall, 1e-9)


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
PACKED = "onednn"  # a PackedWeight's product: the model must hold the weight packed (all rows, or none)
BLOCKS = "blocks"  # a GGUF target's BlockWeight (engine/cpu/blocks.py): held as the file's blocks (all rows, or none)
HELD = (PACKED, BLOCKS)  # the choices that hold a weight in another form, for every row count at once
NAMES = (*FORMULATIONS, *HELD)  # every choice a plan can hold
# A held form is taken for a shape where its times are below the float32 formulations' by this
# margin (geometric mean over the row counts); within it the shape is timed again, up to
# RETIMES times, and if still within it the weight stays as the checkpoint holds it. So one
# start decides as the next does: a shape whose forms run alike no longer flips between starts.
HELD_MARGIN = 0.1
RETIMES = 2


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight [O, I] (and bias [O]) reordered once into oneDNN's blocked layout for its CPU, and
    multiplied by oneDNN's inner-product kernel. The packed copy is as large as the weight, and the
    weight itself is recovered exactly by ``dense``."""

    packed: torch.Tensor  # [O, I], oneDNN layout (no strided storage)
    bias: torch.Tensor | None  # [O]
    shape: tuple[int, int]
    dtype: torch.dtype

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 1) -> PackedWeight:
        """Raises RuntimeError where oneDNN cannot (float16 without avx512_fp16, say)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        return cls(packed, bias, (weight.shape[0], weight.shape[1]), weight.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize + (0 if self.bias is None else self.bias.nbytes)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., N, I] -> [..., N, O]."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def dense(self) -> torch.Tensor:
        return self.packed.to_dense()  # [O, I], the weight as it was


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a PackedWeight is worth timing for weights of ``dtype`` on ``device``."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)


def candidates(dtype: torch.dtype, rows: int, packable: bool = False, blocks: bool = False) -> list[str]:
    """The formulations that can win at ``rows`` (LONG: many) for weights of ``dtype``; ``packable``:
    PackedWeight too, ``blocks``: BlockWeight too, at every row count."""
    packed = [PACKED] if packable else []
    packed += [BLOCKS] if blocks else []
    if rows == 1:
        return ["linear", "weight_first", "padded", *packed]
    if rows != LONG:
        return ["linear", "weight_first", *packed]
    return ["linear", *packed] if dtype == torch.float32 else ["linear", "upcast", *packed]


@dataclass(slots=True)
class MatmulPlan:
    """``x @ weight.T + bias`` in the formulation chosen per (weight shape, dtype, rows), rows
    1..max_rows or LONG. Weights the plan has not seen go through ``F.linear``. A shape that chose
    PACKED chose it at every row count (``packs``): the model holds those weights packed and never
    asks the plan for them (if it does, they go through ``F.linear``)."""

    max_rows: int = 0
    choices: dict[tuple[Key, int], str] = field(default_factory=dict)
    timings_us: dict[tuple[Key, int], dict[str, float]] = field(default_factory=dict)  # what the choice rests on
    stored: str = ""  # a plan read back from a PlanCache: when it was measured
    # measured plans: the timing thread's CPU time over the wall time it took
    cpu_share: float | None = None
    # GGUF block products: the most rows each multiplies by its kernel, by crossing key (with_direct_rows)
    direct_rows: dict[str, int] = field(default_factory=dict)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., N, I] -> [..., N, O]."""
        rows = x.numel() // x.shape[-1]
        name = self.choices.get((weight_key(weight), rows if rows <= self.max_rows else LONG))
        if name is None or name == "linear" or name in HELD:
            return F.linear(x, weight, bias)
        out = FORMULATIONS[name](x.reshape(rows, x.shape[-1]), weight)  # [N, O]
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], weight.shape[0])

    def held_form(self, weight) -> str | None:
        """PACKED or BLOCKS where the model should hold ``weight`` (of the shape and dtype of a
        weight the plan timed) in that form; None: as the checkpoint holds it."""
        choice = self.choices.get((weight_key(weight), 1))
        return choice if choice in HELD else None

    @classmethod
    def uniform(cls, name: str, max_rows: int, weights: Iterable[torch.Tensor]) -> MatmulPlan:
        """One formulation wherever it is a candidate, F.linear elsewhere (tests force each path)."""
        if name not in NAMES:
            raise ValueError(f"unknown formulation {name!r}; known: {sorted(NAMES)}")
        keys = {weight_key(weight): can_pack(weight.dtype, weight.device) for weight in weights}
        slots = [*range(1, max_rows + 1), LONG]
        return cls(
            max_rows,
            {
                (key, slot): name
                for key, packable in keys.items()
                for slot in slots
                if name in candidates(key[2], slot, packable, blocks=name == BLOCKS)
            },
        )

    @classmethod
    def measure(
        cls, weights: Iterable[torch.Tensor], max_rows: int, repeats: int = 2, blocks: dict | None = None
    ) -> MatmulPlan:
        """Time every formulation on ``weights`` (grouped by shape and dtype, each group applied in
        full, so the weights come from memory as in a forward) for 1..max_rows and LONG_ROWS rows;
        keep the fastest (best of ``repeats`` after one untimed round, formulations interleaved so
        that drift hits them alike). The held forms, PACKED (timed on packed copies of the group)
        and BLOCKS (``blocks``: the BlockWeights of the weights of a shape, by its key), are taken
        for a shape only as a whole: the one whose times over all the row counts, against the best
        float32 formulation at each, have the lowest geometric mean, where that is below 1 by
        HELD_MARGIN (``_held_choice``)."""
        groups: dict[Key, list[torch.Tensor]] = {}
        for weight in weights:
            group = groups.setdefault(weight_key(weight), [])
            if sum(w.nbytes for w in group) < GROUP_BYTES:
                group.append(weight)
        plan = cls(max_rows)
        slots = [*range(1, max_rows + 1), LONG]
        started = thread_clock()
        with torch.inference_mode():
            for key, group in groups.items():
                operands: dict[str, list] = dict.fromkeys(FORMULATIONS, group)
                if can_pack(key[2], group[0].device):
                    try:  # oneDNN refuses dtypes this CPU lacks instructions for, packing or multiplying
                        packed = [PackedWeight.pack(weight, rows_hint=max_rows) for weight in group]
                        packed[0].linear(torch.zeros(2, key[1], dtype=key[2], device=group[0].device))
                        operands[PACKED] = packed
                    except RuntimeError:
                        pass
                if blocks and blocks.get(key):
                    operands[BLOCKS] = blocks[key][: len(group)]
                plan._time_group(key, operands, slots, repeats)
                for retime in range(RETIMES + 1):
                    held = _held_choice(plan, key, slots, [form for form in HELD if form in operands])
                    if held != "retime":
                        break
                    if retime < RETIMES:
                        plan._time_group(key, operands, slots, repeats)
                if held in HELD:
                    plan.choices.update({(key, slot): held for slot in slots})
        plan.cpu_share = thread_share(started)
        return plan

    @property
    def disturbed(self) -> bool:
        """Whether this plan was timed while other processes had much of the cores."""
        return busy(self.cpu_share)

    def _time_group(self, key: Key, operands: dict[str, list], slots: list[int], repeats: int) -> None:
        """Time each form in ``operands`` on its group at every slot; keep the fastest float32 formulation."""
        device = operands["linear"][0].device

        def run(name: str, x: torch.Tensor) -> None:  # the group's every weight, one formulation
            product = _held if name in HELD else FORMULATIONS[name]
            for weight in operands[name]:
                product(x, weight)

        with torch.inference_mode():
            for slot in slots:
                x = torch.randn(slot or LONG_ROWS, key[1], dtype=key[2], device=device)  # [N, I]
                names = list(candidates(key[2], slot, PACKED in operands, BLOCKS in operands))
                if len(names) == 1:
                    self.choices[key, slot] = names[0]
                    continue
                # Round 0 pays first-call costs, untimed; over LONG_ROWS rows they are negligible
                # and one timed round suffices (the formulations differ by 2x or more there).
                rounds = [False, *[True] * repeats] if slot != LONG else [True]
                best = best_times({name: partial(run, name, x) for name in names}, rounds)
                self.timings_us[key, slot] = {name: seconds * 1e6 for name, seconds in best.items()}
                self.choices[key, slot] = min((n for n in best if n not in HELD), key=best.__getitem__)

    def describe(self) -> str:
        """How many (shape, rows) cases each formulation won and whence the plan came, e.g.
        "weight_first 28/36 (measured)"; a uniform plan (int8 activations, tests) was not measured."""
        if not self.choices:
            return "F.linear"
        won = {name: sum(choice == name for choice in self.choices.values()) for name in NAMES}
        counts = ", ".join(f"{name} {count}/{len(self.choices)}" for name, count in won.items() if count)
        if self.disturbed:
            return counts + f" (timed on a busy host, its thread ran {self.cpu_share:.0%} of the time: not stored)"
        if self.stored:
            return counts + f" (stored plan, measured {self.stored})"
        return counts + (" (measured)" if self.cpu_share is not None else " (not measured)")


def _held(x: torch.Tensor, weight) -> torch.Tensor:
    return weight.linear(x)  # a PackedWeight's or a BlockWeight's own product


def _held_choice(plan: MatmulPlan, key: Key, slots: list[int], forms: list[str]) -> str | None:
    """The held form to take for ``key``: the one with the lowest geometric mean of its times over
    ``slots`` against the per-slot best float32 formulation, where that is below 1 - HELD_MARGIN;
    "retime" where it is within HELD_MARGIN of 1; None: none pays."""
    if not forms:
        return None
    means = {}
    for form in forms:
        ratios = []
        for slot in slots:
            timings = plan.timings_us[key, slot]
            ratios.append(timings[form] / min(us for name, us in timings.items() if name not in HELD))
        means[form] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    form = min(means, key=means.__getitem__)
    if means[form] < 1 - HELD_MARGIN:
        return form
    return "retime" if means[form] < 1 + HELD_MARGIN else None


def best_times(calls: dict, rounds: Iterable[bool]) -> dict:
    """The best seconds of each of ``calls`` (callables taking nothing, by any key), all called in
    turn in every round, so that a slow moment of the host falls on each alike; a round marked
    False pays first-call costs and is not timed."""
    best = dict.fromkeys(calls, float("inf"))
    for timed in rounds:
        for key, call in calls.items():
            started = time.perf_counter()
            call()
            if timed:
                best[key] = min(best[key], time.perf_counter() - started)
    return best


def weight_key(weight: torch.Tensor) -> Key:
    return weight.shape[0], weight.shape[1], weight.dtype


def measure_direct_rows(weight: BlockWeight, repeats: int = 2) -> int:
    """The most rows (of CROSSING_ROWS, in turn; UNBOUNDED past the last) at which ``weight``'s own
    kernel multiplied at least as fast as its decoded tiles on this host, best of ``repeats`` after
    an untimed round; DIRECT_ROWS where the tiles already won at the first. A count where the tiles
    win is timed again, and ends the search only if they win again (a moment's disturbance seldom
    repeats; a crossing does)."""
    found = DIRECT_ROWS
    with torch.inference_mode():
        for count in CROSSING_ROWS:
            rows = torch.randn(count, weight.in_features)  # [N, I]
            wins = _kernel_wins(weight, rows, repeats) or _kernel_wins(weight, rows, repeats)
            del rows
            return_free_pages()  # this count's outputs and tiles, before the next count's larger ones
            if not wins:
                return found
            found = count
    return UNBOUNDED


def _kernel_wins(weight: BlockWeight, rows: torch.Tensor, repeats: int) -> bool:
    """Whether ``weight``'s kernel multiplied ``rows`` at least as fast as its decoded tiles."""
    calls = {multiply: partial(weight.product, rows, multiply) for multiply in (weight.direct, weight.tiled)}
    best = best_times(calls, [False, *[True] * repeats])
    return best[weight.direct] <= best[weight.tiled]


def with_direct_rows(weights: dict, measured: dict[str, int]) -> dict:
    """``weights`` (BlockWeights by any key) each with the direct_rows ``measured`` for its crossing
    key, measuring the keys ``measured`` lacks (into it, once per key)."""
    for weight in weights.values():
        if weight.crossing_key not in measured:
            measured[weight.crossing_key] = DIRECT_ROWS if weight.rows_alike else measure_direct_rows(weight)
    return {key: replace(weight, direct_rows=measured[weight.crossing_key]) for key, weight in weights.items()}
