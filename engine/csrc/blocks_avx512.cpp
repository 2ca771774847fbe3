#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BLOCKS_X86 1
#else
#define BLOCKS_X86 0
#endif
#define BLOCKS_NS avx512
#define BLOCKS_LANES 16
#include "blocks_kernel.h"
