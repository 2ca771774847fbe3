// Products with int8 activations, as llama.cpp computes them: each row of activations is
// quantized to int8 in blocks of 32 (one float scale per block), and a block's dot product is taken
// in integers, exactly, then scaled. The weights are Q4_0, Q4_1 or Q8_0 blocks repacked 16 output
// rows at a time (kInt8Q4 and kInt8Q8; engine/cpu/int8_blocks.py): per group of 16 rows and block of 32
// inputs, the rows' unsigned values lane-major, four inputs at a time (operand k, 64 bytes, holds
// inputs 4 k .. 4 k + 3 of each row: byte 4 * row + j), then the 16 rows' d and m as float16.
// kInt8Q4 keeps 4-bit values two to a byte (operands 2 s and 2 s + 1 in the low and high nibbles
// of 64 bytes), kInt8Q8 8-bit ones (Q8_0's q + 128). A weight is w = d * q + m (Q4_0: m = -8 d;
// Q8_0: m = -128 d), so a block contributes
//   d * d_x * sum(q * x_q) + m * (d_x * sum(x_q)),
// the integer sum taken by AVX-512 VNNI (vpdpbusd: 16 rows x 4 inputs per instruction) where the
// CPU has it, else by AVX2 (the same integer, below), else by portable code; every float operation
// is the same on the three (fused multiply-adds as std::fmaf), so they give the same bits. Each
// output row's arithmetic does not depend on how many rows are multiplied together: a verify row
// equals the decode step's row bit for bit.
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

constexpr int64_t kGroup = 16, kBlock = 32;

// The two layouts: the bytes of a block's values and of the whole block (then 16 d and 16 m, float16),
// and value j of operand k for a lane (row).
struct Nibbles {
  static constexpr int64_t kValueBytes = 256, kPackedBytes = kValueBytes + 4 * kGroup;
  static inline int32_t value(const uint8_t* block, int k, int lane, int j) {
    const uint8_t byte = block[64 * (k / 2) + 4 * lane + j];
    return k % 2 == 0 ? byte & 15 : byte >> 4;
  }
};
struct Bytes {
  static constexpr int64_t kValueBytes = 512, kPackedBytes = kValueBytes + 4 * kGroup;
  static inline int32_t value(const uint8_t* block, int k, int lane, int j) { return block[64 * k + 4 * lane + j]; }
};

struct Activations {
  const int8_t* values;   // [N, I]
  const float* scales;    // [N, I / 32]
  const float* sums;      // [N, I / 32]
  const int32_t* totals;  // [N, I / 32] sum(x_q), an integer
  int64_t in_features;
};

// Rows of x [N, I] -> int8 values [N, I], and per block of 32: the scale d_x [N, I / 32] (the
// largest magnitude over 127), d_x * sum(x_q) [N, I / 32] and sum(x_q) itself.
void quantize_rows(const float* x, int64_t num_rows, int64_t x_stride, int64_t in_features, int8_t* values,
                   float* scales, float* sums, int32_t* totals) {
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
      totals[n * num_blocks + b] = total;
    }
  }
}

// Storage for quantize_rows' output. A decode step's or a verify's few rows reuse one buffer per
// thread (a step quantizes 121 times: four allocations and frees each, while the product's other
// threads wait); a prompt's rows get their own, freed after the call.
class QuantizedRows {
 public:
  static constexpr int64_t kKeptRows = 16;
  QuantizedRows(int64_t num_rows, int64_t in_features) {
    thread_local Storage kept;
    Storage& storage = num_rows <= kKeptRows ? kept : own_;
    const int64_t blocks = num_rows * (in_features / kBlock);
    if (static_cast<int64_t>(storage.values.size()) < num_rows * in_features) storage.values.resize(num_rows * in_features);
    if (static_cast<int64_t>(storage.totals.size()) < blocks) storage.totals.resize(blocks);
    if (static_cast<int64_t>(storage.floats.size()) < 2 * blocks) storage.floats.resize(2 * blocks);
    values = storage.values.data(), totals = storage.totals.data();
    scales = storage.floats.data(), sums = scales + blocks;
  }
  int8_t* values;   // [N, I]
  float* scales;    // [N, I / 32]
  float* sums;      // [N, I / 32]
  int32_t* totals;  // [N, I / 32]

 private:
  struct Storage {
    std::vector<int8_t> values;
    std::vector<float> floats;  // the scales, then the sums
    std::vector<int32_t> totals;
  };
  Storage own_;
};

// The portable path: groups [g_begin, g_end) for rows [0, R), out rows out_stride apart.
template <typename L>
void groups_portable(const uint8_t* packed, const Activations& a, int64_t num_rows, int64_t g_begin, int64_t g_end,
                     float* out, int64_t out_stride) {
  const int64_t num_blocks = a.in_features / kBlock;
  for (int64_t g = g_begin; g < g_end; ++g) {
    for (int64_t n = 0; n < num_rows; ++n) {
      float acc[kGroup] = {}, shift[kGroup] = {};
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* block = packed + (g * num_blocks + b) * L::kPackedBytes;
        const int8_t* xq = a.values + n * a.in_features + b * kBlock;
        const float scale = a.scales[n * num_blocks + b], sum = a.sums[n * num_blocks + b];
        for (int lane = 0; lane < kGroup; ++lane) {
          int32_t even = 0, odd = 0;  // the even and the odd operands' sums, as the vector path keeps them
          for (int k = 0; k < 8; ++k) {
            int32_t& total = k % 2 == 0 ? even : odd;
            for (int j = 0; j < 4; ++j) total += L::value(block, k, lane, j) * xq[4 * k + j];
          }
          uint16_t d, m;
          std::memcpy(&d, block + L::kValueBytes + 2 * lane, 2);
          std::memcpy(&m, block + L::kValueBytes + 2 * kGroup + 2 * lane, 2);
          acc[lane] = std::fmaf(static_cast<float>(even + odd), half_to_float(d) * scale, acc[lane]);
          shift[lane] = std::fmaf(half_to_float(m), sum, shift[lane]);
        }
      }
      for (int lane = 0; lane < kGroup; ++lane) out[n * out_stride + g * kGroup + lane] = acc[lane] + shift[lane];
    }
  }
}

// Groups [g_begin, g_end) of a packed weight times rows [0, N), in chunks of up to K::kMaxRows rows,
// each chunk of R rows by K::rows<L, R> (the rows' accumulators in registers: R is a constant).
template <typename K, typename L, int R = 1>
inline void chunk(int64_t num_rows, const uint8_t* group, const Activations& a, int64_t row0, float* columns,
                  int64_t out_stride) {
  if constexpr (R < K::kMaxRows) {
    if (num_rows != R) return chunk<K, L, R + 1>(num_rows, group, a, row0, columns, out_stride);
  }
  K::template rows<L, R>(group, a, row0, columns, out_stride);
}
template <typename K, typename L>
void groups(const uint8_t* packed, const Activations& a, int64_t num_rows, int64_t g_begin, int64_t g_end, float* out,
            int64_t out_stride) {
  const int64_t num_blocks = a.in_features / kBlock;
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int64_t n = 0; n < num_rows; n += K::kMaxRows)
      chunk<K, L>(std::min<int64_t>(K::kMaxRows, num_rows - n), packed + g * num_blocks * L::kPackedBytes, a, n,
                  out + g * kGroup, out_stride);
}

#if INT8_X86
#define INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

// A weight's groups are read once a step, in address order, from memory (the weights a step reads do
// not fit in the caches): each block asks for the one kPrefetchBytes (blocks.h) ahead of it, so the
// loads arrive while the blocks before are multiplied. Left to the hardware's prefetchers, a group's first blocks
// waited on memory: a verify's forward over 300 tokens of context took 8-15% longer at one row, 9-19%
// at two, 14-16% at five (this Xeon; a prefetch past a weight's end is harmless, and no value changes).
template <typename L>
inline void prefetch_ahead(const uint8_t* block) {
  for (int64_t line = 0; line < L::kPackedBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + line), _MM_HINT_T0);
}

// quantize_rows with vectors: the same values (the largest magnitude is exact, the product the same
// rounded product, and the conversion rounds to nearest even, as std::nearbyint does by default)
INT8_TARGET void quantize_rows_vnni(const float* x, int64_t num_rows, int64_t x_stride, int64_t in_features,
                                    int8_t* values, float* scales, float* sums, int32_t* totals) {
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
      const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(low, high));
      scales[n * num_blocks + b] = scale;
      sums[n * num_blocks + b] = scale * static_cast<float>(total);
      totals[n * num_blocks + b] = total;
    }
  }
}

// A block's 8 operands: the nibbles unpacked, or the bytes as they are.
INT8_TARGET inline void operands(const uint8_t* block, Nibbles, __m512i* out) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int s = 0; s < 4; ++s) {
    const __m512i bytes = _mm512_loadu_si512(block + 64 * s);
    out[2 * s] = _mm512_and_si512(bytes, low);
    out[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
  }
}
INT8_TARGET inline void operands(const uint8_t* block, Bytes, __m512i* out) {
  for (int k = 0; k < 8; ++k) out[k] = _mm512_loadu_si512(block + 64 * k);
}

// R rows of one group: each block's operands are loaded once and multiplied into every row.
template <typename L, int R>
INT8_TARGET void group_rows_vnni(const uint8_t* group, const Activations& a, int64_t row0, float* out,
                                 int64_t out_stride) {
  const int64_t num_blocks = a.in_features / kBlock;
  __m512 acc[R], shift[R];  // in registers: the loops over rows are unrolled
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = shift[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = group + b * L::kPackedBytes;
    prefetch_ahead<L>(block);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + L::kValueBytes)));
    const __m512 m =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + L::kValueBytes + 2 * kGroup)));
    __m512i values[8];
    operands(block, L{}, values);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t n = row0 + r;
      const int8_t* xq = a.values + n * a.in_features + b * kBlock;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int s = 0; s < 4; ++s) {
        int32_t lo, hi;
        std::memcpy(&lo, xq + 8 * s, 4);
        std::memcpy(&hi, xq + 8 * s + 4, 4);
        even = _mm512_dpbusd_epi32(even, values[2 * s], _mm512_set1_epi32(lo));
        odd = _mm512_dpbusd_epi32(odd, values[2 * s + 1], _mm512_set1_epi32(hi));
      }
      const __m512 total = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      acc[r] = _mm512_fmadd_ps(total, _mm512_mul_ps(d, _mm512_set1_ps(a.scales[n * num_blocks + b])), acc[r]);
      shift[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sums[n * num_blocks + b]), shift[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (row0 + r) * out_stride, _mm512_add_ps(acc[r], shift[r]));
}

struct Vnni {
  static constexpr int kMaxRows = 8;
  template <typename L, int R>
  static void rows(const uint8_t* group, const Activations& a, int64_t row0, float* out, int64_t out_stride) {
    group_rows_vnni<L, R>(group, a, row0, out, out_stride);
  }
};

// AVX2 (no VNNI): each operand as two halves of 8 lanes (its bytes 0-31 and 32-63), one half at a
// time, R rows at once. vpmaddubsw sums pairs of products into 16 bits, vpmaddwd by ones the pairs
// into 32. For 4-bit values (at most 15) a pair's sum, at most 2 * 15 * 127, never saturates. Bytes
// (q + 128, up to 255) could (2 * 255 * 127 > 32767), so their sum is taken over q = v - 128 with
// the sign moved onto x (|q| * sign(x, q), a pair at most 2 * 128 * 127), and 128 * sum(x_q) added
// back: the same integer as VNNI's, scaled by the same float operations, so the same bits.
#define INT8_AVX2 __attribute__((target("avx2,f16c,fma")))

// quantize_rows with AVX2, the same values as the VNNI one's (and for the same reasons): the rows'
// quantization is serial, before the products' threads start: as a scalar loop it took 6% of the
// first thread's time in decode steps on a Zen 3 host (121 products a step) while the other waited.
INT8_AVX2 void quantize_rows_avx2(const float* x, int64_t num_rows, int64_t x_stride, int64_t in_features,
                                  int8_t* values, float* scales, float* sums, int32_t* totals) {
  const int64_t num_blocks = in_features / kBlock;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the packs' dwords back in input order
  for (int64_t n = 0; n < num_rows; ++n) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* in = x + n * x_stride + b * kBlock;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(in + 8 * i);
      const __m256 most = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
      __m128 four = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
      four = _mm_max_ps(four, _mm_movehl_ps(four, four));
      const float largest = _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
      const float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
      // |q| <= 127: the saturating packs keep every value
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + n * in_features + b * kBlock),
                          _mm256_permutevar8x32_epi32(bytes, order));
      const __m256i eight = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
      sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4e));
      const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xb1)));
      scales[n * num_blocks + b] = scale;
      sums[n * num_blocks + b] = scale * static_cast<float>(total);
      totals[n * num_blocks + b] = total;
    }
  }
}

INT8_AVX2 inline void operands_half(const uint8_t* half, Nibbles, __m256i* out) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int s = 0; s < 4; ++s) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + 64 * s));
    out[2 * s] = _mm256_and_si256(bytes, low);
    out[2 * s + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
  }
}
INT8_AVX2 inline void operands_half(const uint8_t* half, Bytes, __m256i* out) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int k = 0; k < 8; ++k)  // q = v - 128, as int8
    out[k] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + 64 * k)), bias);
}
// A block's 8 lanes' integer sums over its 32 inputs xq: 4-bit values' pairs add up in 16 bits over
// all eight operands (at most 8 * 2 * 15 * 127 = 30,480) before one vpmaddwd; bytes' are widened
// operand by operand.
INT8_AVX2 inline __m256i block_sum(const __m256i* values, const int8_t* xq, int32_t, Nibbles) {
  __m256i pairs = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) {
    int32_t four;
    std::memcpy(&four, xq + 4 * k, 4);
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(values[k], _mm256_set1_epi32(four)));
  }
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
INT8_AVX2 inline __m256i block_sum(const __m256i* q, const int8_t* xq, int32_t x_total, Bytes) {
  __m256i total = _mm256_set1_epi32(128 * x_total);  // what q = v - 128 leaves out of sum(x_q v)
  for (int k = 0; k < 8; ++k) {
    int32_t four;
    std::memcpy(&four, xq + 4 * k, 4);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q[k]), _mm256_sign_epi8(_mm256_set1_epi32(four), q[k]));
    total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  return total;
}

template <typename L, int R>
INT8_AVX2 void group_rows_avx2(const uint8_t* group, const Activations& a, int64_t row0, float* out,
                               int64_t out_stride) {
  const int64_t num_blocks = a.in_features / kBlock;
  for (int h = 0; h < 2; ++h) {  // lanes 8 h .. 8 h + 7
    __m256 acc[R], shift[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = shift[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = group + b * L::kPackedBytes;
      if (h == 0) prefetch_ahead<L>(block);  // the second half reads what the first brought in
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + L::kValueBytes + 16 * h)));
      const __m256 m = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + L::kValueBytes + 2 * kGroup + 16 * h)));
      __m256i values[8];
      operands_half(block + 32 * h, L{}, values);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t n = row0 + r;
        const int8_t* xq = a.values + n * a.in_features + b * kBlock;
        const __m256i total = block_sum(values, xq, a.totals[n * num_blocks + b], L{});
        const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(a.scales[n * num_blocks + b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scaled, acc[r]);
        shift[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sums[n * num_blocks + b]), shift[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + (row0 + r) * out_stride + 8 * h, _mm256_add_ps(acc[r], shift[r]));
  }
}

struct Avx2 {
  static constexpr int kMaxRows = 4;
  template <typename L, int R>
  static void rows(const uint8_t* group, const Activations& a, int64_t row0, float* out, int64_t out_stride) {
    group_rows_avx2<L, R>(group, a, row0, out, out_stride);
  }
};
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

void int8_times(int64_t format, const float* x, int64_t num_rows, int64_t x_stride, const uint8_t* packed,
                int64_t num_groups, int64_t in_features, int64_t isa, float* out, int64_t out_stride) {
  const QuantizedRows rows(num_rows, in_features);
  // the same bits on every path; isa 0 asks for the portable one, 1 for AVX2's
  const bool vnni = isa == 2 && has_vnni(), avx2 = !vnni && isa >= 1;  // isa: checked against the CPU
#if INT8_X86
  if (vnni) quantize_rows_vnni(x, num_rows, x_stride, in_features, rows.values, rows.scales, rows.sums, rows.totals);
  else if (avx2) quantize_rows_avx2(x, num_rows, x_stride, in_features, rows.values, rows.scales, rows.sums, rows.totals);
  else
#endif
    quantize_rows(x, num_rows, x_stride, in_features, rows.values, rows.scales, rows.sums, rows.totals);
  const Activations a{rows.values, rows.scales, rows.sums, rows.totals, in_features};
  // about as many tasks as threads, at least one group each
  const int64_t grain = std::max<int64_t>(1, num_groups / (4 * at::get_num_threads()));
  const bool nibbles = format == kInt8Q4;
  at::parallel_for(0, num_groups, grain, [&](int64_t begin, int64_t end) {
#if INT8_X86
    if (vnni && nibbles) return groups<Vnni, Nibbles>(packed, a, num_rows, begin, end, out, out_stride);
    if (vnni) return groups<Vnni, Bytes>(packed, a, num_rows, begin, end, out, out_stride);
    if (avx2 && nibbles) return groups<Avx2, Nibbles>(packed, a, num_rows, begin, end, out, out_stride);
    if (avx2) return groups<Avx2, Bytes>(packed, a, num_rows, begin, end, out, out_stride);
#endif
    if (nibbles) return groups_portable<Nibbles>(packed, a, num_rows, begin, end, out, out_stride);
    groups_portable<Bytes>(packed, a, num_rows, begin, end, out, out_stride);
  });
}

namespace {
// Row ``lane`` of a group (its blocks from ``group``) decoded to float32 into ``row`` [I]
template <typename L>
void decode_lane(const uint8_t* group, int64_t in_features, int lane, float* row) {
  for (int64_t b = 0; b < in_features / kBlock; ++b) {
    const uint8_t* block = group + b * L::kPackedBytes;
    uint16_t d, m;
    std::memcpy(&d, block + L::kValueBytes + 2 * lane, 2);
    std::memcpy(&m, block + L::kValueBytes + 2 * kGroup + 2 * lane, 2);
    const float scale = half_to_float(d), shift = half_to_float(m);
    // d * q is exact in float32, so the sum rounds once, as the blocks' own decoding
    for (int k = 0; k < 8; ++k)
      for (int j = 0; j < 4; ++j)
        row[b * kBlock + 4 * k + j] = std::fmaf(scale, static_cast<float>(L::value(block, k, lane, j)), shift);
  }
}
}  // namespace

void int8_decode(int64_t format, const uint8_t* packed, int64_t in_features, int64_t g_begin, int64_t g_end,
                 float* out, int64_t out_stride) {
  const int64_t group_bytes = in_features / kBlock * (format == kInt8Q4 ? Nibbles::kPackedBytes : Bytes::kPackedBytes);
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int lane = 0; lane < kGroup; ++lane) int8_decode_row(format, packed + g * group_bytes, in_features, lane,
                                                             out + (g * kGroup + lane) * out_stride);
}

void int8_decode_row(int64_t format, const uint8_t* group, int64_t in_features, int64_t lane, float* row) {
  if (format == kInt8Q4) return decode_lane<Nibbles>(group, in_features, static_cast<int>(lane), row);
  decode_lane<Bytes>(group, in_features, static_cast<int>(lane), row);
}

}  // namespace specserve_blocks
