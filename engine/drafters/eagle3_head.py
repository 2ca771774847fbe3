"""An EAGLE-3 head: its checkpoint layouts, its one decoder layer, and its KV cache.

Two layouts load alike:
- the EAGLE repository's and SpecForge's: ``config.json`` (``LlamaForCausalLMEagle3``, the sizes,
  ``draft_vocab_size``, optionally ``target_hidden_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids``) and weights ``fc``, ``midlayer.*``, ``norm``,
  ``lm_head``, ``d2t`` (target id = i + d2t[i]) and ``t2d``;
- ``speculators``' (``speculators_model_type: eagle3``, the layer's config under
  ``transformer_layer_config``, ``norm_before_residual``), whose layer is ``layers.0.*``.
The embedding is the target's. A head that does not fit the target is refused in one line.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..cpu.blocks import BlockWeight, kernel_isa, q8_blocks
from ..cpu.matmul import with_direct_rows
from ..cpu.memory import release_freed_memory
from ..errors import ConfigError
from ..model.attention import attend
from ..model.kernels import rotate
from ..model.kv import KVCache
from ..model.llama_parts import RMSNorm, rotary_of
from ..model.loader import locate
from ..model.model import CausalLM, upload

SPECULATORS_LAYER = "layers.0."
LAYER = "midlayer."


class Eagle3Head(nn.Module):
    """fc [H, A*E] over the target's features, one Llama decoder layer reading 2H, a final norm and
    an LM head over the draft vocabulary; ``step`` runs it over new positions of its own cache."""

    sequence_fields = ("cache",)  # one sequence's state (engine/model/slots.py)

    def __init__(
        self,
        config: dict,
        target: CausalLM,
        aux_layers: tuple[int, ...],
        norm_before_residual: bool,
        empty: bool = False,
    ):
        """``empty``: its products' weights on the meta device, for a checkpoint's to be assigned."""
        super().__init__()
        linear = partial(nn.Linear, device="meta" if empty else None)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        self.head_dim = config.get("head_dim") or hidden // heads
        self.num_heads, self.num_kv_heads = heads, kv_heads
        eps = config.get("rms_norm_eps", 1e-6)
        self.aux_layers = aux_layers
        self.norm_before_residual = norm_before_residual
        target_hidden = config.get("target_hidden_size") or target.config.hidden_size
        self.fc = linear(len(aux_layers) * target_hidden, hidden, bias=False)
        layer = self.midlayer = nn.Module()
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(layer, name, RMSNorm(hidden, eps))
        attn = layer.self_attn = nn.Module()
        bias = bool(config.get("attention_bias", False))
        attn.q_proj = linear(2 * hidden, heads * self.head_dim, bias=bias)
        attn.k_proj = linear(2 * hidden, kv_heads * self.head_dim, bias=bias)
        attn.v_proj = linear(2 * hidden, kv_heads * self.head_dim, bias=bias)
        attn.o_proj = linear(heads * self.head_dim, hidden, bias=bias)
        mlp = layer.mlp = nn.Module()
        mlp.gate_proj = linear(hidden, config["intermediate_size"], bias=False)
        mlp.up_proj = linear(hidden, config["intermediate_size"], bias=False)
        mlp.down_proj = linear(config["intermediate_size"], hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)
        draft_vocab = config.get("draft_vocab_size") or config["vocab_size"]
        self.lm_head = linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # target id = i + d2t[i]
        self.target = target
        self.name = "(unnamed)"  # the folder it was loaded from
        self.acceptance: float | None = None  # its first draft's agreement as recorded beside it (training.json)
        self.vocab_size = target.vocab_size
        positions = torch.arange(target.max_len)[None]  # [1, S]
        rope = rotary_of(config, self.head_dim, target.max_len)
        cos, sin = rope(torch.empty(0, dtype=torch.float32), positions)
        self.register_buffer("cos", cos[0], persistent=False)  # [S, D]
        self.register_buffer("sin", sin[0], persistent=False)
        self.cache = KVCache(1, kv_heads, self.head_dim, target.max_len, target.dtype, target.device)
        # its products by name, the linear layers stacked in each (one call for q, k, v; one for gate, up)
        self.stacked = {
            "fc": [self.fc],
            "qkv": [attn.q_proj, attn.k_proj, attn.v_proj],
            "o": [attn.o_proj],
            "gate_up": [mlp.gate_proj, mlp.up_proj],
            "down": [mlp.down_proj],
            "lm_head": [self.lm_head],
        }
        self.blocks: dict[str, BlockWeight] = {}  # products held as Q8_0 blocks (``finish``), by name

    def finish(self, blocks: bool = True) -> Eagle3Head:
        """After the weights load: the map from draft to target ids, on the target's device and dtype;
        beside a target whose kernels are native (CPU float32, engine/cpu/csrc built), unless not
        ``blocks``, the products as Q8_0 blocks through the block kernels: a quarter of the bytes a
        step reads, which is what a CPU step costs (the drafts stay exact: each carries the q it was
        drawn from); their float weights are let go."""
        self.requires_grad_(False).eval()
        device, dtype = self.target.device, self.target.dtype
        linears = [module for modules in self.stacked.values() for module in modules]
        if blocks and self.target.kernels.native and all(m.in_features % 32 == 0 for m in linears):
            isa = kernel_isa()  # quantized from the checkpoint's own weights, a product at a time
            for name, modules in self.stacked.items():
                bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules]).to(device, dtype)
                self.blocks[name] = q8_blocks(torch.cat([m.weight for m in modules]), bias, isa)
                for module in modules:  # the blocks are its weights now
                    module.weight = nn.Parameter(torch.empty(module.weight.shape, device="meta"), requires_grad=False)
        # copies all: an assigned tensor may share the checkpoint's map, which would keep the whole file resident
        self._apply(lambda t: t if t.is_meta else t.to(device, dtype if t.is_floating_point() else t.dtype, copy=True))
        self.draft_to_target = draft_target_ids(self.d2t)  # [Vd]
        if self.blocks:
            release_freed_memory()  # the float weights, before the timing's temporaries
            self.blocks = with_direct_rows(self.blocks, {})  # a catch-up over many tokens: kernel or tiles
        return self

    def product(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x [..., I] times the product ``name``'s stacked weights -> [..., O]: its blocks, else its layers."""
        held = self.blocks.get(name)
        if held is not None:
            return held.linear(x)
        modules = self.stacked[name]
        return modules[0](x) if len(modules) == 1 else torch.cat([module(x) for module in modules], dim=-1)

    def describe(self) -> str:
        """'EAGLE-3 head SmolLM2-135M-Instruct (9.8M params, draft vocabulary 8192, features of layers 2, 15, 27)'"""
        params = sum(p.numel() for p in self.parameters())
        layers = ", ".join(map(str, self.aux_layers))
        return (
            f"EAGLE-3 head {self.name} ({params / 1e6:.1f}M params, draft vocabulary {self.lm_head.out_features}, "
            f"features of layers {layers}{'; Q8_0 products' if self.blocks else ''})"
        )

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [T, A*E] -> the head's [T, H]."""
        return self.product("fc", features)

    def step(self, token_ids: list[int] | torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [T] with features [T, H] at the next T positions of the head's cache -> (logits
        [1, V] over the target's vocabulary for the last position, -inf outside the head's, and
        that position's pre-norm output [1, H], the next position's features)."""
        ids = token_ids if isinstance(token_ids, torch.Tensor) else upload(token_ids, self.target.device)
        count, start = ids.shape[0], self.cache.length
        positions = self.target.positions[start : start + count]  # [T]
        layer = self.midlayer
        embedded = self._norm(layer.input_layernorm, self.target.embedding(ids))  # [T, H]
        normed = self._norm(layer.hidden_norm, features)  # [T, H]
        residual = normed if self.norm_before_residual else features
        x = torch.cat([embedded, normed], dim=-1)[None]  # [1, T, 2H]
        qkv = self.product("qkv", x).view(1, count, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q = qkv[:, :, : self.num_heads].transpose(1, 2)  # [1, Hq, T, D]
        k = qkv[:, :, self.num_heads : self.num_heads + self.num_kv_heads].transpose(1, 2)  # [1, Hkv, T, D]
        v = qkv[:, :, self.num_heads + self.num_kv_heads :].transpose(1, 2)
        cos, sin = self.cos[positions].to(q.dtype), self.sin[positions].to(q.dtype)  # [T, D]
        turn = torch.ops.specserve.rotate.default if self.target.kernels.native else rotate
        q, k = turn(q, cos, sin), turn(k, cos, sin)
        window = start + count
        keys, values = self.cache.write(0, positions, k, v, window)  # [1, Hkv, W, D]
        group = self.num_heads // self.num_kv_heads
        mask = None  # the G = Hq / Hkv query heads of a KV head attend as G*T queries of it, as the target's do
        if count > 1:
            mask = (self.target.positions[None, :window] <= positions[:, None]).repeat(group, 1)  # [G*T, W]
        grouped = q.reshape(1, self.num_kv_heads, group * count, self.head_dim)  # [1, Hkv, G*T, D]
        scale = self.head_dim**-0.5
        out = attend(grouped, keys, values, mask, scale, 0, self.target.kernels.native)  # [1, Hkv, G*T, D]
        out = out.reshape(1, self.num_heads, count, self.head_dim)  # [1, Hq, T, D]
        hidden = self.product("o", out.transpose(1, 2).reshape(1, count, -1))[0] + residual  # [T, H]
        gate, up = self.product("gate_up", self._norm(layer.post_attention_layernorm, hidden)).chunk(2, dim=-1)
        hidden = self.product("down", F.silu(gate) * up) + hidden  # [T, H] pre-norm
        draft_logits = self.product("lm_head", self._norm(self.norm, hidden[-1:]))  # [1, Vd]
        logits = draft_logits.new_full((1, self.vocab_size), float("-inf"))  # [1, V]
        logits[:, self.draft_to_target] = draft_logits
        return logits, hidden[-1:]

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """x through the RMSNorm ``norm``: engine/cpu/csrc's op beside a target whose kernels are native
        (one call where the module makes about eight), else the module."""
        if self.target.kernels.native and x.dtype == torch.float32:
            return torch.ops.specserve.rms_norm.default(x, norm.weight, norm.variance_epsilon)
        return norm(x)


def read_config(folder: Path) -> tuple[dict, tuple[int, ...] | None, bool]:
    """(the layer's config, the aux layer ids if the checkpoint names them, norm_before_residual)."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"draft_head: no EAGLE-3 head at {folder} (config.json missing)")
    raw = json.loads(path.read_text())
    if raw.get("speculators_model_type") == "eagle3":
        config = {**raw.get("transformer_layer_config", {}), "draft_vocab_size": raw.get("draft_vocab_size")}
        if raw.get("target_hidden_size"):
            config["target_hidden_size"] = raw["target_hidden_size"]
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        return config, tuple(ids) if ids else None, bool(raw.get("norm_before_residual", False))
    if not any("Eagle3" in name for name in raw.get("architectures", [])):
        raise ConfigError(f"draft_head: {folder} is not an EAGLE-3 head (architectures {raw.get('architectures')})")
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return raw, tuple(ids) if ids else None, bool(raw.get("norm_before_residual", False))


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        weights = load_file(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"draft_head: no model.safetensors or pytorch_model.bin in {folder}")
    # t2d (which target ids the head can name) follows from d2t; the embedding is the target's
    unused = ("t2d", "embed_tokens.weight")
    return {name.replace(SPECULATORS_LAYER, LAYER): tensor for name, tensor in weights.items() if name not in unused}


SHIPPED = Path(__file__).resolve().parent.parent / "eagle3_heads"


def shipped_head(model_name: str) -> Path:
    """Where the head shipped for ``model_name`` lives (it may not exist)."""
    return SHIPPED / model_name.rstrip("/").split("/")[-1]


def draft_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id [Vd], from the layout's offsets: i + d2t[i]."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """2, L/2 and L-3: the layers vLLM and SGLang take features from (fewer, distinct, on a target
    too shallow for three)."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}))


def load_head(ref: str, target: CausalLM, blocks: bool = True) -> Eagle3Head:
    """The head at ``ref`` (a folder, or a hub id in the local cache), checked against the target;
    not ``blocks``: with the checkpoint's float weights wherever it runs (``Eagle3Head.finish``)."""
    folder = Path(locate(ref)[0])
    config, ids, norm_before_residual = read_config(folder)
    ids = ids or default_aux_layers(len(target.layers))
    count = len(target.layers)
    if len(set(ids)) != len(ids) or any(not 0 <= i < count for i in ids):
        raise ConfigError(f"draft_head: aux layers {list(ids)} must be distinct layers of the target's 0..{count - 1}")
    if config["hidden_size"] != target.config.hidden_size:
        raise ConfigError(
            f"draft_head: the head's hidden size {config['hidden_size']} differs from the target's "
            f"{target.config.hidden_size} (it reads the target's embedding)"
        )
    if config.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ConfigError(
            f"draft_head: the head was made for a vocabulary of {config['vocab_size']} tokens; the target has "
            f"{target.vocab_size}"
        )
    head = Eagle3Head(config, target, tuple(sorted(ids)), norm_before_residual, empty=True)
    weights = read_weights(folder)
    for name, tensor in head.state_dict().items():  # assigned below: each must have its parameter's shape
        if name in weights and weights[name].shape != tensor.shape:
            if name == "fc.weight":
                raise ConfigError(
                    f"draft_head: fc reads {weights[name].shape[1]} features; {len(ids)} layers of the target's "
                    f"hidden size {target.config.hidden_size} give {tensor.shape[1]}"
                )
            raise ConfigError(
                f"draft_head: {name} is {list(weights[name].shape)}; the config makes it {list(tensor.shape)}"
            )
    missing, _ = head.load_state_dict(weights, strict=False, assign=True)  # no float copy made first
    del weights  # the head's own now: what finish converts is let go as it goes
    if missing:
        raise ConfigError(f"draft_head: {folder} lacks {', '.join(missing[:4])}")
    if int(draft_target_ids(head.d2t).max()) >= target.vocab_size:
        raise ConfigError("draft_head: its d2t maps draft ids past the target's vocabulary")
    head.name = folder.name
    report = folder / "training.json"
    if report.is_file():
        recorded = json.loads(report.read_text())  # served on prompts it never saw, else its training's held out
        head.acceptance = recorded.get("unseen_acceptance", recorded.get("held_out_acceptance"))
    return head.finish(blocks)


def save_head(head_weights: dict[str, torch.Tensor], config: dict, folder: Path) -> None:
    """Write a head in the EAGLE layout (what ``load_head`` reads back)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **config}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({name: tensor.contiguous() for name, tensor in head_weights.items()}, folder / "model.safetensors")
