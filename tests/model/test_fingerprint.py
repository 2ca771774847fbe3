"""system_fingerprint changes with what decides the logits' bits, and only with that."""

from __future__ import annotations

import torch

from engine.cpu.blocks import offer_blocks
from engine.model.fingerprint import arithmetic, system_fingerprint, weight_files
from tests.tiny import quantize_in_place, tiny_engine, tiny_llama


def fingerprint_at(target, threads: int, activations: str = "float32") -> str:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return system_fingerprint(arithmetic(target, activations, "eager"), [])
    finally:
        torch.set_num_threads(before)


def test_the_thread_count_is_in_it_only_where_products_run_by_blas():
    blas = tiny_engine(tiny_llama(seed=1, vocab_size=64), None).target
    assert fingerprint_at(blas, 1) != fingerprint_at(blas, 2)  # BLAS sums depend on the threads
    blocks = tiny_engine(tiny_llama(seed=1, vocab_size=64), None).target
    offer_blocks(blocks, quantize_in_place(blocks.hf_model))
    blocks.weights.plan_matmuls(4)
    assert blocks.weights.rows_alike
    assert fingerprint_at(blocks, 1) == fingerprint_at(blocks, 2) == fingerprint_at(blocks, 16)
    assert fingerprint_at(blocks, 2) != fingerprint_at(blocks, 2, "int8") != fingerprint_at(blas, 2)


def test_a_different_weight_file_is_a_different_fingerprint(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(bytes(3 * 2**20))
    (folder / "config.json").write_text("{}")
    (folder / "notes.txt").write_text("not a weight")
    files = weight_files(folder, None)
    assert [path.name for path in files] == ["config.json", "model.safetensors"]
    first = system_fingerprint({"dtype": "float32"}, files)
    assert system_fingerprint({"dtype": "float32"}, files) == first
    assert system_fingerprint({"dtype": "bfloat16"}, files) != first
    with weights.open("r+b") as handle:  # one byte near the end of a 3 MiB file
        handle.seek(3 * 2**20 - 10)
        handle.write(b"\x01")
    assert system_fingerprint({"dtype": "float32"}, weight_files(folder, None)) != first
    assert weight_files(folder, weights) == [weights]  # a GGUF target: its file alone
