"""Builds engine/cpu/_blocks, the CPU products over GGUF quantized blocks (engine/cpu/csrc), with torch's
extension tooling when the project installs (``pip install --no-build-isolation -e .``, as the
Makefile does). Without a compiler, or without torch in the build environment, the install still
succeeds without it, and the engine multiplies float32 weights as before (its start-up line says so).
Everything else about the package is in pyproject.toml."""

import sys

from setuptools import setup

SOURCES = ["blocks_ops.cpp", "blocks_portable.cpp", "blocks_avx2.cpp", "blocks_avx512.cpp", "blocks_int8.cpp", "forward_ops.cpp"]


def extension_options() -> dict:
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("specserve: torch is not importable at build time; building without engine/cpu/_blocks", file=sys.stderr)
        return {}

    class OptionalBuild(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as error:  # no compiler, or one that fails: install without the extension
                print(f"specserve: engine/cpu/_blocks not built ({error}); float32 products only", file=sys.stderr)

    extension = CppExtension(
        "engine.cpu._blocks",
        [f"engine/cpu/csrc/{name}" for name in SOURCES],
        extra_compile_args=["-O3", "-fno-math-errno", "-Wno-psabi", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        depends=[
            "engine/cpu/csrc/blocks.h",
            "engine/cpu/csrc/blocks_kernel.h",
            "engine/cpu/csrc/attention_kernel.h",
            "engine/cpu/csrc/ops.h",
        ],
        py_limited_api=False,
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": OptionalBuild.with_options(use_ninja=False)}}


setup(**extension_options())
