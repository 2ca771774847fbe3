"""A decoder layer's products, and every layer of a step as specserve::decode_layers takes them.

``CausalLM`` runs a decode or verify step whose layers' products are all GGUF blocks as one call of
``specserve::decode_layers`` (engine/cpu/csrc/forward_ops.cpp): each layer's decode_layer in turn, in C++.
Called from Python once a layer, with 23 arguments each, the calls and their arguments took more of a
step than anything but the kernels. ``LayerStack`` keeps the per-layer lists the op takes for a run of
layers, while each layer's arguments (``ProductWeights.layer_arguments``) are the same tuples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def layer_products(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """A decoder layer's products as (module, weight attribute): q/k/v as one, o, gate/up as one, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn, "qkv_weight"), (attn.o_proj, "weight"), (mlp, "gate_up_weight"), (mlp.down_proj, "weight")]


class LayerStack:
    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[list, tuple]] = {}  # by (layers, kept layers): (their arguments, the op's)

    def arguments(self, model, layers: Sequence[int]) -> tuple | None:
        """specserve::decode_layers' arguments from its norms' weights to ``feature_slots`` but the
        ones a step gives (cos, sin, the cache, start, mask, scale, features), in the op's order, for
        ``layers`` of ``model`` (a CausalLM); None where one of them is not a fused layer."""
        per_layer = [model.weights.layer_arguments(model._layer_products[index]) for index in layers]
        if not per_layer or any(arguments is None for arguments in per_layer):
            return None
        isa = per_layer[0][-1]
        if any(arguments[-1] != isa for arguments in per_layer):
            return None
        key = (tuple(layers), model.aux_layers)
        kept = self._kept.get(key)
        if kept is None or any(old is not new for old, new in zip(kept[0], per_layer, strict=True)):
            # decode_layer's arguments for one layer: q/k/v blocks, format, bias; o, gate/up, down blocks and formats; isa
            front = (
                [model.layers[index].input_layernorm.weight for index in layers],
                [model.layers[index].post_attention_layernorm.weight for index in layers],
                model.norm_eps,
                [arguments[at] for arguments in per_layer for at in (0, 3, 5, 7)],
                [arguments[at] for arguments in per_layer for at in (1, 4, 6, 8)],
                [arguments[2] for arguments in per_layer],
                isa,
            )
            slots = [model.aux_layers.index(index) if index in model.aux_layers else -1 for index in layers]
            kept = self._kept[key] = (per_layer, (front, slots))
        return kept[1]

    def run(self, model, hidden: torch.Tensor, layers: Sequence[int], cos, sin, start: int, mask) -> tuple | None:
        """``layers`` of ``model`` over ``hidden`` [1, T, E] at positions [start, start + T) in one call: (the
        residual stream, what the last layer adds to it), each [1, T, E]; None where one is not a fused layer."""
        stacked = self.arguments(model, layers)
        if stacked is None:
            return None
        (front, slots), caches = stacked, [model.cache.layer(index) for index in layers]
        return torch.ops.specserve.decode_layers.default(
            hidden, *front, cos, sin, [keys for keys, _ in caches], [values for _, values in caches],
            model.num_heads, start, mask, model.scaling, model.features, slots
        )  # fmt: skip
