"""The forms a model's product weights are held in, and the products through them.

A product's weight is held as the checkpoint holds it (multiplied in the formulation a
``MatmulPlan`` measured fastest), packed by oneDNN where the plan chose that (``PackedWeight``), as
the GGUF file's own blocks wherever the file holds them (``BlockWeight``, engine/cpu/blocks.py: every
row through the kernel, so a row's bits never depend on its neighbours), or as int8
rows with a scale each (``Int8Weight``: only for drafts, a different model). Whatever the form,
``ProductWeights.linear`` computes the same product, and ``dense`` gives the weight back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..cpu.blocks import BlockWeight, layer_blocks
from ..cpu.matmul import BLOCKS, PACKED, MatmulPlan, PackedWeight, weight_key, with_direct_rows
from ..cpu.plan_cache import PlanCache
from ..errors import ConfigError

# the linear layers each layer runs as one product (``fuse_linears``): attention's, then the MLP's
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A weight [O, I] as int8 rows and one scale per row (symmetric: w ~ scale * q, q in -127..127),
    read by torch's weight-only int8 kernel at a quarter of float32's bytes."""

    values: torch.Tensor  # [O, I] int8
    scales: torch.Tensor  # [O] in the activations' dtype
    bias: torch.Tensor | None = None  # [O]

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, block_rows: int = 1024) -> Int8Weight:
        """weight [O, I] -> its int8 rows, each scaled by its largest magnitude over 127 (a block of
        rows at a time, divided and rounded in place: an LM head needs no float32 copy of itself,
        and start-up, quantizing in the engine's thread, leaves no trail of freed temporaries in
        that thread's allocator arena; with new ones each time it grew 470 MB there)."""
        values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)  # [O, I]
        scales = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)  # [O]
        for start in range(0, weight.shape[0], block_rows):
            rows = weight[start : start + block_rows].to(torch.float32, copy=True)  # [B, I]
            largest = rows.abs().amax(dim=1).clamp(min=1e-30)  # [B]
            # the scale as the kernel reads it (in the weight's dtype), rounded up so 127 steps reach the largest
            scale = (largest / 127).to(weight.dtype)  # [B]
            scale = torch.where(scale.float() * 127 < largest, torch.nextafter(scale, scale.new_tensor(1e30)), scale)
            values[start : start + block_rows] = rows.div_(scale.float()[:, None]).round_().clamp_(-127, 127)
            scales[start : start + block_rows] = scale
        return cls(values, scales, bias)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., N, I] -> [..., N, O]."""
        rows = x.reshape(-1, x.shape[-1])  # [N, I]
        out = torch._weight_int8pack_mm(rows, self.values, self.scales).view(*x.shape[:-1], self.values.shape[0])
        return out if self.bias is None else out + self.bias


class ProductWeights:
    """Every product one forward makes, as (module, weight attribute), and the form each weight is
    held in. It owns the weights: ``use_plan`` and ``quantize_int8`` free the copies they replace.
    ``keep``, the embedding table, which a tied LM head shares, is freed only where that head is
    held as one part of GGUF blocks: lookups then decode their rows from them (``embedding_rows``)."""

    def __init__(self, products: list[tuple[nn.Module, str]], keep: torch.Tensor, device: torch.device) -> None:
        self.products = products
        self.keep = keep  # empty ("meta") in a model built from its GGUF file whose tied head holds the rows
        self.device = device
        # each product's weight as a shape (the weights themselves may be freed or never made)
        self.shapes = [torch.empty(getattr(m, n).shape, dtype=getattr(m, n).dtype, device="meta") for m, n in products]
        # the product whose weight is the embedding table (a tied LM head), as (id(module), name)
        self._tied = next(((id(module), name) for module, name in products if getattr(module, name) is keep), None)
        self.plan = MatmulPlan()  # CPU products by row count; measured at warm-up (until then F.linear)
        self.plan_key = ""  # what the plan is stored under in a PlanCache ("": not stored)
        # weights held in another form, by (id(module), weight name): int8 rows, packed by oneDNN, GGUF blocks
        self.prepared: dict[tuple[int, str], Int8Weight | PackedWeight | BlockWeight] = {}
        self._layers: dict[int, tuple] = {}  # ``layer_arguments`` built, by id of the products: (products, arguments)
        self.int8 = False  # every product through int8 rows, none through the plan
        # the GGUF blocks each product can be held as (``offer_blocks``), and what became of them, in a line
        self.blocks: dict[tuple[int, str], BlockWeight] = {}
        self.blocks_line = ""
        # a GGUF target's products go through their blocks' kernels at every row count, so a row's
        # arithmetic never depends on the rows beside it: a position's logits are the same bits from a
        # prompt pass, a decode step or a verify (and with int8 activations a last-bit difference
        # could otherwise move a rounding to int8)
        self.rows_alike = False

    @property
    def nbytes(self) -> int:
        """What the weights held in another form take, beyond the modules' own parameters."""
        return sum(weight.nbytes for weight in self.prepared.values())

    def linear(self, x: torch.Tensor, module: nn.Module, name: str) -> torch.Tensor:
        """x [..., N, I] times ``module``'s weight ``name`` (and its bias, if any) -> [..., N, O]:
        through the form ``prepared`` holds it in, else in the ``MatmulPlan``'s formulation."""
        held = self.prepared.get((id(module), name)) if self.prepared else None
        if held is not None:
            return held.linear(x)
        return self.plan.linear(x, getattr(module, name), _bias(module, name))

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """ids [T] -> their rows of the embedding table [T, E], decoded from the tied LM head's GGUF
        blocks (the same values) where the table itself is freed; None where it is held."""
        if self.keep.numel() and not self.keep.is_meta:
            return None
        return self.prepared[self._tied].rows(ids)

    def linear_weights(self) -> list[torch.Tensor]:
        """The floating-point weights the products multiply by, as the checkpoint holds them (the
        ones a plan times); none held in another form."""
        return [getattr(module, name) for module, name in self.products if (id(module), name) not in self.prepared]

    def dense(self, module: nn.Module, name: str) -> torch.Tensor:
        """A product's weight [O, I] as a plain tensor, wherever it is held packed or as blocks (int8
        rows: the quantized model has no other)."""
        held = self.prepared.get((id(module), name))
        return held.dense() if isinstance(held, PackedWeight | BlockWeight) else getattr(module, name)

    def describe(self) -> str:
        """How the products run: "int8 rows", or what the ``MatmulPlan`` chose (and the GGUF blocks' line)."""
        if self.int8:
            return "int8 rows"
        return self.plan.describe() + (f" [{self.blocks_line}]" if self.blocks_line else "")

    def parts(self, module: nn.Module, name: str) -> list[nn.Module]:
        """The linear layers whose weights a product stacks (q, k and v for a fused one; else its own)."""
        return _fused_parts(module, name) or [module]

    def offer_blocks(self, blocks: dict[tuple[int, str], BlockWeight], line: str) -> None:
        """Hold these products as GGUF blocks, each multiplied by its kernel at every row count
        (``rows_alike``), never by decoded tiles or BLAS, whose sums depend on how rows are grouped."""
        self.blocks = {key: replace(held, rows_alike=True) for key, held in blocks.items()}
        self.blocks_line = line
        self.rows_alike = bool(blocks)
        if blocks:  # held so from now on: their float32 copies are freed now (a model built from the file has none)
            self.use_plan(MatmulPlan.uniform(BLOCKS, 1, self.shapes))  # warm-up plans the rows it runs

    def blocks_by_shape(self) -> dict:
        """The offered GGUF blocks grouped by weight key, as ``MatmulPlan.measure`` times them."""
        by_shape: dict = {}
        for held in self.blocks.values():
            by_shape.setdefault(weight_key(held), []).append(held)
        return by_shape

    def plan_matmuls(self, max_rows: int, cache: PlanCache | None = None) -> MatmulPlan:
        """On CPU, measure which formulation is fastest for each weight shape at 1..max_rows rows
        (decode and verify shapes) and use it from now on (a plan already measured that far stays);
        with a ``cache``, read the plan stored for this host and these weights instead, or store
        the one measured. Elsewhere products stay F.linear."""
        if self.device.type == "cpu" and not self.int8 and self.plan.max_rows < max_rows:
            if self.rows_alike:  # every product through its blocks, unmeasured: each row computed alike
                self.use_plan(MatmulPlan.uniform(BLOCKS, max_rows, self.shapes))
                return self.plan
            self.use_plan(MatmulPlan())  # measured on the weights as the checkpoint holds them
            by_shape = self.blocks_by_shape()
            weights = self.linear_weights()
            key = cache.key([weight_key(w) for w in weights], list(by_shape), max_rows) if cache else ""
            self.plan_key = key
            plan = cache.load(key) if cache else None
            # the stored plan's, else measured now: before the plan, so it times long inputs as they will run
            direct_rows = plan.direct_rows if plan else {}
            self.blocks = with_direct_rows(self.blocks, direct_rows)
            if plan is None:
                plan = MatmulPlan.measure(weights, max_rows, blocks=self.blocks_by_shape())
                plan.direct_rows = direct_rows
                if cache:
                    cache.save(key, plan)
            self.use_plan(plan)
        return self.plan

    def layer_arguments(self, products: list | None) -> tuple | None:
        """specserve::decode_layer's arguments for a layer's products (``layer_blocks``), built once
        while ``prepared`` holds the same weights (only use_plan changes it, and forgets them;
        quantize_int8 through it): a step asks once a layer, and building them anew cost 0.27-0.29 ms."""
        if products is None:
            return None
        kept = self._layers.get(id(products))
        if kept is None or kept[0] is not products:
            kept = self._layers[id(products)] = (products, layer_blocks(self.prepared, products))
        return kept[1]

    def use_plan(self, plan: MatmulPlan) -> None:
        """Run products as ``plan`` says. A weight it holds in another form (packed, or as the GGUF
        blocks offered for it) is held so and its dense copy freed; a weight held so that it does
        not hold so is made dense again, exactly as it was."""
        self._layers.clear()
        for module, name in self.products:
            held = self.prepared.get((id(module), name))
            if isinstance(held, Int8Weight):
                raise ConfigError("an int8 model's products run through its int8 rows, not a matmul plan")
            weight = held if held is not None else getattr(module, name)
            form = plan.held_form(weight)
            if form == BLOCKS and (id(module), name) not in self.blocks:
                form = None  # a weight of a shape the blocks won whose tensor the file does not hold as blocks
            current = PACKED if isinstance(held, PackedWeight) else BLOCKS if isinstance(held, BlockWeight) else None
            if current == form:
                continue
            if held is not None:
                self._restore(module, name, self.prepared.pop((id(module), name)).dense())
            if form == PACKED:
                self.prepared[id(module), name] = PackedWeight.pack(weight, _bias(module, name), plan.max_rows)
            elif form == BLOCKS:
                self.prepared[id(module), name] = self.blocks[id(module), name]
            if form is not None:
                self._release(module, name)
        self.plan = plan

    def quantize_int8(self) -> None:
        """Hold every product's weight as int8 rows with one scale each, and free the floating-point
        copy. A different model, so only for drafts: verification keeps the output the target's."""
        device, dtype = self.device, self.keep.dtype
        if device.type != "cpu" or dtype != torch.bfloat16:
            raise ConfigError(f"int8 weights need a bfloat16 model on CPU, got {dtype} on {device}")
        self.use_plan(MatmulPlan())
        for module, name in self.products:
            self.prepared[id(module), name] = Int8Weight.quantize(getattr(module, name), _bias(module, name))
            self._release(module, name)
        self.int8 = True

    def _release(self, module: nn.Module, name: str) -> None:
        """Free a product's floating-point weight, now held in another form: the tensor and, for a
        fused weight, the layers' weights that are views of it."""
        weight = getattr(module, name)
        held = self.prepared.get((id(module), name))
        if weight is self.keep and not (isinstance(held, BlockWeight) and len(held.parts) == 1):
            return  # the embedding table, whose rows only one part of blocks can give instead
        for tensor in [weight, *(linear.weight for linear in _fused_parts(module, name))]:
            tensor.data = weight.new_empty(0)

    def _restore(self, module: nn.Module, name: str, dense: torch.Tensor) -> None:
        """Undo ``_release`` with the weight ``dense`` [O, I]: the fused layers' weights are views again."""
        weight = getattr(module, name)
        if weight is self.keep and weight.numel():  # the embedding table, held all along
            return
        weight.data = dense
        parts = _fused_parts(module, name)
        if parts:
            _view_parts(parts, getattr(module, name.replace("weight", "rows")), dense)


def _bias(module: nn.Module, name: str) -> torch.Tensor | None:
    return getattr(module, name.replace("weight", "bias"), None)


def fuse_linears(module: nn.Module, names: tuple[str, ...], fused: str) -> None:
    """Give ``module`` one weight ``{fused}_weight`` [sum of O, I] (and bias) stacking the named
    linear layers, whose weights become views of it: one matrix product instead of several, and no
    second copy in memory. Idempotent: a module already fused keeps its tensors."""
    linears = [getattr(module, name) for name in names]
    weight = getattr(module, f"{fused}_weight", None)
    if weight is not None and linears[0].weight.data_ptr() == weight.data_ptr():
        return
    rows = tuple(linear.weight.shape[0] for linear in linears)
    first = linears[0].weight
    if first.is_meta:  # weights a model built from its GGUF file holds as blocks (meta ops import torch._dynamo)
        weight = torch.empty(sum(rows), first.shape[1], dtype=first.dtype, device="meta")  # [sum O, I]
    else:
        weight = torch.cat([linear.weight.data for linear in linears])  # [sum O, I]
    biases = [linear.bias for linear in linears]
    bias = None if any(b is None for b in biases) else torch.cat([b.data for b in biases])  # [sum O]
    _view_parts(linears, rows, weight, bias)
    setattr(module, f"{fused}_weight", weight)
    setattr(module, f"{fused}_bias", bias)
    setattr(module, f"{fused}_rows", rows)  # how to split it again (``ProductWeights._restore``)


def _view_parts(
    linears: list[nn.Module], rows: tuple[int, ...], weight: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """Make each linear layer's weight (and bias) the view of its ``rows`` of the stacked ``weight``
    [sum O, I] (and ``bias`` [sum O])."""
    for linear, part in zip(linears, weight.split(rows), strict=True):
        linear.weight.data = part
    if bias is not None:
        for linear, part in zip(linears, bias.split(rows), strict=True):
            linear.bias.data = part


def _fused_parts(module: nn.Module, name: str) -> list[nn.Module]:
    """The linear layers whose weights are views of ``module``'s fused weight ``name`` (none for others)."""
    return [getattr(module, part) for part in FUSED.get(name.removesuffix("_weight"), ())]
