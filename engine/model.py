"""A lean forward pass for Llama-family decoders, over Hugging Face modules and weights.

It reuses the checkpoint's own modules (norms, projections, MLP) and replaces what makes the
stock forward slow at batch size 1: cache bookkeeping, mask building and rotary recomputation.
Keys and values go into a preallocated ``KVCache``; attention reads only the live prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError
from .kv import KVCache

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# On CPU, a matrix product with 4 or more rows through a wide LM head (49k x 576 for SmolLM2) takes
# a slow path: 5 rows cost 2.2x one row, 8 rows 3.4x. In vocabulary slices of 1024 rows, both cost
# about 1.9x (bench/matmul.py measures both and guards this choice).
LM_HEAD_SLICE_MIN_ROWS = 4
LM_HEAD_SLICE = 1024


class UnsupportedModel(ConfigError):
    pass


class CausalLM:
    """One model, its KV cache, and ``extend``: feed tokens, get logits."""

    def __init__(self, hf_model: nn.Module, max_len: int) -> None:
        config = hf_model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"model type {config.model_type!r} is not supported; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        hf_model.eval().requires_grad_(False)
        self.hf_model = hf_model
        self.config = config
        body = hf_model.model
        self.embed = body.embed_tokens
        self.layers = list(body.layers)
        self.norm = body.norm
        self.lm_head = hf_model.lm_head
        param = next(hf_model.parameters())
        self.device, self.dtype = param.device, param.dtype
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = attn.scaling
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_len = max_len
        self.fault: Callable[[torch.Tensor], torch.Tensor] | None = None  # test hook: applied once to the next logits
        self.last_hidden: torch.Tensor | None = None  # [N, E] normalised final hidden states of the last extend
        self._last_hidden_end = 0  # the position after the last row of last_hidden
        self.cache = KVCache(len(self.layers), self.num_kv_heads, self.head_dim, max_len, self.dtype, self.device)
        # Rotary tables for every position, computed once by the checkpoint's own rotary module.
        positions = torch.arange(max_len, device=self.device)[None]  # [1, S]
        cos, sin = body.rotary_emb(torch.empty(0, device=self.device, dtype=self.dtype), positions)
        self.cos, self.sin = cos[0], sin[0]  # [S, D]

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.hf_model.parameters())

    @torch.inference_mode()
    def extend(self, token_ids: list[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``token_ids`` to the cache and return logits [num_logits, V] for the last positions."""
        start = self.cache.length
        hidden = self._body(self._input(token_ids, start), start, range(len(self.layers)))  # [T, E]
        self.cache.token_ids.extend(token_ids)
        self.last_hidden = self.norm(hidden[-num_logits:])  # [N, E] normalised, for drafters reading features
        self._last_hidden_end = start + len(token_ids)
        logits = self.logits(self.last_hidden)  # [N, V]
        if self.fault is not None:
            fault, self.fault = self.fault, None
            logits = fault(logits)
        return logits

    def hidden_at(self, position: int) -> torch.Tensor | None:
        """The normalised final hidden state [E] at ``position`` from the last extend, if it computed one."""
        if self.last_hidden is None:
            return None
        row = position - (self._last_hidden_end - self.last_hidden.shape[0])
        return self.last_hidden[row].clone() if 0 <= row < self.last_hidden.shape[0] else None

    @torch.inference_mode()
    def draft_through(
        self, token_ids: list[int], start: int, layers: Sequence[int], num_logits: int = 1
    ) -> torch.Tensor:
        """Run only ``layers`` over tokens at positions [start, start+T), writing those layers' KV
        there without advancing the cache; the next ``extend`` over these positions overwrites it."""
        hidden = self._body(self._input(token_ids, start), start, layers)  # [T, E]
        return self.logits(self.norm(hidden[-num_logits:]))  # [N, V]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalised hidden states [N, E] -> logits [N, V], in the formulation measured fastest."""
        if self.device.type != "cpu" or hidden.shape[0] < LM_HEAD_SLICE_MIN_ROWS:
            return self.lm_head(hidden)
        return sliced_linear(hidden, self.lm_head.weight, self.lm_head.bias, LM_HEAD_SLICE)

    def _input(self, token_ids: list[int], start: int) -> torch.Tensor:
        if start + len(token_ids) > self.max_len:
            raise ValueError(f"sequence of {start + len(token_ids)} tokens exceeds the cache of {self.max_len}")
        return torch.tensor(token_ids, device=self.device)  # [T]

    def _body(self, input_ids: torch.Tensor, start: int, layers: Sequence[int]) -> torch.Tensor:
        num_new = input_ids.shape[0]
        end = start + num_new
        cos, sin = self.cos[start:end], self.sin[start:end]  # [T, D]
        mask = None
        if num_new > 1:  # query i (at position start+i) sees keys [0, start+i]
            keys_pos = torch.arange(end, device=self.device)  # [S']
            mask = keys_pos[None, :] <= (start + torch.arange(num_new, device=self.device))[:, None]  # [T, S']
        hidden = self.embed(input_ids)[None]  # [1, T, E]
        for index in layers:
            layer = self.layers[index]
            hidden = hidden + self._attention(
                layer.self_attn, layer.input_layernorm(hidden), index, start, cos, sin, mask
            )
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden[0]  # [T, E]

    def _attention(self, attn, x, index, start, cos, sin, mask) -> torch.Tensor:
        num_new = x.shape[1]
        q = attn.q_proj(x).view(1, num_new, self.num_heads, self.head_dim)  # [1, T, H, D]
        k = attn.k_proj(x).view(1, num_new, self.num_kv_heads, self.head_dim)  # [1, T, H_kv, D]
        v = attn.v_proj(x).view(1, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, H_kv, T, D]
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = _rotate(q.transpose(1, 2), cos, sin)  # [1, H, T, D]
        k = _rotate(k.transpose(1, 2), cos, sin)  # [1, H_kv, T, D]
        keys, values = self.cache.write(index, start, k, v)  # [1, H_kv, S', D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(1, num_new, -1))  # [1, T, E]


def sliced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """F.linear(x, weight, bias) computed over ``rows``-row slices of ``weight``. x [N, E] -> [N, O]."""
    return torch.cat(
        [
            F.linear(x, weight[start : start + rows], None if bias is None else bias[start : start + rows])
            for start in range(0, weight.shape[0], rows)
        ],
        dim=-1,
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with half-split pairs, as in the Llama checkpoints. x [1, H, T, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
