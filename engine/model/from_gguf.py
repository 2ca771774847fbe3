"""A GGUF target built straight from its file: the products keep the file's blocks, nothing else is made.

Loading a GGUF file through transformers dequantizes every weight to float32 (the embedded 135M
model: 538 MB from a 100 MB file) and parses the file several times, before the block products
(engine/cpu/blocks.py) replace those weights again: start-up then peaks near 1.5 GB where llama.cpp
holds the model in 250 MB. Here the model's modules are laid out with the names a Hugging Face
checkpoint has (what ``CausalLM`` reads), the weights of the products stay empty ("meta") and
their blocks come from the file, rows in the checkpoint's order, and only the norms (and a weight
in a format the kernels do not decode) are dequantized, exactly as transformers would.

The layout is the Llama family's (llama, mistral, qwen2, qwen3) with plain RoPE; ``direct_gguf``
says whether a file can be read so, and why not. Everything else goes through transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu.blocks import FileTensors
from ..cpu.gguf_file import GGUFFile
from .llama_parts import RMSNorm, Rotary
from .weights import FUSED

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# the metadata each architecture keeps its config in, by config field (transformers reads the same keys)
CONFIG_KEYS = {
    "max_position_embeddings": "context_length",
    "num_hidden_layers": "block_count",
    "intermediate_size": "feed_forward_length",
    "hidden_size": "embedding_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
}
TOKEN_IDS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
# a layer's products, each as the linear layers stacked in it (CausalLM stacks q/k/v and gate/up: FUSED)
PRODUCTS = (FUSED["qkv"], ("o_proj",), FUSED["gate_up"], ("down_proj",))


def direct_gguf(file: GGUFFile) -> str | None:
    """None where ``file``'s model can be built here; else why not, in a few words."""
    if file.arch not in ARCHITECTURES:
        return f"architecture {file.arch!r} (read directly: {', '.join(ARCHITECTURES)})"
    if file.field("rope.scaling.type", "none") not in ("none", None) or "rope_freqs.weight" in file.tensors:
        return "its RoPE is scaled"
    return None


@dataclass
class GGUFConfig:
    """The model's shape as its file states it: the fields of transformers' config for the same
    file that the engine reads, with that config class's defaults where the file is silent. Not
    transformers' own class: importing any of its configs imports torch's distributed tensors
    (60 MB of a server's memory) through its validators."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    name_or_path: str = ""  # the folder the file is in


def model_config(file: GGUFFile) -> GGUFConfig:
    """The config of the file's model, from its metadata (the keys transformers reads)."""
    fields = {name: value for name, key in CONFIG_KEYS.items() if (value := file.field(key)) is not None}
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields |= {
        name: file.metadata[f"tokenizer.ggml.{key}_token_id"]
        for name, key in TOKEN_IDS.items()
        if f"tokenizer.ggml.{key}_token_id" in file.metadata
    }
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    fields["vocab_size"] = file.field("vocab_size", len(tokens) if tokens else None)
    # the head size: llama's files state it as the rotary width; transformers' Qwen3 config
    # takes 128 whatever the file says (and so do Qwen3's checkpoints); else hidden / heads
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    if file.arch == "llama":
        head_dim = file.field("rope.dimension_count", head_dim)
    fields["head_dim"] = 128 if file.arch == "qwen3" else head_dim
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": float(file.field("rope.freq_base", 10000.0))}
    fields["tie_word_embeddings"] = "output.weight" not in file.tensors
    model_type = file.arch
    if model_type == "llama" and "mistral" in str(file.metadata.get("general.name", "")).lower():
        model_type = "mistral"
    return GGUFConfig(model_type=model_type, name_or_path=str(file.path.parent), **fields)


class Linear(nn.Module):
    """A linear layer's weight [O, I] and bias [O], not yet read ("meta"): ``nn.Linear`` would
    initialise them, and initialising a meta tensor imports torch._dynamo."""

    def __init__(self, rows: int, columns: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = columns, rows
        self.weight = nn.Parameter(torch.empty(rows, columns, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows, device="meta"), requires_grad=False) if bias else None


class Embedding(nn.Module):
    def __init__(self, rows: int, columns: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, columns, device="meta"), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Attention(nn.Module):
    def __init__(self, config, head_dim: int, bias: bool, head_norms: bool) -> None:
        super().__init__()
        heads, kv_heads, size = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.head_dim, self.scaling = head_dim, head_dim**-0.5
        self.q_proj = Linear(heads * head_dim, size, bias)
        self.k_proj = Linear(kv_heads * head_dim, size, bias)
        self.v_proj = Linear(kv_heads * head_dim, size, bias)
        self.o_proj = Linear(size, heads * head_dim, False)
        if head_norms:
            self.q_norm, self.k_norm = RMSNorm(head_dim, config.rms_norm_eps), RMSNorm(head_dim, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = Linear(inner, size, False), Linear(inner, size, False)
        self.down_proj = Linear(size, inner, False)
        self.act_fn = F.silu


class Layer(nn.Module):
    def __init__(self, config, head_dim: int, bias: bool, head_norms: bool) -> None:
        super().__init__()
        self.self_attn = Attention(config, head_dim, bias, head_norms)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Body(nn.Module):
    def __init__(self, config, head_dim: int, bias: bool, head_norms: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, head_dim, bias, head_norms) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Rotary(config)


class Decoder(nn.Module):
    """A Llama-family decoder laid out as transformers' ``*ForCausalLM`` (its module names)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        head_dim = config.head_dim
        bias = config.model_type == "qwen2"
        self.model = Body(config, head_dim, bias, head_norms=config.model_type == "qwen3")
        self.lm_head = Linear(config.vocab_size, config.hidden_size, False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def read_gguf_target(
    file: GGUFFile, dtype: torch.dtype | None = None, layers: int | None = None
) -> tuple[Decoder, FileTensors]:
    """The model ``file`` holds (``direct_gguf`` must allow it), and the blocks its products read.
    A product whose stacked tensors are all in formats the kernels decode keeps an empty weight
    (its blocks are the weight); every other tensor is dequantized to float32, as transformers
    loads it (the embedding table too, unless a tied LM head's blocks give its rows). With a
    ``dtype``, no blocks: every tensor is dequantized and held in ``dtype`` (a draft copy), a block
    of rows at a time. ``layers``: only the first so many decoder layers (what a step of the whole
    costs is estimated from such; engine/measure.py)."""
    import gguf

    config = model_config(file)
    if layers is not None:
        config.num_hidden_layers = min(layers, config.num_hidden_layers)
    model = Decoder(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[file.arch.upper()], config.num_hidden_layers)
    module_names = {id(module): name for name, module in model.named_modules()}

    def tensor(module: nn.Module) -> str:  # its tensors' stem in the file, "blk.0.attn_q"
        name = names.get_name(module_names[id(module)])
        return "token_embd" if name == "output" and config.tie_word_embeddings else name

    blocks = FileTensors.read(file) if dtype is None else FileTensors(file.arch, {})
    stacks = [[model.lm_head]] + [
        [getattr(owner, name) for name in stack]
        for layer in model.model.layers
        for owner, stack in zip((layer.self_attn, layer.self_attn, layer.mlp, layer.mlp), PRODUCTS, strict=True)
    ]
    held = {
        id(linear)
        for stack in stacks
        if all(f"{tensor(lin)}.weight" in blocks.tensors for lin in stack)
        for linear in stack
    }
    embedding = model.model.embed_tokens
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            tied_rows = module is embedding and config.tie_word_embeddings and id(model.lm_head) in held
            if name == "weight" and (id(module) in held or tied_rows):
                continue  # the blocks hold it (a tied head's hold the table's rows)
            if module is model.lm_head and config.tie_word_embeddings:
                continue  # the table, read once as the embedding's
            stored = f"{tensor(module)}.{name}"
            values = _values(file, stored, dtype) if dtype is not None and param.dim() == 2 else None
            if values is None:
                values = torch.from_numpy(file.floats(stored).copy()).to(dtype or torch.float32)
            if values.shape != param.shape:
                raise ValueError(
                    f"{stored}: the file holds {tuple(values.shape)}, the model needs {tuple(param.shape)}"
                )
            setattr(module, name, nn.Parameter(values, requires_grad=False))
    if config.tie_word_embeddings:
        model.lm_head.weight = embedding.weight
    return model, blocks


ROW_BLOCK = 4096  # rows dequantized at a time into a copy in another dtype


def _values(file: GGUFFile, stored: str, dtype: torch.dtype) -> torch.Tensor:
    """Matrix ``stored`` held in ``dtype``, dequantized a block of rows at a time: a bfloat16 copy
    never holds a whole table in float32 (the embedded model's: 113 MB)."""
    rows, columns = file.tensors[stored].shape
    values = torch.empty(rows, columns, dtype=dtype)  # [R, C]
    for start in range(0, rows, ROW_BLOCK):
        block = file.floats(stored, slice(start, start + ROW_BLOCK))
        values[start : start + len(block)] = torch.from_numpy(block if block.flags.writeable else block.copy())
    return values
