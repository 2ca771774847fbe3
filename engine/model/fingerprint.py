"""``system_fingerprint``: a short digest of what decides the bits of a response's logits.

OpenAI documents ``system_fingerprint`` for use with ``seed``: two responses to the same seeded
request are the same text only where their fingerprints match. Here it digests the target's weight
files (each by its size and its first and last MiB: reading a 16 GB file whole would cost start-up
seconds, and a different file differs there), the dtype and activation mode, how products and
pointwise work are computed (GGUF block kernels and their instruction set, oneDNN or BLAS, eager or
compiled, the device), and the versions of torch, transformers and specserve. Where products run
by BLAS (a checkpoint without GGUF blocks, on CPU) the thread count and the matmul plan measured at
start-up change the rounding too, so they are in it as well; through GGUF blocks a position's
logits are the same bits at every thread count and row grouping, so neither is.
"""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ..cpu.blocks import ISAS, kernel_isa
from .model import CausalLM

EDGE_BYTES = 2**20  # how much of each end of a weight file the digest reads


def weight_files(where: str | Path, gguf_file: Path | None) -> list[Path]:
    """The files a target's weights come from: its GGUF, else a local folder's checkpoint files."""
    if gguf_file is not None:
        return [gguf_file]
    folder = Path(where)
    if not folder.is_dir():
        return []
    return sorted(
        path for pattern in ("*.safetensors", "*.bin", "*.pt", "config.json") for path in folder.glob(pattern)
    )


def file_identity(path: Path) -> str:
    """'name size digest-of-both-ends' of a weight file."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            handle.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            digest.update(handle.read(EDGE_BYTES))
    return f"{path.name} {size} {digest.hexdigest()}"


def arithmetic(target: CausalLM, activations: str, forward: str) -> dict[str, str]:
    """How the target's logits are computed here, by what decides their rounding."""
    parts = {
        "dtype": str(target.dtype),
        "device": target.device.type,
        "forward": forward,
        "kernels": f"{target.kernels.mode}{' native' if target.kernels.native else ''}",
    }
    if target.device.type == "cuda":
        parts["device"] = (
            f"{torch.cuda.get_device_name(target.device)} {torch.cuda.get_device_capability(target.device)}"
        )
    if target.weights.rows_alike and target.kernels.native:  # every op splits by rows (engine/cpu/csrc)
        vnni = " vnni" if torch.ops.specserve.blocks_has_vnni() else ""
        parts["products"] = f"gguf blocks, {activations} activations, {ISAS[kernel_isa()]}{vnni}"
    else:  # BLAS, oneDNN or compiled kernels: rounding may depend on the threads and the plan's formulations
        parts["products"] = "torch" if target.device.type != "cpu" else f"torch, {torch.get_num_threads()} threads"
        parts["plan"] = repr(sorted(target.weights.plan.choices.items(), key=repr))
    for package in ("torch", "transformers", "specserve"):
        try:
            parts[package] = version(package)
        except PackageNotFoundError:
            parts[package] = "unknown"
    return parts


def system_fingerprint(parts: dict[str, str], files: list[Path]) -> str:
    """'fp_' and 12 hex digits of ``parts`` and ``files``' identities."""
    digest = hashlib.sha256()
    for key in sorted(parts):
        digest.update(f"{key}={parts[key]}\n".encode())
    for path in files:
        digest.update(f"file={file_identity(path)}\n".encode())
    return "fp_" + digest.hexdigest()[:12]
