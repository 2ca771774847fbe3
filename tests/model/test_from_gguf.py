"""A GGUF target built straight from its file (engine/model/from_gguf.py, engine/cpu/gguf_file.py):
the same model, bit for bit, as transformers loads and the block products then replace, for each
layout it reads; and a start-up that holds the blocks and little else."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.cpu.blocks import FileTensors, native_ops_available, offer_blocks
from engine.cpu.gguf_file import GGUFFile
from engine.model.from_gguf import GGUFConfig, direct_gguf, model_config, read_gguf_target
from engine.model.kv import lazy_zeros
from engine.model.llama_parts import RMSNorm, Rotary, rotary_of
from engine.model.loader import embedded_gguf, load_tokenizer
from engine.model.model import CausalLM

needs_kernels = pytest.mark.skipif(not native_ops_available(), reason="engine/cpu/_blocks was not built")
ROOT = Path(__file__).resolve().parents[2]


def write_model(
    path: Path, arch: str, hidden: int, heads: int, kv_heads: int, tied: bool, tokenizer: str | None = None
) -> None:
    """A two-layer model of ``arch`` with random weights in several formats (the attention output
    as float16, which the kernels do not decode: that product stays float32). ``tokenizer``: the
    embedded model's vocabulary and chat template go in too, with that pre-tokenizer name."""
    rng = np.random.default_rng(0)
    head_dim, inner, vocab = hidden // heads, 96, 128
    writer = gguf.GGUFWriter(str(path), arch)
    if tokenizer is not None:
        source = GGUFFile(embedded_gguf()).metadata
        writer.add_tokenizer_model(source["tokenizer.ggml.model"])
        writer.add_tokenizer_pre(tokenizer)
        writer.add_token_list(source["tokenizer.ggml.tokens"])
        writer.add_token_types(source["tokenizer.ggml.token_type"])
        writer.add_token_merges(source["tokenizer.ggml.merges"])
        writer.add_chat_template(source["tokenizer.chat_template"])
    writer.add_context_length(256)
    writer.add_block_count(2)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inner)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def tensor(name: str, shape: tuple[int, ...], kind: str = "Q8_0") -> None:
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if kind in ("F32", "F16"):
            writer.add_tensor(name, values if kind == "F32" else values.astype(np.float16))
            return
        quant = getattr(gguf.GGMLQuantizationType, kind)
        writer.add_tensor(name, gguf.quants.quantize(values, quant), raw_dtype=quant)

    tensor("token_embd.weight", (vocab, hidden))
    if not tied:
        tensor("output.weight", (vocab, hidden), "Q4_0")
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    for i in range(2):
        tensor(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), "Q4_1")
        tensor(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), "Q4_0")
        tensor(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), "F16" if i == 0 else "Q8_0")
        tensor(f"blk.{i}.ffn_gate.weight", (inner, hidden), "Q4_0")
        tensor(f"blk.{i}.ffn_up.weight", (inner, hidden), "Q4_0")
        tensor(f"blk.{i}.ffn_down.weight", (hidden, inner))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        if arch == "qwen2":
            for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                tensor(f"blk.{i}.attn_{name}.bias", (rows * head_dim,), "F32")
        if arch == "qwen3":
            for name in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(
                    f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32)
                )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def config_differences(mine: GGUFConfig, folder: Path, name: str) -> dict:
    """The fields of ``mine`` that differ from transformers' config of the same file: (ours, theirs)."""
    theirs = AutoConfig.from_pretrained(str(folder), gguf_file=name)
    fields = [field.name for field in dataclasses.fields(mine) if field.name != "name_or_path"]
    pairs = {name: (getattr(mine, name), getattr(theirs, name, "(none)")) for name in fields}
    if getattr(theirs, "head_dim", None) is None:  # Qwen2's modeling code divides, as ours states it
        pairs["head_dim"] = (mine.head_dim, theirs.hidden_size // theirs.num_attention_heads)
    return {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}


# (arch, hidden, heads, KV heads, tied): Llama's q and k rows come back in the checkpoint's order,
# Qwen2 has q/k/v biases and its own LM head, Qwen3 normalises each head (transformers reads its
# head size as the default 128)
LAYOUTS = [("llama", 64, 4, 2, True), ("qwen2", 64, 4, 2, False), ("qwen3", 256, 2, 1, True)]


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_a_target_read_from_its_file_computes_what_transformers_target_does(tmp_path, layout):
    path = tmp_path / "model.gguf"
    write_model(path, *layout)
    file = GGUFFile(path)
    assert direct_gguf(file) is None
    model, blocks = read_gguf_target(file)
    assert config_differences(model_config(file), tmp_path, path.name) == {}
    direct = CausalLM(model, 64)
    offer_blocks(direct, blocks)
    loaded = CausalLM(AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32), 64)
    offer_blocks(loaded, FileTensors.read(path))  # the proof path: blocks that decode to transformers' weights
    assert direct.weights.blocks_line == loaded.weights.blocks_line
    assert direct.weights.blocks_line.startswith("8/9 products")  # layer 0's float16 output stays float32
    prompt = list(range(3, 24))
    assert torch.equal(direct.extend(prompt, num_logits=6), loaded.extend(prompt, num_logits=6))
    assert torch.equal(direct.extend([7]), loaded.extend([7]))
    assert not any(p.is_meta and p.numel() for p in model.parameters())  # every block product let go of its weight
    # a target held in a dtype (no blocks: another dtype, or no kernels) has transformers' weights in it
    for dtype in (torch.float32, torch.float16):
        held = dict(read_gguf_target(file, dtype)[0].named_parameters())
        theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=dtype)
        assert {name: p.dtype for name, p in held.items()} == {name: p.dtype for name, p in theirs.named_parameters()}
        assert all(torch.equal(held[name], p) for name, p in theirs.named_parameters()), dtype


def test_the_file_reader_reads_what_the_gguf_package_reads():
    path = embedded_gguf()
    mine, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert mine.metadata["tokenizer.ggml.tokens"] == theirs.get_field("tokenizer.ggml.tokens").contents()
    assert mine.metadata["llama.rope.freq_base"] == theirs.get_field("llama.rope.freq_base").contents()
    for tensor in theirs.tensors:
        assert mine.tensors[tensor.name].shape == tuple(reversed(tensor.shape.tolist()))
        stored = np.asarray(tensor.data).view(np.uint8).reshape(mine.raw(tensor.name).shape)
        order = mine.row_order(tensor.name)
        assert np.array_equal(mine.raw(tensor.name), stored if order is None else stored[order])
    assert config_differences(model_config(mine), path.parent, path.name) == {}


def test_a_copy_read_a_block_of_rows_at_a_time_holds_the_whole_reads_values(tmp_path, monkeypatch):
    """A bfloat16 copy dequantizes each matrix a block of rows at a time (never a whole table in
    float32): blocks of 5 rows here, on a file whose q and k rows are reordered as they are read;
    every parameter equals the whole tensor read to float32 and rounded. A copy of the first layer
    reads only that layer."""
    import engine.model.from_gguf as from_gguf

    path = tmp_path / "tiny.gguf"
    write_model(path, "llama", 64, 4, 2, tied=False)
    monkeypatch.setattr(from_gguf, "ROW_BLOCK", 10**9)  # each matrix in one block: the whole read
    whole = read_gguf_target(GGUFFile(path), torch.float32)[0]
    monkeypatch.setattr(from_gguf, "ROW_BLOCK", 5)
    copy = read_gguf_target(GGUFFile(path), torch.bfloat16)[0]
    for (name, mine), (_, theirs) in zip(copy.named_parameters(), whole.named_parameters(), strict=True):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, theirs.to(torch.bfloat16)), name
    first = read_gguf_target(GGUFFile(path), torch.bfloat16, layers=1)[0]
    assert len(first.model.layers) == 1 and len(copy.model.layers) == 2
    assert torch.equal(first.model.layers[0].mlp.down_proj.weight, copy.model.layers[0].mlp.down_proj.weight)


@pytest.mark.parametrize("arch, pre", [("llama", "smollm"), ("qwen2", "qwen2"), ("qwen3", "qwen2")])
def test_a_gguf_files_tokenizer_is_the_one_auto_tokenizer_makes(tmp_path, arch, pre):
    """``load_tokenizer`` makes a GGUF file's tokenizer without AutoTokenizer's config detour; the
    same tokenizer, whatever class AutoTokenizer would have chosen for the architecture."""
    path = tmp_path / "model.gguf"
    write_model(path, arch, 256, 2, 1, True, tokenizer=pre)
    mine, theirs = load_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert mine.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    for name in ("chat_template", "all_special_ids", "special_tokens_map", "added_tokens_decoder", "add_bos_token"):
        assert getattr(mine, name) == getattr(theirs, name), name
    texts = ["Hello  world\n\n", "<|im_start|>user\nhi<|im_end|>", "émoji 🙂 中文 123456", "def f(x):\n\treturn x"]
    for text in texts:
        ids = theirs(text)["input_ids"]
        assert mine(text)["input_ids"] == ids
        assert mine.decode(ids) == theirs.decode(ids)
        assert mine.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "hi"}]
    assert mine.apply_chat_template(chat, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, add_generation_prompt=True
    )


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 1e5}, {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])  # fmt: skip
def test_the_norm_and_rotary_compute_what_transformers_modules_do(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope, max_position_embeddings=256)
    positions, x = torch.arange(200)[None], torch.randn(3, 64)
    for mine, theirs in zip(Rotary(config)(x, positions), LlamaRotaryEmbedding(config)(x, positions), strict=True):
        assert torch.equal(mine, theirs)
    # a head's config.json fields, in today's form and (plain RoPE) in the older one
    forms = [{"rope_parameters": rope}] + (
        [{"rope_theta": rope["rope_theta"]}] if rope["rope_type"] == "default" else []
    )
    for form in forms:
        fields = {"hidden_size": 64, "num_attention_heads": 4, **form}
        pairs = zip(rotary_of(fields, 16, 256)(x, positions), LlamaRotaryEmbedding(config)(x, positions), strict=True)
        for mine, theirs in pairs:
            assert torch.equal(mine, theirs)
    norm, reference = RMSNorm(64, 1e-5), LlamaRMSNorm(64, 1e-5)
    reference.weight.data = norm.weight.data = torch.randn(64)
    assert torch.equal(norm(x), reference(x))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_caches_pages_are_resident_only_where_written():
    def resident() -> int:
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024

    before = resident()
    cache = lazy_zeros((30, 1, 3, 4096, 64), torch.float32, torch.device("cpu"))  # [L, 1, H_kv, S, D]: 180 MB
    cache[:, :, :, :20] = 1.0  # 20 positions of every layer and head
    assert resident() - before < 16 * 2**20
    assert cache[:, :, :, 20:].abs().sum() == 0 and cache[:, :, :, :20].sum() == 30 * 3 * 20 * 64


@needs_kernels
def test_a_target_only_start_up_holds_the_blocks_and_not_the_compilers():
    """The embedded target, loaded as the server loads it and run once: transformers' modeling code
    (torch._dynamo, 200 MB) and config classes (torch's distributed tensors, 60 MB) stay out, and so
    does xgrammar until a request needs it; the peak is what the blocks and the libraries need,
    within issue 51's 500 MB (it was 1.5 GB when the model was first dequantized to float32; 701 MB
    when the default's int8 repack held the file's blocks, their repacked copy and a whole LM head's
    temporaries at once)."""
    script = """
import json, sys
import server.app  # the server's libraries, as a server holds them
from engine.config import EngineConfig
from engine.factory import load_engine
from engine.request import Request
from engine.sampling import SamplingParams
loaded = load_engine(EngineConfig(device="cpu", drafter="none"), show_progress=False)
list(loaded.engine.generate(Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8, temperature=0.0))))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
heavy = ("torch._dynamo", "transformers.models.llama.modeling_llama", "torch.distributed.tensor", "xgrammar")
print(json.dumps({"peak_mb": int(status["VmHWM"].split()[0]) // 1024, "loaded": [m for m in heavy if m in sys.modules]}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["loaded"] == [] and found["peak_mb"] <= 500, found
