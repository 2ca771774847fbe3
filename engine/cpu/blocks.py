"""A GGUF target's products read from the file's own quantized blocks, computed in float32.

A decode step reads every weight once, so it costs the bytes of its weights: float32 copies of the
embedded model's Q4_1 and Q8_0 blocks are 5-7x larger than the blocks. ``BlockWeight`` holds a
product's weight as the GGUF holds it (rows of blocks, uint8) and multiplies through the C++
kernels of ``engine/cpu/csrc`` (built when the project installs, as ``engine/cpu/_blocks``): each block is
decoded to exactly the float32 weights ``load`` produces (the gguf package's dequantization), and
multiplied by float32 activations with float32 accumulation. The activations are not quantized. So
the weights and the output law are unchanged; only the summation order differs, as it does between
any two BLAS paths. A user may ask for llama.cpp's arithmetic instead (``--activations int8``):
Q4_0, Q4_1 and Q8_0 weights are repacked (engine/cpu/int8_blocks.py) and their products round each row of
activations to int8 per block of 32 and sum in integers (engine/cpu/csrc/blocks_int8.cpp), a slightly
different model, about 3x cheaper per product. Every input then goes through the kernels, whatever
its length, so a row's arithmetic never depends on the rows beside it.

A target's products go through the kernel at every row count (``rows_alike``), each decoded block
shared by all rows and each row summed in the same order whatever rows come with it, so a
position's logits are the same bits from a prompt pass, a decode step or a verify. A draft head's
blocks (EAGLE-3's, whose rounding decides no output) may instead go by decoded tiles into a float32
product past the row count where, on this host, that starts to win (engine/cpu/matmul.py's
``measure_direct_rows``, per weight shape: for a wide product of a narrow input that can be never,
for a narrow one of a wide input a few dozen rows); a BLAS product's sums depend on the row count.

``match_blocks`` finds each product's tensors in the file (the gguf package's name map) and proves
the exactness at start-up: the decoded blocks must equal the loaded float32 weight bit for bit, up
to a permutation of rows (transformers reorders the rows of Llama's q and k); a product where they
do not (a bfloat16 target, say) keeps its float32 weight.
"""

from __future__ import annotations

import importlib.machinery
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .memory import release_freed_memory

log = logging.getLogger(__name__)

# GGML type ids the kernels decode: the embedded model's Q4_1 and Q8_0, and the formats users' files come in
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
ISAS = ("portable", "avx2", "avx512")  # the kernels' instruction sets, by the index the ops take
# not GGML types: Q4_0 or Q4_1, and Q8_0, blocks repacked for int8 activations (engine/cpu/int8_blocks.py)
INT8_Q4, INT8_Q8 = 100, 101
INT8_FORMATS = (INT8_Q4, INT8_Q8)
INT8_ROWS = 16  # output rows per repacked group
DIRECT_ROWS = 16  # rows always multiplied by the kernel itself (decode, verify)
TILE_BYTES = 4 * 2**20  # float32 bytes of one decoded tile


class BlocksUnavailable(RuntimeError):
    """Why the block products cannot run here (one line, for the start-up line)."""


def kernel_isa() -> int:
    """Load ``engine/cpu/_blocks`` once per process (its ops register as torch.ops.specserve) and return
    the best instruction set this CPU runs it with. Raises BlocksUnavailable, saying why."""
    if not _ops_registered():
        folder = Path(__file__).parent
        found = [p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in folder.glob(f"_blocks{suffix}")]
        if not found:
            raise BlocksUnavailable("engine/cpu/_blocks was not built at install (no C++ compiler?)")
        try:
            torch.ops.load_library(str(found[0]))
        except OSError as error:  # built against another torch, say
            raise BlocksUnavailable(f"engine/cpu/_blocks does not load ({error}); reinstall to rebuild it") from error
    return int(torch.ops.specserve.blocks_isa())


def native_ops_available() -> bool:
    """Whether engine/cpu/_blocks loads here (its pointwise ops too: engine/model/kernels.py)."""
    try:
        kernel_isa()
    except BlocksUnavailable:
        return False
    return True


def _ops_registered() -> bool:
    try:
        torch.ops.specserve.blocks_isa  # noqa: B018 (an attribute lookup that raises when absent)
    except (AttributeError, RuntimeError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class BlockPart:
    """Rows of one GGUF tensor: ``blocks`` [O, row bytes] uint8 in the file's ``format``."""

    blocks: torch.Tensor
    format: int

    @property
    def rows(self) -> int:
        return self.blocks.shape[0] * (INT8_ROWS if self.format in INT8_FORMATS else 1)


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """A product's weight [O, I] held as GGUF blocks: one part per tensor stacked in it (q, k and v of
    a fused product; one otherwise), and its bias [O]. ``dense`` gives back the float32 weight exactly."""

    parts: tuple[BlockPart, ...]
    in_features: int
    bias: torch.Tensor | None
    isa: int
    # every input through the kernel, whatever its length (with int8 activations: each row's
    # arithmetic the same whatever rows it comes with); else inputs past direct_rows go by tiles
    rows_alike: bool = False
    direct_rows: int = DIRECT_ROWS  # the most rows the kernel multiplies itself (matmul.measure_direct_rows)
    out_features: int = field(init=False)  # the parts' rows together

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_features", sum(part.rows for part in self.parts))
        if any(part.format in INT8_FORMATS for part in self.parts):  # int8 parts have no tiled path
            object.__setattr__(self, "rows_alike", True)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    dtype = torch.float32  # what the products take and give

    @property
    def nbytes(self) -> int:
        return sum(part.blocks.nbytes for part in self.parts) + (0 if self.bias is None else self.bias.nbytes)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., N, I] float32 -> [..., N, O]."""
        rows = x.reshape(-1, self.in_features)  # [N, I]
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        # up to direct_rows (and every input, rows_alike): the kernel itself
        direct = rows.shape[0] <= self.direct_rows or self.rows_alike
        out = self.product(rows, self.direct if direct else self.tiled)  # [N, O]
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor, multiply: Callable) -> torch.Tensor:
        """rows [N, I] contiguous -> [N, O] without the bias, each part through ``multiply``."""
        out = rows.new_empty(rows.shape[0], self.out_features)  # [N, O]
        start = 0
        for part in self.parts:
            # [N, O_part], rows out.stride(0) apart; a single part (the usual case) writes out itself
            multiply(rows, part, out if len(self.parts) == 1 else out[:, start : start + part.rows])
            start += part.rows
        return out

    @property
    def crossing_key(self) -> str:
        """What ``direct_rows`` depends on: the shape and the parts' formats, e.g. "960x576:3"."""
        return f"{self.out_features}x{self.in_features}:" + "+".join(str(part.format) for part in self.parts)

    def direct(self, rows: torch.Tensor, part: BlockPart, columns: torch.Tensor) -> None:
        """A few rows: the kernel decodes each block once for all of them, into ``columns``."""
        torch.ops.specserve.blocks_times.default(rows, part.blocks, part.format, self.in_features, self.isa, columns)

    def tiled(self, rows: torch.Tensor, part: BlockPart, columns: torch.Tensor) -> None:
        """Many rows: decode ``part`` a tile of weight rows at a time and multiply in float32 into ``columns``."""
        step = max(1, TILE_BYTES // (4 * self.in_features))
        tile = rows.new_empty(min(step, part.rows), self.in_features)  # [T, I]
        for begin in range(0, part.rows, step):
            blocks = part.blocks[begin : begin + step]
            decoded = tile[: blocks.shape[0]]
            torch.ops.specserve.blocks_decode(blocks, part.format, self.in_features, self.isa, decoded)
            torch.mm(rows, decoded.T, out=columns[:, begin : begin + blocks.shape[0]])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] of a one-part weight, decoded from their blocks -> [T, I] float32: an
        embedding lookup in a table held as the tied LM head's blocks (a repacked group's one row)."""
        (part,) = self.parts
        out = torch.empty(ids.shape[0], self.in_features, device=part.blocks.device)  # [T, I]
        torch.ops.specserve.blocks_rows(part.blocks, part.format, ids.long(), self.in_features, self.isa, out)
        return out

    def dense(self) -> torch.Tensor:
        """The weight [O, I] in float32, as ``load`` produced it."""
        return torch.cat([decode(part, self.in_features, self.isa) for part in self.parts])


def layer_blocks(prepared: dict, products: list | None) -> tuple | None:
    """A decoder layer's products (q/k/v, o, gate/up, down, as (module, weight name)) as the
    arguments specserve::decode_layer takes for them, where each is held as one part of GGUF blocks
    (``prepared``: what ProductWeights holds) and only q/k/v has a bias; else None."""
    if products is None:
        return None
    held = [prepared.get((id(module), name)) for module, name in products]
    if not all(isinstance(weight, BlockWeight) and len(weight.parts) == 1 for weight in held):
        return None
    qkv, o, gate_up, down = held
    if any(weight.bias is not None for weight in (o, gate_up, down)):
        return None
    parts = [weight.parts[0] for weight in held]
    return (
        *(parts[0].blocks, parts[0].format, qkv.bias),
        *(value for part in parts[1:] for value in (part.blocks, part.format)),
        qkv.isa,
    )


def q8_blocks(weight: torch.Tensor, bias: torch.Tensor | None, isa: int, chunk: int = 2**18) -> BlockWeight:
    """``weight`` [O, I] (I a multiple of 32) as Q8_0 blocks (a quarter of its bytes), quantized by the gguf package
    ``chunk`` weights at a time (its temporaries: a few MB). Only for a draft's weights: not exact."""
    import gguf

    q8, rows = gguf.GGMLQuantizationType.Q8_0, max(1, chunk // weight.shape[1])
    parts = [gguf.quants.quantize(part.detach().float().cpu().numpy(), q8) for part in weight.split(rows)]
    data = torch.from_numpy(np.concatenate(parts))  # [O, row bytes]
    return BlockWeight((BlockPart(data, FORMATS["Q8_0"]),), weight.shape[1], bias, isa)


def decode(part: BlockPart, in_features: int, isa: int) -> torch.Tensor:
    """``part``'s weights [O, I] in float32."""
    out = torch.empty(part.rows, in_features)
    torch.ops.specserve.blocks_decode(part.blocks, part.format, in_features, isa, out)
    return out


@dataclass(frozen=True, slots=True)
class FileTensors:
    """A GGUF file's tensors in formats the kernels decode: name -> (GGML type id, blocks [O, row
    bytes] uint8, rows in the checkpoint's order), and its architecture."""

    arch: str
    tensors: dict[str, tuple[int, torch.Tensor]]

    @classmethod
    def read(cls, source) -> FileTensors:
        """``source``: a path, or a GGUFFile (engine/cpu/gguf_file.py) already open."""
        from .gguf_file import GGUFFile

        file = source if isinstance(source, GGUFFile) else GGUFFile(source)
        tensors = {}
        for name, info in file.tensors.items():
            if info.type in FORMATS.values():
                tensors[name] = (info.type, torch.from_numpy(np.array(file.raw(name))))  # copied out of the map
                file.forget(name)
        return cls(file.arch, tensors)


def match_blocks(
    file: FileTensors, hf_model: nn.Module, products: list[tuple[nn.Module, str, list[nn.Module]]]
) -> tuple[dict[tuple[int, str], BlockWeight], str]:
    """Each product of ``hf_model`` (module, weight name, and the linear layers stacked in it) whose
    weight the file holds in a format the kernels decode, and whose decoded blocks equal the loaded
    weight exactly (rows reordered to the loaded order), as a BlockWeight by (id(module), weight
    name); and a line saying what matched. Raises BlocksUnavailable where no kernel runs here."""
    import gguf

    isa = kernel_isa()
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(file.arch)
    if arch is None:
        return {}, f"float32 products: GGUF architecture {file.arch!r} has no tensor name map"
    names = gguf.get_tensor_name_map(arch, hf_model.config.num_hidden_layers)
    module_names = {id(module): name for name, module in hf_model.named_modules()}
    tied = getattr(hf_model.config, "tie_word_embeddings", False)
    found: dict[tuple[int, str], BlockWeight] = {}
    skipped: list[str] = []
    for module, name, parts_of in products:
        parts = []
        for linear in parts_of:
            gguf_name = names.get_name(module_names[id(linear)])
            tensor = file.tensors.get(f"{gguf_name}.weight")
            if tensor is None and gguf_name == "output" and tied:
                tensor = file.tensors.get("token_embd.weight")
            part = None if tensor is None else _matching_part(*tensor, linear.weight, isa)
            if part is None:
                skipped.append(module_names[id(linear)])
                break
            parts.append(part)
        else:
            weight = getattr(module, name)
            bias = getattr(module, name.replace("weight", "bias"), None)
            found[id(module), name] = BlockWeight(_merged(parts), weight.shape[1], bias, isa)
    formats = sorted({_format_name(part.format) for held in found.values() for part in held.parts})
    line = f"{len(found)}/{len(products)} products can read GGUF blocks ({', '.join(formats) or 'none'}; {ISAS[isa]} kernels)"
    if skipped:
        line += (
            f"; float32 where the blocks differ from the loaded weight or the format is not decoded: {skipped[0]}"
            + (f" and {len(skipped) - 1} more" if len(skipped) > 1 else "")
        )
    return found, line


def offer_blocks(model, file: FileTensors, repack: Callable[[dict], tuple[dict, str]] | None = None) -> None:
    """Offer a CausalLM's plan the blocks ``file`` holds for its products (a line says what matched),
    passed through ``repack`` where given: found blocks -> (blocks to hold, what it did, for the
    line); engine/cpu/int8_blocks.py's ``int8_activations`` and ``auto_activations`` are two.
    ``file`` is spent: the model holds what it uses (q, k and v stacked as one copy), the rest goes."""
    try:
        products = [(module, name, model.weights.parts(module, name)) for module, name in model.weights.products]
        found, line = match_blocks(file, model.hf_model, products)
    except BlocksUnavailable as error:
        found, line = {}, f"float32 products: {error}"
    file.tensors.clear()  # before a repack, so that each product's file blocks can go as it is repacked
    if repack is not None and found:
        release_freed_memory()  # what matching left (the file's q, k and v before stacking): not under a repack's peak
        found, note = repack(found)
        line += f"; {note}"
    log.info("GGUF blocks: %s", line)
    model.weights.offer_blocks(found, line)


def _merged(parts: list[BlockPart]) -> tuple[BlockPart, ...]:
    """Neighbouring parts of one format stacked into one (q, k and v as one call to the kernel)."""
    merged: list[BlockPart] = []
    for part in parts:
        if merged and merged[-1].format == part.format:
            merged[-1] = BlockPart(torch.cat([merged[-1].blocks, part.blocks]), part.format)
        else:
            merged.append(part)
    return tuple(merged)


def _format_name(format: int) -> str:
    return next((name for name, value in FORMATS.items() if value == format), "repacked for int8 activations")


def _matching_part(format: int, blocks: torch.Tensor, weight: torch.Tensor, isa: int) -> BlockPart | None:
    """``blocks`` [O, row bytes], rows in ``weight``'s order, where they decode to ``weight`` [O, I]
    exactly; else None."""
    if blocks.dim() != 2 or blocks.shape[0] != weight.shape[0]:
        return None
    if weight.is_meta:  # a model built from the file itself (engine/model/from_gguf.py): the blocks are its weight
        return BlockPart(blocks, format)
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    decoded = decode(BlockPart(blocks, format), weight.shape[1], isa)  # [O, I]
    if torch.equal(decoded, weight):
        return BlockPart(blocks, format)
    order = _row_order(decoded, weight)
    if order is None:
        return None
    return BlockPart(blocks[order].contiguous(), format)


def _row_order(decoded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The permutation ``order`` [O] with decoded[order] == weight bit for bit, if there is one. Rows
    are matched by a hash of their bits, then compared in full."""
    mix = torch.randint(1, 2**31 - 1, (decoded.shape[1],), generator=torch.Generator().manual_seed(0))  # [I]
    decoded_keys = (decoded.view(torch.int32).long() * mix).sum(1).tolist()  # [O]
    weight_keys = (weight.view(torch.int32).long() * mix).sum(1).tolist()  # [O]
    where = {key: row for row, key in enumerate(decoded_keys)}
    if len(where) != len(decoded_keys) or any(key not in where for key in weight_keys):
        return None
    order = torch.tensor([where[key] for key in weight_keys])  # [O]
    return order if torch.equal(decoded[order], weight) else None
