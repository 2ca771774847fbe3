"""transformers' Llama RMSNorm and rotary embedding, op for op, without its modeling code.

Importing ``transformers.models.llama.modeling_llama`` imports torch._dynamo and torch's
distributed tensors with it: 200 MB of a server's memory before any model is read. The engine's
forward (engine/model/model.py) needs only these two modules of a checkpoint it builds itself (a
GGUF target, an EAGLE-3 head); each computes exactly what transformers' does, so a model built
from them gives the same bits as one transformers built.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

# RoPE types whose frequencies transformers changes with the sequence's length as it runs: its own module
DYNAMIC_ROPE = ("dynamic", "longrope")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


class Rotary(nn.Module):
    """(cos, sin) [1, S, D] at positions [1, S], for ``config``'s RoPE (its ``rope_parameters``)."""

    def __init__(self, config) -> None:
        super().__init__()
        rope = config.rope_parameters
        if rope["rope_type"] == "default":
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [D/2]
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # [1, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [1, S, D]
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotary(config) -> nn.Module:
    """The rotary module for ``config``: transformers' own where its RoPE changes as it runs."""
    if config.rope_parameters["rope_type"] in DYNAMIC_ROPE:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding(config)
    return Rotary(config)


def rotary_of(fields: dict, head_dim: int, max_len: int) -> nn.Module:
    """The rotary module for a checkpoint's ``config.json`` fields (an EAGLE-3 head's): plain RoPE
    from its theta, as transformers reads it (``rope_parameters``, or the older ``rope_theta`` and
    ``rope_scaling``); any other RoPE through transformers' config, whose import costs 60 MB."""
    rope = fields.get("rope_parameters") or {
        **(fields.get("rope_scaling") or {}),
        "rope_theta": fields.get("rope_theta"),
    }
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        theta = rope.get("rope_theta") or 10000.0  # LlamaConfig's default
        return Rotary(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": theta}, head_dim=head_dim))
    from transformers import LlamaConfig

    return rotary(LlamaConfig(**{**fields, "head_dim": head_dim, "max_position_embeddings": max_len}))
