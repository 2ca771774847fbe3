"""Products with int8 activations (``--activations int8``): a GGUF target's Q4_0 and Q4_1 weights
repacked 16 output rows at a time for engine/csrc/blocks_int8.cpp, which rounds each row of
activations to int8 per block of 32 and takes each block's dot product in integers, as llama.cpp
does. A slightly different model from the float32 one its blocks decode to; the repacked bytes
decode to the same weights (``BlockWeight.dense``)."""

from __future__ import annotations

import torch

from .blocks import FORMATS, INT8_Q4, INT8_ROWS, BlockPart, BlockWeight


def int8_weight(weight: BlockWeight) -> BlockWeight:
    """``weight`` with each part ``int8_part`` can repack repacked: its products then quantize their
    activations to int8, as llama.cpp's do (a different model from the float32 one, by about 0.5%
    of a product's size); other parts stay as they are. Every input goes through the kernels
    (``rows_alike``)."""
    parts = tuple(int8_part(part, weight.in_features) or part for part in weight.parts)
    return BlockWeight(parts, weight.in_features, weight.bias, weight.isa, rows_alike=True)


def int8_part(part: BlockPart, in_features: int) -> BlockPart | None:
    """Q4_0 or Q4_1 ``part`` [O, row bytes] (O a multiple of 16) repacked for engine/csrc/blocks_int8.cpp:
    per group of 16 rows and block of 32 inputs, 4 x 64 bytes of nibbles (byte 4 * row + j holds input
    8 s + j low and 8 s + 4 + j high), then the 16 rows' d and m as float16 (Q4_0: m = -8 d, exact),
    as [O / 16, 320 * I / 32] uint8: a Q4_1 file's bytes in another order (Q4_0's and its m); else None."""
    if part.format not in (FORMATS["Q4_0"], FORMATS["Q4_1"]) or part.rows % INT8_ROWS:
        return None
    num_groups, num_blocks = part.rows // INT8_ROWS, in_features // 32
    blocks = part.blocks.view(part.rows, num_blocks, -1)  # [O, B, block bytes]
    if part.format == FORMATS["Q4_1"]:
        scale, shift, nibbles = blocks[..., 0:2], blocks[..., 2:4], blocks[..., 4:20]
    else:
        scale, nibbles = blocks[..., 0:2], blocks[..., 2:18]
        shift = (scale.contiguous().view(torch.float16) * -8).view(torch.uint8)  # [O, B, 2]
    values = torch.cat([nibbles & 15, nibbles >> 4], -1)  # [O, B, 32]: the block's inputs in order
    # [G, row, B, s, half, j] -> [G, B, s, row, half, j]: input 8 s + 4 half + j of each row, rows lane by lane
    values = values.view(num_groups, INT8_ROWS, num_blocks, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
    packed_nibbles = values[..., 0, :] | (values[..., 1, :] << 4)  # [G, B, 4, 16, 4]

    def by_lane(halves: torch.Tensor) -> torch.Tensor:  # [O, B, 2] -> [G, B, 32]
        return (
            halves.reshape(num_groups, INT8_ROWS, num_blocks, 2).permute(0, 2, 1, 3).reshape(num_groups, num_blocks, 32)
        )

    packed = torch.cat([packed_nibbles.reshape(num_groups, num_blocks, 256), by_lane(scale), by_lane(shift)], -1)
    return BlockPart(packed.reshape(num_groups, num_blocks * 320).contiguous(), INT8_Q4)
