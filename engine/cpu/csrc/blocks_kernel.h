// Products over GGUF quantized blocks, computed in float32: each block is decoded to the exact
// float32 weights the gguf package's dequantization gives, and multiplied by float32 activations
// with float32 accumulation. Included once per instruction set by blocks_{portable,avx2,avx512}.cpp,
// each of which names the namespace (BLOCKS_NS), the vector width in floats (BLOCKS_LANES: 16 is one
// zmm, 8 one ymm, 4 one xmm) and its target; the code is the same, written with GCC's vector extensions.
#include <cstdint>
#include <cstring>

#include "blocks.h"
// BLOCKS_X86: set by a file whose #pragma GCC target provides the x86 intrinsics used below (a
// pragma defines no __AVX512F__ or __F16C__, so the macros cannot tell); unset, the code is portable.
#ifndef BLOCKS_X86
#define BLOCKS_X86 0
#endif
#if BLOCKS_X86
#include <immintrin.h>
#endif

namespace specserve_blocks {
namespace BLOCKS_NS {

constexpr int kLanes = BLOCKS_LANES;
typedef float vf __attribute__((vector_size(4 * kLanes)));       // kLanes float32
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));     // kLanes int32
typedef uint8_t vu8 __attribute__((vector_size(kLanes)));        // kLanes uint8
typedef int8_t vi8 __attribute__((vector_size(kLanes)));         // kLanes int8

template <typename V>
static inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The sum of a vector's lanes, pairwise (a tree of kLanes - 1 additions, log2(kLanes) deep).
static inline float lanes_sum(vf v) {
#if BLOCKS_LANES == 16
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif BLOCKS_LANES == 8
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#else
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2);
#endif
  return v[0];
}

static inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if BLOCKS_X86
  return _cvtsh_ss(h);  // F16C: exact, as half_to_float
#else
  return half_to_float(h);
#endif
}

static inline vf to_float(vi v) { return __builtin_convertvector(v, vf); }
static inline vi widen(vu8 v) { return __builtin_convertvector(v, vi); }
// signed bytes through the unsigned widening (GCC scalarises the signed one): (v + 128) - 128
static inline vi widen(vi8 v) { return widen(vu8(v) ^ 0x80) - 128; }

// 32 weights from 16 bytes of 4-bit values (low nibbles: weights 0-15, high: 16-31), each
// weight(q) for q in 0..15 (plus a fifth bit from qh, where given), into 32 / kLanes vectors.
template <typename Weight>
static inline void nibbles(const uint8_t* qs, const uint8_t* qh_bytes, vf* out, Weight weight) {
  uint32_t qh = 0;
  if (qh_bytes) std::memcpy(&qh, qh_bytes, 4);
  for (int c = 0; c < 16; c += kLanes) {
    const vu8 bytes = load<vu8>(qs + c);
    vi lo = widen(vu8(bytes & 15)), hi = widen(vu8(bytes >> 4));
    if (qh_bytes) {
      vi bits_lo, bits_hi;
      for (int j = 0; j < kLanes; ++j) {
        bits_lo[j] = static_cast<int32_t>(((qh >> (c + j)) & 1) << 4);
        bits_hi[j] = static_cast<int32_t>(((qh >> (c + j + 16)) & 1) << 4);
      }
      lo |= bits_lo;
      hi |= bits_hi;
    }
    out[c / kLanes] = weight(to_float(lo));
    out[(16 + c) / kLanes] = weight(to_float(hi));
  }
}

#if BLOCKS_X86 && BLOCKS_LANES == 16
// AVX-512: a block of 4-bit values decodes through a table of its 16 possible weights, table[q] =
// q * d + m (exact, as the arithmetic path), looked up by vpermps, which reads the low 4 bits of each
// lane: the widened bytes index the low nibbles as they are and the high ones shifted down.
static inline void nibbles_by_table(const uint8_t* qs, float d, float m, vf* out) {
  const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_ps(d), _mm512_set1_ps(m));
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  out[0] = (vf)_mm512_permutexvar_ps(bytes, table);
  out[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#define SPECSERVE_NIBBLE_TABLE 1
#endif

// Each decoder writes one block's weights, in order, to out (kBlock / kLanes vectors). The small
// blocks' vectors stay in registers: a vector stored and loaded back at once stalls store forwarding.
struct Q4_0 {
  static constexpr int kBlock = 32, kBytes = 18;
  static inline void decode(const uint8_t* b, vf* out) {
    const float d = half_at(b);
#ifdef SPECSERVE_NIBBLE_TABLE
    nibbles_by_table(b + 2, d, -8.0f * d, out);  // (q - 8) d = q d - 8 d, both exact
#else
    nibbles(b + 2, nullptr, out, [d](vf q) { return (q - 8.0f) * d; });
#endif
  }
};

struct Q4_1 {
  static constexpr int kBlock = 32, kBytes = 20;
  static inline void decode(const uint8_t* b, vf* out) {
    const float d = half_at(b), m = half_at(b + 2);
    // d * q is exact in float32 (11 + 4 significant bits), so the sum rounds once, fused or not
#ifdef SPECSERVE_NIBBLE_TABLE
    nibbles_by_table(b + 4, d, m, out);
#else
    nibbles(b + 4, nullptr, out, [d, m](vf q) { return q * d + m; });
#endif
  }
};

struct Q5_0 {
  static constexpr int kBlock = 32, kBytes = 22;
  static inline void decode(const uint8_t* b, vf* out) {
    const float d = half_at(b);
    nibbles(b + 6, b + 2, out, [d](vf q) { return (q - 16.0f) * d; });
  }
};

struct Q5_1 {
  static constexpr int kBlock = 32, kBytes = 24;
  static inline void decode(const uint8_t* b, vf* out) {
    const float d = half_at(b), m = half_at(b + 2);
    nibbles(b + 8, b + 4, out, [d, m](vf q) { return q * d + m; });
  }
};

struct Q8_0 {
  static constexpr int kBlock = 32, kBytes = 34;
  static inline void decode(const uint8_t* b, vf* out) {
    const float d = half_at(b);
#if BLOCKS_X86 && BLOCKS_LANES == 16
    for (int c = 0; c < 2; ++c)
      out[c] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * c)))) * d;
#else
    for (int c = 0; c < 32; c += kLanes) out[c / kLanes] = to_float(widen(load<vi8>(b + 2 + c))) * d;
#endif
  }
};

// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and minimums.
struct Q4_K {
  static constexpr int kBlock = 256, kBytes = 144;
  static inline void decode(const uint8_t* b, vf* out) {
    alignas(64) float values[kBlock];
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* s = b + 4;  // 12 bytes: scales and minimums of the 8 sub-blocks, 6 bits each
    const uint8_t* qs = b + 16;
    for (int sub = 0; sub < 8; ++sub) {
      int scale, min;
      if (sub < 4) {
        scale = s[sub] & 63;
        min = s[sub + 4] & 63;
      } else {
        scale = (s[sub + 4] & 15) | ((s[sub - 4] >> 6) << 4);
        min = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
      }
      const float step = d * static_cast<float>(scale), shift = dmin * static_cast<float>(min);
      const uint8_t* q = qs + (sub / 2) * 32;
      const int up = (sub & 1) * 4;
      for (int j = 0; j < 32; ++j) values[sub * 32 + j] = step * static_cast<float>((q[j] >> up) & 15) - shift;
    }
    std::memcpy(out, values, sizeof values);
  }
};

struct Q6_K {
  static constexpr int kBlock = 256, kBytes = 210;
  static inline void decode(const uint8_t* b, vf* out) {
    alignas(64) float values[kBlock];
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int half = 0; half < 2; ++half) {
      for (int r = 0; r < 128; ++r) {
        const int low = r < 64 ? ql[half * 64 + r] & 15 : ql[half * 64 + r - 64] >> 4;
        const int high = (qh[half * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
        const int e = half * 128 + r;
        values[e] = (d * static_cast<float>(scales[e / 16])) * static_cast<float>((low | (high << 4)) - 32);
      }
    }
    std::memcpy(out, values, sizeof values);
  }
};

// out[n * out_stride + o] = sum_i x[n * x_stride + i] * W[o, i] for rows n < R and o in [o_begin, o_end),
// W's rows being row_bytes apart in w. Each block is decoded once and used by all R rows; each row
// keeps two accumulators (alternate vectors of a block), two dependency chains.
template <typename F, int R>
static void rows_times(const uint8_t* w, int64_t row_bytes, int64_t in_features, int64_t o_begin, int64_t o_end,
                       const float* x, int64_t x_stride, float* out, int64_t out_stride) {
  vf decoded[F::kBlock / kLanes];
  const int64_t num_blocks = in_features / F::kBlock;
  for (int64_t o = o_begin; o < o_end; ++o) {
    const uint8_t* row = w + o * row_bytes;
    vf acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf{};
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
      __builtin_prefetch(row + blk * F::kBytes + kPrefetchBytes);
      F::decode(row + blk * F::kBytes, decoded);
      const float* xb = x + blk * F::kBlock;
      for (int j = 0; j < F::kBlock; j += 2 * kLanes) {
        const vf w0 = decoded[j / kLanes], w1 = decoded[j / kLanes + 1];
        for (int r = 0; r < R; ++r) {
          acc[r][0] += w0 * load<vf>(xb + r * x_stride + j);
          acc[r][1] += w1 * load<vf>(xb + r * x_stride + j + kLanes);
        }
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride + o] = lanes_sum(acc[r][0] + acc[r][1]);
  }
}

template <typename F>
static void format_times(const uint8_t* w, int64_t row_bytes, int64_t in_features, int64_t o_begin, int64_t o_end,
                         const float* x, int64_t num_rows, int64_t x_stride, float* out, int64_t out_stride) {
  constexpr int kRows = kLanes >= 16 ? 8 : 4;  // rows sharing a decoded block: what the registers hold
  for (int64_t n = 0; n < num_rows; n += kRows) {
    const int64_t rows = num_rows - n < kRows ? num_rows - n : kRows;
    const float* xs = x + n * x_stride;
    float* os = out + n * out_stride;
    switch (rows) {
#define SPECSERVE_ROWS(R) \
  case R: rows_times<F, R>(w, row_bytes, in_features, o_begin, o_end, xs, x_stride, os, out_stride); break;
      SPECSERVE_ROWS(1) SPECSERVE_ROWS(2) SPECSERVE_ROWS(3) SPECSERVE_ROWS(4)
#if BLOCKS_LANES >= 16
      SPECSERVE_ROWS(5) SPECSERVE_ROWS(6) SPECSERVE_ROWS(7) SPECSERVE_ROWS(8)
#endif
#undef SPECSERVE_ROWS
    }
  }
}

template <typename F>
static void format_decode(const uint8_t* w, int64_t row_bytes, int64_t in_features, int64_t o_begin, int64_t o_end,
                          float* out, int64_t out_stride) {
  for (int64_t o = o_begin; o < o_end; ++o)
    for (int64_t blk = 0; blk < in_features / F::kBlock; ++blk)
      F::decode(w + o * row_bytes + blk * F::kBytes, reinterpret_cast<vf*>(out + o * out_stride + blk * F::kBlock));
}

#define SPECSERVE_FORMATS(X) X(kQ4_0, Q4_0) X(kQ4_1, Q4_1) X(kQ5_0, Q5_0) X(kQ5_1, Q5_1) X(kQ8_0, Q8_0) X(kQ4_K, Q4_K) X(kQ6_K, Q6_K)

void times(int format, const uint8_t* w, int64_t row_bytes, int64_t in_features, int64_t o_begin, int64_t o_end,
           const float* x, int64_t num_rows, int64_t x_stride, float* out, int64_t out_stride) {
  switch (format) {
#define SPECSERVE_CASE(id, F) \
  case id: format_times<F>(w, row_bytes, in_features, o_begin, o_end, x, num_rows, x_stride, out, out_stride); break;
    SPECSERVE_FORMATS(SPECSERVE_CASE)
#undef SPECSERVE_CASE
  }
}

void decode(int format, const uint8_t* w, int64_t row_bytes, int64_t in_features, int64_t o_begin, int64_t o_end,
            float* out, int64_t out_stride) {
  switch (format) {
#define SPECSERVE_CASE(id, F) \
  case id: format_decode<F>(w, row_bytes, in_features, o_begin, o_end, out, out_stride); break;
    SPECSERVE_FORMATS(SPECSERVE_CASE)
#undef SPECSERVE_CASE
  }
}

}  // namespace BLOCKS_NS
}  // namespace specserve_blocks

#include "attention_kernel.h"  // the attention of decode and verify, for the same instruction set
