"""Products with int8 activations (``--activations int8``): a GGUF target's Q4_0, Q4_1 and Q8_0
weights repacked 16 output rows at a time for engine/cpu/csrc/blocks_int8.cpp, which rounds each row of
activations to int8 per block of 32 and takes each block's dot product in integers, as llama.cpp
does. A slightly different model from the float32 one its blocks decode to; the repacked bytes
decode to the same weights (``BlockWeight.dense``)."""

from __future__ import annotations

import time

import torch

from .blocks import FORMATS, INT8_FORMATS, INT8_Q4, INT8_Q8, INT8_ROWS, BlockPart, BlockWeight, kernel_isa
from .memory import release_freed_memory

ROW_SLICE = 4096  # rows int8_part repacks at a time (a multiple of INT8_ROWS)


def int8_weight(weight: BlockWeight) -> BlockWeight:
    """``weight`` with each part ``int8_part`` can repack repacked: its products then quantize their
    activations to int8, as llama.cpp's do (a different model from the float32 one, by about 0.5%
    of a product's size); other parts stay as they are. Every input goes through the kernels
    (``rows_alike``)."""
    parts = tuple(int8_part(part, weight.in_features) or part for part in weight.parts)
    return BlockWeight(parts, weight.in_features, weight.bias, weight.isa, rows_alike=True)


def repackable(part: BlockPart) -> bool:
    """Whether ``int8_part`` takes ``part`` by its format and rows (it also refuses a scale too large
    for float16 once shifted)."""
    return part.format in (FORMATS["Q4_0"], FORMATS["Q4_1"], FORMATS["Q8_0"]) and not part.rows % INT8_ROWS


def int8_part(part: BlockPart, in_features: int) -> BlockPart | None:
    """Q4_0, Q4_1 or Q8_0 ``part`` [O, row bytes] (O a multiple of 16) repacked for
    engine/cpu/csrc/blocks_int8.cpp, else None: per group of 16 rows and block of 32 inputs, the rows'
    unsigned values q four inputs at a time (operand k holds inputs 4 k .. 4 k + 3 of each row, byte
    4 * row + j; Q4's operands 2 s and 2 s + 1 share bytes, low and high nibbles), then the 16 rows'
    d and m as float16, w = d * q + m: as [O / 16, 320 * I / 32] (INT8_Q4; Q4_0: m = -8 d) or
    [O / 16, 576 * I / 32] (INT8_Q8: q + 128, m = -128 d) uint8."""
    if not repackable(part):
        return None
    # a slice of rows at a time: the temporaries of a whole LM head would hold several times its size
    q8 = part.format == FORMATS["Q8_0"]
    packed = torch.empty(part.rows // INT8_ROWS, (576 if q8 else 320) * (in_features // 32), dtype=torch.uint8)
    for row in range(0, part.rows, ROW_SLICE):  # [O / 16, group bytes], filled a slice's groups at a time
        groups = _repacked_rows(part.blocks[row : row + ROW_SLICE], part.format, in_features)
        if groups is None:
            return None
        packed[row // INT8_ROWS : row // INT8_ROWS + groups.shape[0]] = groups
    return BlockPart(packed, INT8_Q8 if q8 else INT8_Q4)


def _repacked_rows(rows: torch.Tensor, format: int, in_features: int) -> torch.Tensor | None:
    """``int8_part``'s bytes for ``rows`` [O, row bytes] of ``format``: [O / 16, group bytes] uint8."""
    num_groups, num_blocks = rows.shape[0] // INT8_ROWS, in_features // 32
    blocks = rows.view(rows.shape[0], num_blocks, -1)  # [O, B, block bytes]
    scale = blocks[..., 0:2].contiguous()  # [O, B, 2] float16 bytes
    if format == FORMATS["Q4_1"]:
        shift, nibbles = blocks[..., 2:4], blocks[..., 4:20]
    else:  # Q4_0 and Q8_0: w = d * (q - offset) = d * q + m with m = -offset * d
        offset, nibbles = (8, blocks[..., 2:18]) if format == FORMATS["Q4_0"] else (128, None)
        shift_values = scale.view(torch.float16) * -offset  # [O, B, 1]
        if not torch.isfinite(shift_values).all():  # a scale too large for m in float16
            return None
        shift = shift_values.view(torch.uint8)
    if nibbles is not None:
        values = torch.cat([nibbles & 15, nibbles >> 4], -1)  # [O, B, 32]: the block's inputs in order
    else:  # q + 128 as a byte: an int8's two's-complement byte with its top bit flipped
        values = blocks[..., 2:34] ^ 128  # [O, B, 32]
    # [G, row, B, k, j] -> [G, B, k, row, j]: input 4 k + j of each row, rows lane by lane
    values = values.view(num_groups, INT8_ROWS, num_blocks, 8, 4).permute(0, 2, 3, 1, 4)  # [G, B, 8, 16, 4]
    if nibbles is not None:  # operands 2 s and 2 s + 1 in one byte
        values = values[:, :, 0::2] | (values[:, :, 1::2] << 4)  # [G, B, 4, 16, 4]

    def by_lane(halves: torch.Tensor) -> torch.Tensor:  # [O, B, 2] -> [G, B, 32]
        return (
            halves.reshape(num_groups, INT8_ROWS, num_blocks, 2).permute(0, 2, 1, 3).reshape(num_groups, num_blocks, 32)
        )

    packed = torch.cat([values.reshape(num_groups, num_blocks, -1), by_lane(scale), by_lane(shift)], -1)
    return packed.reshape(num_groups, -1).contiguous()


FASTER = 0.97  # int8 activations are chosen where their products take at most this share of float32's time


def int8_activations(found: dict) -> tuple[dict, str]:
    """``offer_blocks``' repack for ``--activations int8``: every product that can be, repacked, one at
    a time in place (each weight's file blocks go as its repacked ones come)."""
    for key, weight in found.items():
        found[key] = int8_weight(weight)
    repacked = sum(all(part.format in INT8_FORMATS for part in weight.parts) for weight in found.values())
    note = f"int8 activations in {repacked}/{len(found)} (Q4_0, Q4_1 and Q8_0 blocks; the rest float32)"
    if not torch.ops.specserve.blocks_has_vnni():
        note += " by AVX2" if kernel_isa() >= 1 else " by portable code (slower than float32 activations)"
        note += " (this CPU lacks AVX-512 VNNI)"
    return found, note


def auto_activations(found: dict) -> tuple[dict, str]:
    """``offer_blocks``' repack for ``--activations auto``: int8 where ``faster_activations`` says so."""
    chosen, measured = faster_activations(found)
    if chosen == "float32":
        return found, measured
    found, note = int8_activations(found)
    return found, f"{measured}; {note}"


def held_activations(model) -> str:
    """What a CausalLM's block products multiply: "int8" where any holds repacked parts."""
    held = model.weights.blocks.values()
    return "int8" if any(part.format in INT8_FORMATS for weight in held for part in weight.parts) else "float32"


def faster_activations(found: dict, rows: tuple[int, ...] = (1, 5), repeats: int = 7) -> tuple[str, str]:
    """Time the model's largest product with float32 and with int8 activations, at a decode step's
    rows and a verify's, best of ``repeats`` each, taking turns; -> ("int8" or "float32", a line
    saying what was measured). float32 where no product can be repacked. Where int8 is chosen, the
    product timed is left repacked in ``found`` (not repacked twice)."""
    candidates = [key for key, weight in found.items() if any(repackable(part) for part in weight.parts)]
    if not candidates:
        return "float32", "activations auto: float32 (no Q4_0, Q4_1 or Q8_0 product to repack)"
    key = max(candidates, key=lambda key: found[key].nbytes)
    weight = found[key]
    forms = {"float32": weight, "int8": int8_weight(weight)}
    best = dict.fromkeys(forms, float("inf"))
    inputs = [torch.randn(n, weight.in_features) for n in rows]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy host's cores time both alike on one thread; on all, its spinning teams
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                for name, form in forms.items():
                    started = time.perf_counter()
                    for x in inputs:
                        form.linear(x)
                    best[name] = min(best[name], time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    ratio = best["int8"] / best["float32"]
    chosen = "int8" if ratio <= FASTER else "float32"
    if chosen == "int8":
        found[key] = forms["int8"]
    del forms, weight
    release_freed_memory()  # the form not kept, and the timing's temporaries
    return chosen, f"activations auto: {chosen} (int8 products measured at {ratio:.2f}x float32's here)"
