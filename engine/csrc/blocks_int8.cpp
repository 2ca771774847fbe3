// Products of 4-bit blocks with int8 activations, as llama.cpp computes them: each row of activations
// is quantized to int8 in blocks of 32 (one float scale per block), and a block's dot product is
// taken in integers, exactly, then scaled. The weights are Q4_0 or Q4_1 blocks repacked 16 output
// rows at a time (kInt8Q4, packed_q4 in engine/blocks.py): per group of 16 rows and block of 32
// inputs, 320 bytes: 4 x 64 bytes of nibbles, lane-major (byte 4 * row + j: input 8 s + j in the
// low nibble, 8 s + 4 + j in the high one, for s = 0..3), then the 16 rows' d and m as float16.
// A weight is w = d * q + m (Q4_0: m = -8 d, exact), so a block contributes
//   d * d_x * sum(q * x_q) + m * (d_x * sum(x_q)),
// the integer sum taken by AVX-512 VNNI (vpdpbusd: 16 rows x 4 inputs per instruction) where the
// CPU has it, else by portable code whose every float operation is the same (fused multiply-adds
// as std::fmaf), so the two give the same bits. Each output row's arithmetic does not depend on how
// many rows are multiplied together: a verify row equals the decode step's row bit for bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "blocks.h"
#include "ops.h"
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define INT8_X86 1
#else
#define INT8_X86 0
#endif

namespace specserve_blocks {
namespace {

constexpr int64_t kGroup = 16, kBlock = 32, kNibbleBytes = 256, kPackedBytes = 320;

struct Activations {
  const int8_t* values;  // [N, I]
  const float* scales;   // [N, I / 32]
  const float* sums;     // [N, I / 32]
  int64_t in_features;
};

// Rows of x [N, I] -> int8 values [N, I], and per block of 32: the scale d_x [N, I / 32] (the
// largest magnitude over 127) and d_x * sum(x_q) [N, I / 32].
void quantize_rows(const float* x, int64_t num_rows, int64_t x_stride, int64_t in_features, int8_t* values,
                   float* scales, float* sums) {
  const int64_t num_blocks = in_features / kBlock;
  for (int64_t n = 0; n < num_rows; ++n) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* in = x + n * x_stride + b * kBlock;
      float largest = 0.0f;
      for (int j = 0; j < kBlock; ++j) largest = std::fmax(largest, std::fabs(in[j]));
      const float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
      int32_t total = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(in[j] * inverse));
        values[n * in_features + b * kBlock + j] = static_cast<int8_t>(q);
        total += q;
      }
      scales[n * num_blocks + b] = scale;
      sums[n * num_blocks + b] = scale * static_cast<float>(total);
    }
  }
}

// The portable path: groups [g_begin, g_end) for rows [0, R), out rows out_stride apart.
void groups_portable(const uint8_t* packed, const Activations& a, int64_t num_rows, int64_t g_begin, int64_t g_end,
                     float* out, int64_t out_stride) {
  const int64_t num_blocks = a.in_features / kBlock;
  for (int64_t g = g_begin; g < g_end; ++g) {
    for (int64_t n = 0; n < num_rows; ++n) {
      float acc[kGroup] = {}, shift[kGroup] = {};
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* block = packed + (g * num_blocks + b) * kPackedBytes;
        const int8_t* xq = a.values + n * a.in_features + b * kBlock;
        const float scale = a.scales[n * num_blocks + b], sum = a.sums[n * num_blocks + b];
        for (int lane = 0; lane < kGroup; ++lane) {
          int32_t even = 0, odd = 0;  // the low and the high nibbles' sums, as the vector path keeps them
          for (int s = 0; s < 4; ++s) {
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = block[64 * s + 4 * lane + j];
              even += (byte & 15) * xq[8 * s + j];
              odd += (byte >> 4) * xq[8 * s + 4 + j];
            }
          }
          uint16_t d, m;
          std::memcpy(&d, block + kNibbleBytes + 2 * lane, 2);
          std::memcpy(&m, block + kNibbleBytes + 2 * kGroup + 2 * lane, 2);
          acc[lane] = std::fmaf(static_cast<float>(even + odd), half_to_float(d) * scale, acc[lane]);
          shift[lane] = std::fmaf(half_to_float(m), sum, shift[lane]);
        }
      }
      for (int lane = 0; lane < kGroup; ++lane) out[n * out_stride + g * kGroup + lane] = acc[lane] + shift[lane];
    }
  }
}

#if INT8_X86
#define INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

// quantize_rows with vectors: the same values (the largest magnitude is exact, the product the same
// rounded product, and the conversion rounds to nearest even, as std::nearbyint does by default)
INT8_TARGET void quantize_rows_vnni(const float* x, int64_t num_rows, int64_t x_stride, int64_t in_features,
                                    int8_t* values, float* scales, float* sums) {
  const int64_t num_blocks = in_features / kBlock;
  for (int64_t n = 0; n < num_rows; ++n) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* in = x + n * x_stride + b * kBlock;
      const __m512 first = _mm512_loadu_ps(in), second = _mm512_loadu_ps(in + 16);
      const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second)));
      const float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
      const __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(first, _mm512_set1_ps(inverse)));
      const __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(second, _mm512_set1_ps(inverse)));
      int8_t* out = values + n * in_features + b * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(high));
      scales[n * num_blocks + b] = scale;
      sums[n * num_blocks + b] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(low, high)));
    }
  }
}

// R rows of one group: each block's nibbles are unpacked once and multiplied into every row.
template <int R>
INT8_TARGET void group_rows_vnni(const uint8_t* group, const Activations& a, int64_t row0, float* out,
                                 int64_t out_stride) {
  const int64_t num_blocks = a.in_features / kBlock;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[R], shift[R];
  for (int r = 0; r < R; ++r) acc[r] = shift[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = group + b * kPackedBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kNibbleBytes)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kNibbleBytes + 32)));
    __m512i nibbles[8];
    for (int s = 0; s < 4; ++s) {
      const __m512i bytes = _mm512_loadu_si512(block + 64 * s);
      nibbles[2 * s] = _mm512_and_si512(bytes, low);
      nibbles[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t n = row0 + r;
      const int8_t* xq = a.values + n * a.in_features + b * kBlock;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int s = 0; s < 4; ++s) {
        int32_t lo, hi;
        std::memcpy(&lo, xq + 8 * s, 4);
        std::memcpy(&hi, xq + 8 * s + 4, 4);
        even = _mm512_dpbusd_epi32(even, nibbles[2 * s], _mm512_set1_epi32(lo));
        odd = _mm512_dpbusd_epi32(odd, nibbles[2 * s + 1], _mm512_set1_epi32(hi));
      }
      const __m512 total = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      acc[r] = _mm512_fmadd_ps(total, _mm512_mul_ps(d, _mm512_set1_ps(a.scales[n * num_blocks + b])), acc[r]);
      shift[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sums[n * num_blocks + b]), shift[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (row0 + r) * out_stride, _mm512_add_ps(acc[r], shift[r]));
}

void groups_vnni(const uint8_t* packed, const Activations& a, int64_t num_rows, int64_t g_begin, int64_t g_end,
                 float* out, int64_t out_stride) {
  const int64_t num_blocks = a.in_features / kBlock;
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* group = packed + g * num_blocks * kPackedBytes;
    float* columns = out + g * kGroup;
    for (int64_t n = 0; n < num_rows; n += 8) {
      switch (std::min<int64_t>(8, num_rows - n)) {
#define INT8_ROWS(R) \
  case R: group_rows_vnni<R>(group, a, n, columns, out_stride); break;
        INT8_ROWS(1) INT8_ROWS(2) INT8_ROWS(3) INT8_ROWS(4) INT8_ROWS(5) INT8_ROWS(6) INT8_ROWS(7) INT8_ROWS(8)
#undef INT8_ROWS
      }
    }
  }
}
#endif

}  // namespace

bool has_vnni() {
#if INT8_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

void int8_times(const float* x, int64_t num_rows, int64_t x_stride, const uint8_t* packed, int64_t num_groups,
                int64_t in_features, int64_t isa, float* out, int64_t out_stride) {
  const int64_t num_blocks = in_features / kBlock;
  std::vector<int8_t> values(num_rows * in_features);
  std::vector<float> scales(num_rows * num_blocks), sums(num_rows * num_blocks);
#if INT8_X86
  const bool vector = isa == 2 && has_vnni();  // the same bits either way; isa 0 asks for the portable path
  if (vector) quantize_rows_vnni(x, num_rows, x_stride, in_features, values.data(), scales.data(), sums.data());
#else
  const bool vector = false;
#endif
  if (!vector) quantize_rows(x, num_rows, x_stride, in_features, values.data(), scales.data(), sums.data());
  const Activations a{values.data(), scales.data(), sums.data(), in_features};
  // about as many tasks as threads, at least one group each
  const int64_t grain = std::max<int64_t>(1, num_groups / (4 * at::get_num_threads()));
  at::parallel_for(0, num_groups, grain, [&](int64_t begin, int64_t end) {
#if INT8_X86
    if (vector) return groups_vnni(packed, a, num_rows, begin, end, out, out_stride);
#endif
    groups_portable(packed, a, num_rows, begin, end, out, out_stride);
  });
}

void int8_decode(const uint8_t* packed, int64_t in_features, int64_t g_begin, int64_t g_end, float* out,
                 int64_t out_stride) {
  const int64_t num_blocks = in_features / kBlock;
  for (int64_t g = g_begin; g < g_end; ++g) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = packed + (g * num_blocks + b) * kPackedBytes;
      for (int lane = 0; lane < kGroup; ++lane) {
        uint16_t d, m;
        std::memcpy(&d, block + kNibbleBytes + 2 * lane, 2);
        std::memcpy(&m, block + kNibbleBytes + 2 * kGroup + 2 * lane, 2);
        float* row = out + (g * kGroup + lane) * out_stride + b * kBlock;
        for (int s = 0; s < 4; ++s) {
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = block[64 * s + 4 * lane + j];
            // d * q is exact in float32, so the sum rounds once, as the blocks' own decoding
            row[8 * s + j] = std::fmaf(half_to_float(d), static_cast<float>(byte & 15), half_to_float(m));
            row[8 * s + 4 + j] = std::fmaf(half_to_float(d), static_cast<float>(byte >> 4), half_to_float(m));
          }
        }
      }
    }
  }
}

}  // namespace specserve_blocks
