"""Tiny random-weight models and a local byte-level tokenizer, built in-process (no hub)."""

from __future__ import annotations

import atexit
import copy
import json
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

import engine.cpu.int8_blocks as int8_blocks
from engine.config import EngineConfig
from engine.cpu.blocks import FileTensors, offer_blocks
from engine.drafters.medusa import MedusaHeads
from engine.engine import SpecEngine
from engine.factory import build_engine
from engine.request import Request
from engine.sampling import SamplingParams

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(extra_tokens: list[str] | None = None) -> PreTrainedTokenizerFast:
    """One token per byte (256) plus the chat specials: multi-byte characters span several tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    for token in extra_tokens or []:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )


def tiny_llama(seed: int, vocab_size: int, layers: int = 2, hidden: int = 32, init: float = 0.02) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,  # as long as the longest context the tests serve
        initializer_range=init,
        eos_token_id=None,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def tiny_of_family(model_type: str, vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """A tiny random model of another supported family ("qwen2", "qwen3", "mistral"), its shapes as
    ``tiny_llama``'s."""
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def perturbed_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """The same model with Gaussian noise on every weight: a draft that agrees often but not always."""
    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise * param.std().clamp_min(1e-3))
    return copy


def tiny_engine(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM | None,
    num_draft_tokens: int = 4,
    eos: set[int] | None = None,
    max_model_len: int = 256,
    tokenizer_size: int | None = None,
    draft_ref: str = "tiny-draft",
    **options,
) -> SpecEngine:
    """An engine on in-process models; ``draft_ref`` is what the config calls the draft ("copy:int8"
    quantizes it); ``options`` are further EngineConfig fields (drafter: by default the draft model,
    or the target alone without one)."""
    options.setdefault("drafter", "model" if draft is not None else "none")
    config = EngineConfig(
        target="tiny",
        draft=draft_ref if draft is not None else None,
        num_draft_tokens=num_draft_tokens,
        device="cpu",
        dtype="float32",
        max_model_len=max_model_len,
        **options,
    )
    return build_engine(config, target, draft, eos or set(), tokenizer_size)


# Every drafting setup the exactness suite runs: name -> (needs a draft model, EngineConfig options).
DRAFTER_SETUPS: dict[str, tuple[bool, dict]] = {
    "model": (True, {"drafter": "model"}),
    "model-adaptive-k": (True, {"drafter": "model", "adaptive_k": True}),
    "model-confidence-cutoff": (True, {"drafter": "model", "min_draft_confidence": 0.3}),
    "ngram": (False, {"drafter": "ngram"}),
    "suffix": (False, {"drafter": "suffix"}),
    "auto": (True, {"drafter": "auto"}),  # setup_engine makes it switch drafters at every step
    # the draft copies the target's keys and values instead of reading the tokens itself
    "model-target-kv": (True, {"drafter": "model", "draft_kv": "target"}),
    "auto-target-kv": (True, {"drafter": "auto", "draft_kv": "target"}),
    # the draft's products as int8 rows over bfloat16 activations (setup_engine makes it bfloat16)
    "model-int8": (True, {"drafter": "model", "draft_ref": "copy:int8", "draft_kv": "own"}),
    "self": (False, {"drafter": "self", "self_layers": (0,)}),
    "staged-ngram-model": (True, {"drafter": "staged", "stages": ("ngram", "model")}),
    "staged-self-model": (True, {"drafter": "staged", "stages": ("self", "model"), "self_layers": (1,)}),
    "medusa": (False, {"drafter": "medusa"}),  # random heads, written for the target by setup_engine
    "eagle3": (False, {"drafter": "eagle3"}),  # a random EAGLE-3 head, written for the target by setup_engine
    # auto with the head among its candidates, switching every step: the head catches up on the
    # target's kept features after other candidates' steps
    "auto-eagle3": (True, {"drafter": "auto"}),
}


# The model drafter run the way a GPU runs it, proven on CPU: forwards compiled with fullgraph
# (aot_eager: the traced graph without inductor's code generation, to keep the suite fast), and the
# confidence cutoff decided on the device with every draft step run, as when the host must not wait.
DEVICE_PATH_SETUPS: dict[str, tuple[bool, dict]] = {
    "model-compiled": (True, {"drafter": "model", "forward": "compile", "compile_backend": "aot_eager"}),
    # the pointwise kernels between products compiled, as under CUDA graphs (engine/model/kernels.py)
    "model-compiled-kernels": (True, {"drafter": "model", "kernels": "compiled", "compile_backend": "aot_eager"}),
    "model-cutoff-on-device": (True, {"drafter": "model", "min_draft_confidence": 0.3}),
    # the head's features written by the compiled forward (the static path a GPU captures)
    "eagle3-compiled": (False, {"drafter": "eagle3", "forward": "compile", "compile_backend": "aot_eager"}),
    # the target's products through GGUF blocks (engine/cpu/blocks.py): setup_engine quantizes it in place
    "model-blocks": (True, {"drafter": "model"}),
}


def quantize_in_place(model: PreTrainedModel, formats: tuple[str, ...] = ("Q4_1", "Q8_0", "Q4_0", "Q5_1", "Q5_0")):
    """Quantize every linear weight of a Llama ``model`` with the gguf package (formats in turn; the
    LM head Q8_0, as the embedded file holds it) and set it to the blocks' dequantized values: the
    model is now the one the blocks hold, the file a GGUF would hold for it is returned."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    tensors = {}
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for i, (name, module) in enumerate(linears):
        gguf_name = names.get_name(name)
        kind = getattr(gguf.GGMLQuantizationType, "Q8_0" if gguf_name == "output" else formats[i % len(formats)])
        weight = module.weight.detach().float().numpy()
        blocks = gguf.quants.quantize(weight, kind)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, kind)).reshape(weight.shape))
        tensors[f"{gguf_name}.weight"] = (int(kind), torch.from_numpy(blocks))
    return FileTensors("llama", tensors)


def scratch_folder(prefix: str) -> Path:
    """A new folder for a head a test writes, removed when the test process exits."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def random_medusa_heads(hidden_size: int, num_heads: int = 4, seed: int = 0) -> Path:
    """A head checkpoint with random weights, so the heads guess differently from the LM head."""
    folder = scratch_folder("medusa-")
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, hidden_size)
    with torch.no_grad():
        for head in heads.heads:
            head.weight.normal_(0.0, 0.5)
    heads.save(folder, "tiny", {"note": "random, for tests"})
    return folder


def random_eagle3_head(
    target: PreTrainedModel,
    aux_layers: tuple[int, ...] | None = None,
    layout: str = "eagle",
    draft_vocab: int | None = None,
    seed: int = 0,
    scale: float = 0.5,
) -> Path:
    """An EAGLE-3 head with random weights for ``target``, in the EAGLE/SpecForge layout or the
    speculators one, over a draft vocabulary of ``draft_vocab`` of the target's ids (a random
    subset, so draft ids map to other target ids through d2t)."""
    config = target.config
    hidden, vocab = config.hidden_size, config.vocab_size
    layers = aux_layers or tuple(range(min(3, config.num_hidden_layers)))
    draft_vocab = draft_vocab or vocab // 2
    generator = torch.Generator().manual_seed(seed)
    head_dim = hidden // 4
    shapes = {
        "fc.weight": (hidden, len(layers) * hidden),
        "midlayer.self_attn.q_proj.weight": (4 * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (2 * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (2 * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, 4 * head_dim),
        "midlayer.mlp.gate_proj.weight": (2 * hidden, hidden),
        "midlayer.mlp.up_proj.weight": (2 * hidden, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, 2 * hidden),
        "lm_head.weight": (draft_vocab, hidden),
    }
    weights = {
        name: torch.randn(shape, generator=generator) * scale / shape[1] ** 0.5 for name, shape in shapes.items()
    }
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        weights[f"{norm}.weight"] = torch.ones(hidden)
    chosen = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values  # target ids, ascending
    weights["d2t"] = chosen - torch.arange(draft_vocab)
    head_config = {
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "intermediate_size": 2 * hidden,
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": config.max_position_embeddings,
    }
    folder = scratch_folder("eagle3-")
    if layout == "eagle":
        from engine.drafters.eagle3_head import save_head

        save_head(weights, {**head_config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}, folder)
    else:  # speculators: the layer's config nested, its weights under layers.0
        from safetensors.torch import save_file

        speculators = {
            "speculators_model_type": "eagle3",
            "transformer_layer_config": head_config,
            "draft_vocab_size": draft_vocab,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": list(layers),
        }
        (folder / "config.json").write_text(json.dumps(speculators))
        renamed = {name.replace("midlayer.", "layers.0."): tensor for name, tensor in weights.items()}
        save_file({name: tensor.contiguous() for name, tensor in renamed.items()}, folder / "model.safetensors")
    return folder


def setup_engine(
    setup: str, target: LlamaForCausalLM, draft: LlamaForCausalLM, int8_activations: bool = False, **kwargs
) -> SpecEngine:
    """An engine for ``setup``; ``int8_activations`` (with model-blocks) repacks the blocks for them:
    a different target from ``target``, whose law the test then takes from the engine's own forward."""
    needs_draft, options = {**DRAFTER_SETUPS, **DEVICE_PATH_SETUPS}[setup]
    if options["drafter"] == "medusa":
        options = {**options, "medusa_heads": str(random_medusa_heads(target.config.hidden_size))}
    if "eagle3" in setup:
        options = {**options, "draft_head": str(random_eagle3_head(target, seed=1))}
    if options.get("draft_ref") == "copy:int8":  # quantized from a bfloat16 copy, as the loader makes one
        draft = copy.deepcopy(draft).to(torch.bfloat16)
    formats = ("Q4_1", "Q4_0") if int8_activations else ("Q4_1", "Q8_0", "Q4_0", "Q5_1", "Q5_0")
    file = quantize_in_place(target, formats) if setup == "model-blocks" else None  # the test's reference reads it too
    if file is not None:  # the engine frees the weights it holds as blocks: the reference keeps its own
        target = copy.deepcopy(target)
    engine = tiny_engine(target, draft if needs_draft else None, **kwargs, **options)
    if file is not None:  # every product through the blocks, at every row count
        weights = engine.target.weights
        offer_blocks(engine.target, file, int8_blocks.int8_activations if int8_activations else None)
        assert len(weights.blocks) == len(weights.products), weights.blocks_line
        assert len(weights.prepared) == len(weights.products)  # held from the offer on
    if options["drafter"] == "auto":  # try another candidate every step: choices change mid-request
        engine.drafter("auto").probe_every = 1
    if setup == "model-cutoff-on-device":
        engine.drafter("model").stop_early = False
    return engine


def save_tiny(folder: Path, seed: int, tokenizer: PreTrainedTokenizerFast, **kwargs) -> Path:
    """A model folder the CLI can load with --target / --draft."""
    model = tiny_llama(seed, len(tokenizer), **kwargs)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def serve_varied_requests(engine: SpecEngine, count: int = 12, max_prompt: int = 30, seed: int = 0) -> None:
    """Requests with varying drafters, k, adaptive k and prompt lengths, each run to its end: what
    serving asks of compiled or captured code, for tests that count its compilations."""
    generator = torch.Generator().manual_seed(seed)
    drafters = ("model", "self", "ngram", "staged", "auto", "none")
    for i in range(count):
        length = int(torch.randint(3, max_prompt, (1,), generator=generator))
        prompt = torch.randint(1, engine.vocab_size, (length,), generator=generator).tolist()
        params = SamplingParams(max_tokens=10, temperature=1.0)
        request = Request(
            str(i), prompt, params, num_draft_tokens=1 + i % 3, drafter=drafters[i % 6], adaptive_k=i % 2 == 0
        )
        list(engine.generate(request))


def compiling_engine(**options) -> SpecEngine:
    """A tiny target, a perturbed copy as draft, k = 3 and a self drafter on layer 0, compiling
    with aot_eager where ``options`` (EngineConfig fields) say to compile."""
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    draft = perturbed_copy(target, 0.05, seed=1)
    options = {"compile_backend": "aot_eager", **options}
    return tiny_engine(target, draft, num_draft_tokens=3, self_layers=(0,), **options)
