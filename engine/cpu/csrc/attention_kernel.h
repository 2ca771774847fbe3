// Attention of a few query rows over a window of the KV cache, in float32: decode and verify.
// Included by blocks_kernel.h, so it is compiled once per instruction set like the products, with
// the same vector type (vf, kLanes float32 lanes). Each (KV head, query row) is one task: scores
// q.k * scale over the window, kLanes keys at a time (masked positions skipped or set aside), a
// softmax taken from the row's maximum, and the probabilities times the values, summed in float32
// in order of position. A KV head's rows within a thread's tasks take turns tile of keys by tile
// of keys (attend_group), so its keys and values are read once for them all, not once a row. The
// exponentials are taken kLanes at a time (exp_lanes: within 2 ulp of the exact value, as torch's
// own vectorised exp is within 1).
#include <algorithm>
#include <cmath>
#include <limits>

namespace specserve_blocks {
namespace BLOCKS_NS {

constexpr int64_t kMostChunks = 256 / kLanes;  // a head of up to 256 dimensions

// exp of each lane: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes'
// coefficients), times 2^n built in the exponent bits; -inf (a masked score) gives exactly 0
static inline vf exp_lanes(vf x) {
  const vf masked = x < -87.0f ? vf{} + 1.0f : vf{};
  x = x < -87.0f ? vf{} - 87.0f : x;
  x = x > 88.0f ? vf{} + 88.0f : x;
  const vf shifter = vf{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.44269504088896341f + shifter) - shifter;
  const vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const vf result = p * scale;
  return masked != 0.0f ? vf{} : result;
}

// The lane sums of kLanes vectors at once: lane j of the result is lanes_sum(v[j]), the same tree
// of additions (so the same bits), where each shuffle and addition serves two vectors' trees: at each
// level pairs of vectors fold into one holding both halves' partial sums. v is overwritten.
static inline vf lanes_sums(vf* v) {
#if BLOCKS_LANES == 16
  for (int j = 0; j < 8; ++j)  // lanes i and i + 8 of each: 8 partial sums a vector, two vectors in one
    v[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)  // then i and i + 4 of those eight: four vectors' in one
    v[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    v[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif BLOCKS_LANES == 8
  for (int j = 0; j < 4; ++j)
    v[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int j = 0; j < 2; ++j)
    v[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
  for (int j = 0; j < 2; ++j)
    v[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 4, 5) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 2, 3, 6, 7);
  return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6) + __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7);
#endif
}

// How many of kLanes keys a mask row lets a query see (bools are bytes 0 or 1: a popcount of 8 at a time)
static inline int seen_of(const bool* allowed) {
  int seen = 0;
  if constexpr (kLanes % 8 == 0) {
    for (int j = 0; j < kLanes; j += 8) {
      uint64_t bytes;
      std::memcpy(&bytes, allowed + j, 8);
      seen += __builtin_popcountll(bytes);
    }
  } else {
    for (int j = 0; j < kLanes; ++j) seen += allowed[j];
  }
  return seen;
}

// q.k of a query row (chunks of kLanes) and a key, its chunks' products added in order, each fused
// with the addition it joins: the first product is rounded on its own (the barrier keeps the
// compiler from fusing it into the second's addition once C unrolls the loop), so a dot is the same
// bits whether C is the chunk count or 0 (any, read from chunks).
template <int C>
static inline vf key_dot(const vf* query_chunks, const float* key, int64_t chunks) {
  vf dot = query_chunks[0] * load<vf>(key);
#if BLOCKS_X86
  asm("" : "+v"(dot));
#endif
  for (int64_t c = 1; c < (C > 0 ? C : chunks); ++c) dot += query_chunks[c] * load<vf>(key + c * kLanes);
  return dot;
}

// Keys a group's rows score (and values they sum) before the next keys: 64 keys' rows of a head
// of up to 64 dimensions are 16 KB, which stay in the core's first-level cache while every row of
// the group reads them. Each row alone would read the whole window, as many times as there are rows:
// over 1,600 keys a KV head's keys and values (800 KB) outgrow a Zen 3 core's 512 KB second-level
// cache, and a verify of five tokens read them 15 times from the shared cache.
constexpr int64_t kTileKeys = 64;

// Rows [first, first + count) of one KV head's query rows, together, each with the arithmetic it
// has alone: its scores over the window kLanes keys at a time (their lane sums together:
// lanes_sums; a block the row sees none of skipped, masked keys in one it sees part of scored, then
// set aside), a softmax from its maximum, the weighted values summed in order of position; only
// the order in which rows and tiles of keys take turns differs, so a row's bits do not depend on
// the rows beside it. C: the head's chunks of kLanes, a constant the loops unroll by (0: any, read
// from dim); the same bits either way. scores: count rows, stride floats apart.
template <int C>
static void attend_group(const float* queries, int64_t q_row_stride, const float* keys, const float* values,
                         int64_t kv_row_stride, const bool* mask, int64_t mask_row_stride, int64_t head,
                         int64_t first, int64_t count, int64_t num_queries, int64_t window, int64_t dim, float scale,
                         float* out, int64_t tokens, int64_t token_stride, float* scores, int64_t stride) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t chunks = C > 0 ? C : dim / kLanes;
  const int64_t whole = window / kLanes * kLanes;  // keys scored kLanes at a time; the rest one by one
  float best[kAttendGroupRows];
  vf best_lanes[kAttendGroupRows];  // the blocks a row sees whole: their maximum lane by lane
  for (int64_t r = 0; r < count; ++r) best[r] = kNone, best_lanes[r] = vf{} + kNone;
  for (int64_t tile = 0; tile < window; tile += kTileKeys) {
    const int64_t tile_whole = std::min(tile + kTileKeys, whole), tile_end = std::min(tile + kTileKeys, window);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row = first + r;
      const float* query = queries + row * q_row_stride;
      const bool* allowed = mask != nullptr ? mask + row * mask_row_stride : nullptr;
      float* row_scores = scores + r * stride;
      vf query_chunks[kMostChunks];
      for (int64_t c = 0; c < chunks; ++c) query_chunks[c] = load<vf>(query + c * kLanes);
      int64_t w = tile;
      for (; w < tile_whole; w += kLanes) {
        const int seen = allowed != nullptr ? seen_of(allowed + w) : kLanes;
        if (seen == 0) {
          for (int j = 0; j < kLanes; ++j) row_scores[w + j] = kNone;
          continue;
        }
        vf dots[kLanes];
        for (int j = 0; j < kLanes; ++j) dots[j] = key_dot<C>(query_chunks, keys + (w + j) * kv_row_stride, chunks);
        const vf block = lanes_sums(dots) * scale;
        if (seen == kLanes) {
          std::memcpy(row_scores + w, &block, sizeof block);
          best_lanes[r] = block > best_lanes[r] ? block : best_lanes[r];
          continue;
        }
        for (int j = 0; j < kLanes; ++j) {
          row_scores[w + j] = allowed[w + j] ? block[j] : kNone;
          best[r] = allowed[w + j] && block[j] > best[r] ? block[j] : best[r];
        }
      }
      for (; w < tile_end; ++w) {  // the last few keys one at a time
        if (allowed != nullptr && !allowed[w]) {
          row_scores[w] = kNone;
          continue;
        }
        row_scores[w] = lanes_sum(key_dot<C>(query_chunks, keys + w * kv_row_stride, chunks)) * scale;
        best[r] = row_scores[w] > best[r] ? row_scores[w] : best[r];
      }
    }
  }
  const int64_t padded = (window + kLanes - 1) / kLanes * kLanes;
  for (int64_t r = 0; r < count; ++r) {  // each row's weights: exp(score - its maximum)
    for (int j = 0; j < kLanes; ++j) best[r] = best_lanes[r][j] > best[r] ? best_lanes[r][j] : best[r];  // any order
    if (best[r] == kNone) continue;  // a row that sees nothing (zeros, below)
    float* row_scores = scores + r * stride;
    for (int64_t w = window; w < padded; ++w) row_scores[w] = kNone;
    for (int64_t w = 0; w < padded; w += kLanes) {
      const vf weights = exp_lanes(load<vf>(row_scores + w) - best[r]);
      std::memcpy(row_scores + w, &weights, sizeof weights);
    }
  }
  vf sums[kAttendGroupRows][kMostChunks];
  float totals[kAttendGroupRows] = {};
  for (int64_t r = 0; r < count; ++r)
    for (int64_t c = 0; c < chunks; ++c) sums[r][c] = vf{};
  for (int64_t tile = 0; tile < window; tile += kTileKeys) {
    const int64_t tile_end = std::min(tile + kTileKeys, window);
    for (int64_t r = 0; r < count; ++r) {
      if (best[r] == kNone) continue;
      const float* row_scores = scores + r * stride;
      vf row_sums[kMostChunks];  // in registers over the tile
      for (int64_t c = 0; c < chunks; ++c) row_sums[c] = sums[r][c];
      float total = totals[r];
      for (int64_t w = tile; w < tile_end; ++w) {
        const float weight = row_scores[w];
        if (weight == 0.0f) continue;  // masked, or too small to count
        total += weight;
        const float* value = values + w * kv_row_stride;
        for (int64_t c = 0; c < chunks; ++c) row_sums[c] += weight * load<vf>(value + c * kLanes);
      }
      for (int64_t c = 0; c < chunks; ++c) sums[r][c] = row_sums[c];
      totals[r] = total;
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row = first + r;
    // row r of KV head h is query head h * G + r / tokens at token r % tokens (G = num_queries / tokens)
    float* dest = out + (row % tokens) * token_stride + (head * (num_queries / tokens) + row / tokens) * dim;
    if (best[r] == kNone) {  // a row that sees nothing: zeros
      std::memset(dest, 0, sizeof(float) * dim);
      continue;
    }
    const float inverse = 1.0f / totals[r];  // total >= 1: the row's maximum contributes exp(0)
    for (int64_t c = 0; c < chunks; ++c) {
      const vf result = sums[r][c] * inverse;
      std::memcpy(dest + c * kLanes, &result, sizeof result);
    }
  }
}

// Tasks [begin, end) of (KV head, query row): each KV head's rows among them in groups of up to
// kAttendGroupRows, attended together (attend_group), so a head's keys and values are read once a group.
template <int C>
static void attend_rows(const float* q, int64_t q_head_stride, int64_t q_row_stride, const float* k, const float* v,
                        int64_t kv_head_stride, int64_t kv_row_stride, const bool* mask, int64_t mask_row_stride,
                        int64_t num_queries, int64_t window, int64_t dim, float scale, int64_t begin, int64_t end,
                        float* out, int64_t tokens, int64_t token_stride, float* scores) {
  const int64_t stride = (window + kLanes - 1) / kLanes * kLanes;  // a row's scores, padded to whole vectors
  for (int64_t index = begin; index < end;) {
    const int64_t head = index / num_queries, first = index % num_queries;
    const int64_t count = std::min({end - index, num_queries - first, kAttendGroupRows});
    attend_group<C>(q + head * q_head_stride, q_row_stride, k + head * kv_head_stride, v + head * kv_head_stride,
                    kv_row_stride, mask, mask_row_stride, head, first, count, num_queries, window, dim, scale, out,
                    tokens, token_stride, scores, stride);
    index += count;
  }
}

void attend(const float* q, int64_t q_head_stride, int64_t q_row_stride, const float* k, const float* v,
            int64_t kv_head_stride, int64_t kv_row_stride, const bool* mask, int64_t mask_row_stride,
            int64_t num_queries, int64_t window, int64_t dim, float scale, int64_t begin, int64_t end, float* out,
            int64_t tokens, int64_t token_stride, float* scores) {
  auto rows = attend_rows<0>;
#if BLOCKS_X86
  if (dim == 4 * kLanes) rows = attend_rows<4>;  // the common heads (64 wide at AVX-512, 32 at AVX2)
  if (dim == 8 * kLanes) rows = attend_rows<8>;
#endif
  rows(q, q_head_stride, q_row_stride, k, v, kv_head_stride, kv_row_stride, mask, mask_row_stride, num_queries, window,
       dim, scale, begin, end, out, tokens, token_stride, scores);
}

}  // namespace BLOCKS_NS
}  // namespace specserve_blocks
