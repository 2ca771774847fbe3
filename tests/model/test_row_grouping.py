"""A position's logits do not depend on how its rows were grouped, at any thread count.

The embedded GGUF target scores one sequence three ways: as one prompt pass, as 1-row decode
steps, and as a prompt pass of its first rows followed by 5-row verifies. At 1, 2, 8 and 16 threads,
with float32 and with int8 activations, every position's logits are the same bits: each op splits
its work between threads by whole rows and computes a row alike whatever rows come with it
(engine/cpu/csrc/forward_ops.cpp). The control puts torch's silu back in the gate, which splits
a tensor between threads by elements: at 8 threads the bits then differ."""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels import Pointwise
from tests.conftest import EMBEDDED_FLOAT32, EMBEDDED_INT8

LENGTH, PROMPT, VERIFY = 97, 77, 5  # 97 rows of the 1536-wide gate: torch splits them mid-row at 5+ threads


def three_ways(target, sequence: list[int]) -> list[torch.Tensor]:
    """The logits [N, V] of every position of ``sequence``: one pass, 1-row steps, a prompt then verifies."""
    target.cache.rollback(0)
    whole = target.extend(sequence, num_logits=len(sequence))
    target.cache.rollback(0)
    stepped = torch.cat([target.extend([token]) for token in sequence])
    target.cache.rollback(0)
    grouped = [target.extend(sequence[: PROMPT - 1], num_logits=PROMPT - 1)]
    for start in range(PROMPT - 1, len(sequence), VERIFY):
        rows = sequence[start : start + VERIFY]
        grouped.append(target.extend(rows, num_logits=len(rows)))
    target.cache.rollback(0)
    return [whole, stepped, torch.cat(grouped)]


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_positions_logits_are_the_same_bits_however_its_rows_are_grouped(activations, embedded):
    engine = embedded(**(EMBEDDED_INT8 if activations == "int8" else EMBEDDED_FLOAT32)).engine
    assert engine.description.activations == activations  # what the start-up line and /v1/models say
    target = engine.target
    assert target.weights.rows_alike and target.kernels.native
    sequence = torch.randint(0, target.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    threads, kernels = torch.get_num_threads(), target.kernels
    try:
        for count in (1, 2, 8, 16):
            torch.set_num_threads(count)
            whole, stepped, grouped = three_ways(target, sequence)
            assert torch.equal(whole, stepped) and torch.equal(whole, grouped), (
                f"{activations} at {count} threads: up to {(whole - stepped).abs().max():.2e} apart"
            )
        # the control: the gate by torch's silu and mul again, split between threads by elements
        target.kernels = Pointwise.eager(target.norm_eps, target.activation, native=True, silu=False)
        torch.set_num_threads(8)
        whole, stepped, _ = three_ways(target, sequence)
        assert not torch.equal(whole, stepped), (
            "torch's silu split by elements gave the same bits: the test shows nothing"
        )
    finally:
        torch.set_num_threads(threads)
        target.kernels = kernels
