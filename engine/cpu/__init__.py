"""One backend's numerics: a GGUF target's products over its own quantized blocks (C++ kernels in
csrc/, built as ``_blocks``), int8 activations, the matmul plan that chooses blocks or tiles per
weight shape and the plan's cache on disk, and the CPU thread settings. Nothing here imports the
model or the engine above it."""
