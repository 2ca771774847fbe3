// The reference path: whatever the compiler's baseline target is (SSE2 on x86-64, NEON on arm64).
#define BLOCKS_NS portable
#define BLOCKS_LANES 4
#include "blocks_kernel.h"
