"""A lean forward pass for Llama-family decoders, over Hugging Face modules and weights.

It reuses the checkpoint's own modules (norms, projections, MLP) and replaces what makes the
stock forward slow at batch size 1: cache bookkeeping, mask building and rotary recomputation.
Keys and values go into a preallocated ``KVCache``.

One forward, two ways to call it. Eagerly, attention reads exactly the live prefix. Statically
(``static_forward``), every shape depends only on the number of new tokens and a window of the
cache chosen from a few sizes, and positions are a tensor, so ``engine/model/runner.py`` can compile it or
capture it as a CUDA graph once per query length and window and replay it at any position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..cpu.blocks import DIRECT_ROWS, native_ops_available
from ..errors import ConfigError
from .attention import attend, native_attention
from .kernels import Pointwise
from .kv import KVCache, lazy_zeros
from .layer_stack import LayerStack, layer_products
from .weights import FUSED, ProductWeights, fuse_linears

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class UnsupportedModel(ConfigError):
    pass


class CausalLM:
    """One model, its KV cache, and ``extend``: feed tokens, get logits. It owns ``hf_model``: ``weights``
    (``engine/model/weights.py``) may hold its products' weights in another form and free the modules' own."""

    sequence_fields = ("cache", "features", "last_hidden", "_last_hidden_end")  # one sequence's (model/slots.py)

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
        param = next(p for p in hf_model.parameters() if not p.is_meta)  # a product's may be its file's blocks
        self.device, self.dtype = param.device, param.dtype
        for layer in self.layers:  # one matrix product for q, k, v and one for gate, up (fewer kernels)
            for module, (fused, names) in zip((layer.self_attn, layer.mlp), FUSED.items(), strict=True):
                fuse_linears(module, names, fused)
        # Qwen3 normalises each query and key head before rotary: its layers' (q_norm, k_norm), by layer
        self.head_norms = {
            i: (layer.self_attn.q_norm, layer.self_attn.k_norm)
            for i, layer in enumerate(self.layers)
            if hasattr(layer.self_attn, "q_norm")
        }
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = attn.scaling
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_len = max_len
        self.last_hidden: torch.Tensor | None = None  # [N, E] normalised final hidden states of the last extend
        self._last_hidden_end = 0  # the position after the last row of last_hidden
        # layers whose incoming residual stream every forward also writes, by position, into
        # ``features`` (an EAGLE-3 head's; ``keep_features``); positions below the cache's length hold
        # the streams of the committed tokens, as its keys and values do
        self.aux_layers: tuple[int, ...] = ()
        self.features: torch.Tensor | None = None  # [A, S, E]
        self.cache = KVCache(len(self.layers), self.num_kv_heads, self.head_dim, max_len, self.dtype, self.device)
        # Rotary tables for every position, computed once by the checkpoint's own rotary module.
        positions = torch.arange(max_len, device=self.device)[None]  # [1, S]
        cos, sin = body.rotary_emb(torch.empty(0, device=self.device, dtype=self.dtype), positions)
        self.cos, self.sin = cos[0], sin[0]  # [S, D]
        self.positions = positions[0]  # [S] 0..S-1, sliced for the positions of new tokens
        self.runner = None  # a runner.GraphRunner replaying decode-shaped forwards; None: always eager
        # the pointwise work between products (norms, residuals, rotary, the MLP's gate), eager
        # until ``use_kernels`` compiles it; every layer's norms share the final norm's epsilon
        # (the config's), and every layer's MLP has the same stateless activation
        self.norm_eps = self.norm.variance_epsilon
        norms = [norm for layer in self.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(norm.variance_epsilon != self.norm_eps for norm in norms):
            raise UnsupportedModel("the layers' RMSNorms must share one epsilon (the config's rms_norm_eps)")
        self.activation = self.layers[0].mlp.act_fn
        self.silu = getattr(config, "hidden_act", None) in ("silu", "swish")
        self.kernels = Pointwise.eager(self.norm_eps, self.activation, self._native_kernels(), self.silu)
        self.weights = ProductWeights(self._products(), self.embed.weight, self.device)
        # per layer, its products as (module, weight name): q/k/v, o, gate/up, down; none where the
        # fused layer (specserve::decode_layer) does not apply (Qwen3's head norms, another activation)
        self._layer_products = [
            layer_products(layer) if self.silu and i not in self.head_norms else None
            for i, layer in enumerate(self.layers)
        ]
        self._stack = LayerStack()  # all of a step's fused layers as one call's arguments

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.hf_model.parameters() if not p.is_meta) + self.weights.nbytes

    @torch.inference_mode()
    def extend(self, token_ids: list[int] | torch.Tensor, num_logits: int = 1) -> torch.Tensor:
        """Append ``token_ids`` (a list, or a [T] device tensor of sampled tokens) to the cache and
        return logits [num_logits, V] for the last positions (none: a read for the cache alone)."""
        start = self.cache.length
        hidden, logits = self._forward(self._input(token_ids, start), start, None, num_logits)  # [N, E], [N, V]
        self.cache.append(token_ids if isinstance(token_ids, list) else token_ids.shape[0])
        self.last_hidden = hidden  # [N, E] normalised, for drafters reading features
        self._last_hidden_end = self.cache.length
        return logits

    @torch.inference_mode()
    def read(self, token_ids: list[int]) -> torch.Tensor:
        """Append ``token_ids`` to the cache; the normalised final hidden states [N, E] of all, no logits."""
        start, end = self.cache.length, self.cache.length + len(token_ids)
        input_ids, positions = self._input(token_ids, start), self.positions[start:end]  # [N], [N]
        hidden = self._body(input_ids, positions, end, self.all_layers, True, end - start, start=start)  # [N, E]
        self.cache.append(token_ids)
        return hidden

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, E]: the embedding's rows, from the GGUF blocks of the LM head tied to
        it where the plan holds that head so (the table's float32 copy is then freed)."""
        rows = self.weights.embedding_rows(input_ids)  # [T, E] or None
        return self.embed(input_ids) if rows is None else rows

    def keep_features(self, layers: tuple[int, ...]) -> None:
        """From now on every forward (eager, compiled or replayed) also writes the residual stream
        entering ``layers`` at its positions. Set before a runner compiles or captures: the layers
        are part of what it traces."""
        if tuple(sorted(layers)) == self.aux_layers:
            return
        self.aux_layers = tuple(sorted(layers))
        if self.runner is not None:
            self.runner.forget()
        shape = (len(layers), self.max_len, self.config.hidden_size)
        self.features = lazy_zeros(shape, self.dtype, self.device) if layers else None

    def feature_rows(self, start: int, end: int) -> torch.Tensor:
        """The kept streams [end - start, A*E] of committed positions [start, end), lowest layer first."""
        if self.features is None or not 0 <= start <= end <= self.cache.length:
            raise ValueError(f"no features for positions [{start}, {end}) of {self.cache.length} committed")
        return self.features[:, start:end].transpose(0, 1).flatten(1)

    def hidden_at(self, position: int) -> torch.Tensor | None:
        """The normalised final hidden state [E] at ``position`` from the last extend, if it computed one."""
        if self.last_hidden is None:
            return None
        row = position - (self._last_hidden_end - self.last_hidden.shape[0])
        return self.last_hidden[row].clone() if 0 <= row < self.last_hidden.shape[0] else None

    @torch.inference_mode()
    def draft_through(
        self, token_ids: list[int] | torch.Tensor, start: int, layers: Sequence[int], num_logits: int = 1
    ) -> torch.Tensor:
        """Run only ``layers`` over tokens at positions [start, start+T), writing those layers' KV
        there without advancing the cache; the next ``extend`` over these positions overwrites it."""
        _, logits = self._forward(self._input(token_ids, start), start, tuple(layers), num_logits)
        return logits  # [N, V]

    def _forward(
        self,
        input_ids: torch.Tensor,
        start: int,
        layers: tuple[int, ...] | None,
        num_logits: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised hidden [N, E], logits [N, V]) of the last ``num_logits`` of the new tokens."""
        layers = layers if layers is not None else self.all_layers
        if self.runner is not None and self.runner.handles(input_ids.shape[0]):
            hidden, logits = self.runner.run(input_ids, start, layers)  # [T, E], [T, V]
            first = hidden.shape[0] - num_logits
            return hidden[first:], logits[first:]
        end = start + input_ids.shape[0]
        masked = input_ids.shape[0] > 1
        hidden = self._body(
            input_ids, self.positions[start:end], end, layers, masked, num_logits, start=start
        )  # [N, E]
        return hidden, self.logits(hidden)

    def static_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        window: int,
        layers: tuple[int, ...],
        chunks: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] at positions [T] -> (normalised hidden [T, E], logits [T, V]), attending
        over the first ``window`` cache positions under a causal mask, by ``split_attention`` in
        ``chunks`` chunks (0: one SDPA call). Shapes depend only on T and ``window``: this
        is what the runner compiles or captures."""
        hidden = self._body(input_ids, positions, window, layers, True, input_ids.shape[0], chunks)
        return hidden, self.logits(hidden)  # [T, E], [T, V]

    @property
    def all_layers(self) -> tuple[int, ...]:
        return tuple(range(len(self.layers)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalised hidden states [N, E] -> logits [N, V]."""
        if hidden.shape[0] == 0:  # a read for the cache alone (extend with num_logits=0)
            return hidden.new_empty(0, self.vocab_size)
        return self.weights.linear(hidden, self.lm_head, "weight")

    def _products(self) -> list[tuple[nn.Module, str]]:
        """Every product a forward makes, as (module, weight attribute): the LM head, then each layer's."""
        return [(self.lm_head, "weight")] + [product for layer in self.layers for product in layer_products(layer)]

    def _input(self, token_ids: list[int] | torch.Tensor, start: int) -> torch.Tensor:
        num_new = len(token_ids) if isinstance(token_ids, list) else token_ids.shape[0]
        if start + num_new > self.max_len:
            raise ValueError(f"sequence of {start + num_new} tokens exceeds the cache of {self.max_len}")
        return token_ids if isinstance(token_ids, torch.Tensor) else self.upload(token_ids)

    def upload(self, token_ids: list[int]) -> torch.Tensor:
        return upload(token_ids, self.device)

    def use_kernels(self, mode: str, backend: str = "inductor", native: bool = True) -> None:
        """Run the pointwise work between products eagerly ("eager") or fused by torch.compile with
        ``backend`` ("compiled", each function compiled for this model on its first call). ``native``:
        eager functions may run engine/cpu/csrc's ops, where this model can (``_native_kernels``); not
        under a runner that compiles the whole forward, which fuses that work itself (the ops are
        opaque to the compiler)."""
        if mode == "compiled":
            self.kernels = Pointwise.compiled(self.norm_eps, self.activation, backend)
        else:
            self.kernels = Pointwise.eager(self.norm_eps, self.activation, native and self._native_kernels(), self.silu)

    def _native_kernels(self) -> bool:
        """Whether the eager norms and rotation can run engine/cpu/csrc's ops: a float32 CPU model, with
        the ops built at install."""
        return self.device.type == "cpu" and self.dtype == torch.float32 and native_ops_available()

    @property
    def compilations(self) -> int:
        """How often this model's compiled code compiled: its runner's variants and its kernels."""
        variants = sum(self.runner.compilations.values()) if self.runner is not None else 0
        return variants + sum(self.kernels.compilations.values())

    def warm_up_kernels(self) -> None:
        """Compile the pointwise kernels now, by their first calls: eager forwards of one token
        (dynamo's own variant for a size of 1) and of three (any other number of tokens) at the start
        of the cache, which is left empty. Raises what compiling raised."""
        runner, self.runner = self.runner, None
        try:
            for num_tokens in (1, 3):
                if num_tokens <= self.max_len:
                    self.cache.rollback(0)
                    self.extend([0] * num_tokens, num_logits=num_tokens)
        finally:
            self.runner = runner
            self.cache.rollback(0)

    def _body(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        window: int,
        layers: Sequence[int],
        masked: bool,
        num_out: int,
        chunks: int = 0,
        start: int | None = None,
    ) -> torch.Tensor:
        """input_ids [T] at positions [T], attending over cache positions [0, window) -> the final
        normalised hidden states [N, E] of the last ``num_out`` tokens. Each residual connection is
        added where the next norm reads it, in one kernel with it when the kernels are compiled.
        The residual stream entering each of ``aux_layers`` goes to ``features`` at ``positions``.
        ``start``: the eager forward's first position (positions are [start, window)); None: traced."""
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D]
        mask = None  # unmasked only when T = 1 and the window ends at its position
        if masked:  # query i (at positions[i]) sees keys [0, positions[i]]
            mask = self.positions[None, :window] <= positions[:, None]  # [T, W]
            mask = mask.repeat(self.num_heads // self.num_kv_heads, 1)  # [G*T, W], queries grouped by KV head
        hidden = self.embedding(input_ids)[None]  # [1, T, E]
        delta = None  # [1, T, E] what the last block adds to ``hidden``, not yet added
        num_new, group = input_ids.shape[0], self.num_heads // self.num_kv_heads
        fusable = self.kernels.native and start is not None and not chunks and num_new <= DIRECT_ROWS
        fusable = fusable and native_attention(num_new * group, self.head_dim)  # as the layer op by op would
        stacked = self._stack.run(self, hidden, layers, cos, sin, start, mask) if fusable else None
        if stacked is not None:  # every layer's products GGUF blocks: the layers in one call (the same values)
            (hidden, delta), layers = stacked, ()
        for index in layers:
            layer = self.layers[index]
            # a layer whose products are all GGUF blocks, at decode or verify: one call (the same values)
            blocks = self.weights.layer_arguments(self._layer_products[index]) if fusable else None
            if blocks is not None:
                keys, values = self.cache.layer(index)
                entering, hidden, delta = torch.ops.specserve.decode_layer.default(
                    hidden, delta, layer.input_layernorm.weight, layer.post_attention_layernorm.weight, self.norm_eps,
                    *blocks, cos, sin, keys, values, self.num_heads, start, mask, self.scaling
                )  # fmt: skip
            else:
                hidden, x = self._add_norm(hidden, delta, layer.input_layernorm)
                entering = hidden
            if index in self.aux_layers:  # [T, E] the residual stream entering this layer, in place
                self.features[self.aux_layers.index(index)].index_copy_(0, positions, entering[0])
            if blocks is None:
                delta = self._attention(layer.self_attn, x, index, positions, window, cos, sin, mask, chunks, start)
                hidden, x = self._add_norm(hidden, delta, layer.post_attention_layernorm)
                delta = self._mlp(layer.mlp, x)
        # every row, then the last ``num_out``: slices of the rows would be other shapes to compile
        return self._add_norm(hidden, delta, self.norm)[1][0, hidden.shape[1] - num_out :]  # [N, E]

    def _add_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, that sum through the RMSNorm ``norm``); no delta: (hidden, its norm)."""
        if delta is None:
            return hidden, self.kernels.rms_norm(hidden, norm.weight)
        return self.kernels.add_rms_norm(hidden, delta, norm.weight)

    def _attention(self, attn, x, index, positions, window, cos, sin, mask, chunks=0, start=None) -> torch.Tensor:
        num_new, heads, kv_heads, dim = x.shape[1], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.weights.linear(x, attn, "qkv_weight")  # [1, T, (H + 2 H_kv) D]
        head_norms = self.head_norms.get(index)
        if self.kernels.native and head_norms is None and start is not None:
            q, keys, values = self.cache.write_rotating(index, qkv, cos, sin, heads, start, window)
        else:
            v = qkv[..., (heads + kv_heads) * dim :].view(1, num_new, kv_heads, dim).transpose(1, 2)  # [1, H_kv, T, D]
            if head_norms is not None:  # Qwen3 normalises each query and key head before rotary
                q = head_norms[0](qkv[..., : heads * dim].view(1, num_new, heads, dim))  # [1, T, H, D]
                k = head_norms[1](qkv[..., heads * dim : (heads + kv_heads) * dim].view(1, num_new, kv_heads, dim))
                qk = torch.cat([q, k], dim=2)  # [1, T, H + H_kv, D]
            else:
                qk = qkv[..., : (heads + kv_heads) * dim].view(1, num_new, heads + kv_heads, dim)  # [1, T, H + H_kv, D]
            qk = self.kernels.rotate(qk.transpose(1, 2), cos, sin)  # [1, H + H_kv, T, D], q and k rotated together
            q, k = qk[:, :heads], qk[:, heads:]  # [1, H, T, D], [1, H_kv, T, D]
            keys, values = self.cache.write(index, positions, k, v, window)  # [1, H_kv, W, D]
        # The G = H / H_kv query heads of a KV head attend as its G*T queries, masked: K and V not copied
        grouped = q.reshape(1, kv_heads, (heads // kv_heads) * num_new, dim)  # [1, H_kv, G*T, D]
        alike = self.weights.rows_alike  # a GGUF target's: every length through the kernel (attend)
        out = attend(grouped, keys, values, mask, self.scaling, chunks, self.kernels.native, alike)  # [1, H_kv, G*T, D]
        out = out.reshape(1, heads, num_new, dim).transpose(1, 2).reshape(1, num_new, heads * dim)  # [1, T, H*D]
        return self.weights.linear(out, attn.o_proj, "weight")  # [1, T, E]

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        # the layers ``fuse_linears`` stacked, as one product: fewer kernels, and on CPU a formulation
        # the ``MatmulPlan`` measured for the stacked shape (a verify's 5 rows through the 3072-row
        # MLP weight with ``F.linear`` took a slow BLAS path)
        gated = self.kernels.gate(self.weights.linear(x, mlp, "gate_up_weight"))  # [1, T, 2I] -> [1, T, I]
        return self.weights.linear(gated, mlp.down_proj, "weight")  # [1, T, E]


def upload(token_ids: list[int], device: torch.device) -> torch.Tensor:
    """Host token ids -> [T] int64 on ``device``, without waiting for the device's queued work
    (``torch.tensor(ids, device="cuda")`` copies from pageable memory and synchronises)."""
    if device.type == "cuda":  # through pinned memory, so the copy is asynchronous
        return torch.tensor(token_ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)
    return torch.tensor(token_ids, dtype=torch.long, device=device)  # [T]
