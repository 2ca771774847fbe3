// What the per-instruction-set kernels share: the formats (GGML's type ids), the row chunk, and
// the half-precision conversion (exact, subnormals included).
#pragma once
#include <cstdint>
#include <cstring>

namespace specserve_blocks {

enum Format : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };
// not GGML types: Q4_0 or Q4_1 (kInt8Q4), or Q8_0 (kInt8Q8), blocks repacked 16 rows at a time for
// int8 activations (blocks_int8.cpp), 320 and 576 bytes per block of a group
constexpr int kInt8Q4 = 100, kInt8Q8 = 101, kInt8Rows = 16;

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 31, mantissa = h & 1023;
  uint32_t bits;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

#define SPECSERVE_DECLARE(ns)                                                                                   \
  namespace ns {                                                                                                \
  void times(int format, const uint8_t* w, int64_t row_bytes, int64_t in_features, int64_t o_begin,           \
             int64_t o_end, const float* x, int64_t num_rows, int64_t x_stride, float* out, int64_t out_stride); \
  void decode(int format, const uint8_t* w, int64_t row_bytes, int64_t in_features, int64_t o_begin,          \
              int64_t o_end, float* out, int64_t out_stride);                                                  \
  void attend(const float* q, int64_t q_head_stride, int64_t q_row_stride, const float* k, const float* v,     \
              int64_t kv_head_stride, int64_t kv_row_stride, const bool* mask, int64_t mask_row_stride,         \
              int64_t num_queries, int64_t window, int64_t dim, float scale, int64_t begin, int64_t end,        \
              float* out, int64_t tokens, int64_t token_stride, float* scores);                                \
  }
SPECSERVE_DECLARE(portable)
SPECSERVE_DECLARE(avx2)
SPECSERVE_DECLARE(avx512)
#undef SPECSERVE_DECLARE

// query rows of one KV head that attend (decode and verify) attends together: its scores buffer holds
// up to this many rows, each its window rounded up to whole vectors (attention_kernel.h)
constexpr int64_t kAttendGroupRows = 16;

// bytes past the block being multiplied that its kernel asks for from memory now (blocks_int8.cpp says why)
constexpr int64_t kPrefetchBytes = 2048;

int64_t best_isa();  // the widest instruction set this CPU runs: 0 portable, 1 AVX2, 2 AVX-512

// blocks_int8.cpp: whether this CPU runs its vector path; x [N, I] (rows x_stride apart) times a
// kInt8Q4 or kInt8Q8 weight of num_groups groups into out [N, 16 num_groups] (by VNNI where isa is 2
// and the CPU has it, else by AVX2 where isa is 1 or more, else portably: the same bits); groups
// [g_begin, g_end) decoded to float32; and one row of a group, the same values
bool has_vnni();
void int8_times(int64_t format, const float* x, int64_t num_rows, int64_t x_stride, const uint8_t* packed,
                int64_t num_groups, int64_t in_features, int64_t isa, float* out, int64_t out_stride);
void int8_decode(int64_t format, const uint8_t* packed, int64_t in_features, int64_t g_begin, int64_t g_end,
                 float* out, int64_t out_stride);
// row ``lane`` (0..15) of the group at ``group`` decoded to float32 into ``row`` [in_features]
void int8_decode_row(int64_t format, const uint8_t* group, int64_t in_features, int64_t lane, float* row);

}  // namespace specserve_blocks
