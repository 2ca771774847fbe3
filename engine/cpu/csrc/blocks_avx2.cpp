#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c")
#define BLOCKS_X86 1  // this file's target has the x86 intrinsics the kernel uses (F16C)
#endif
#define BLOCKS_NS avx2
#define BLOCKS_LANES 8
#include "blocks_kernel.h"
