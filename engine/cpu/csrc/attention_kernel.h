// Attention of a few query rows over a window of the KV cache, in float32: decode and verify.
// Included by blocks_kernel.h, so it is compiled once per instruction set like the products, with
// the same vector type (vf, kLanes float32 lanes). Each (KV head, query row) is one task: scores
// q.k * scale over the window (masked positions skipped), a softmax taken from the row's maximum,
// and the probabilities times the values, summed in float32 in order of position. The exponentials
// are taken kLanes at a time (exp_lanes: within 2 ulp of the exact value, as torch's own vectorised
// exp is within 1).
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

void attend(const float* q, int64_t q_head_stride, int64_t q_row_stride, const float* k, const float* v,
            int64_t kv_head_stride, int64_t kv_row_stride, const bool* mask, int64_t mask_row_stride,
            int64_t num_queries, int64_t window, int64_t dim, float scale, int64_t begin, int64_t end, float* out,
            int64_t tokens, int64_t token_stride, float* scores) {
  const int64_t chunks = dim / kLanes;
  for (int64_t index = begin; index < end; ++index) {
    const int64_t head = index / num_queries, row = index % num_queries;
    const float* query = q + head * q_head_stride + row * q_row_stride;
    const float *keys = k + head * kv_head_stride, *values = v + head * kv_head_stride;
    const bool* allowed = mask != nullptr ? mask + row * mask_row_stride : nullptr;
    vf query_chunks[kMostChunks];
    for (int64_t c = 0; c < chunks; ++c) query_chunks[c] = load<vf>(query + c * kLanes);
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t w = 0; w < window; ++w) {
      if (allowed != nullptr && !allowed[w]) {
        scores[w] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float* key = keys + w * kv_row_stride;
      vf dot = query_chunks[0] * load<vf>(key);
      for (int64_t c = 1; c < chunks; ++c) dot += query_chunks[c] * load<vf>(key + c * kLanes);
      scores[w] = lanes_sum(dot) * scale;
      best = scores[w] > best ? scores[w] : best;
    }
    // row r of KV head h is query head h * G + r / tokens at token r % tokens (G = num_queries / tokens)
    float* dest = out + (row % tokens) * token_stride + (head * (num_queries / tokens) + row / tokens) * dim;
    if (best == -std::numeric_limits<float>::infinity()) {  // a row that sees nothing: zeros
      std::memset(dest, 0, sizeof(float) * dim);
      continue;
    }
    const int64_t padded = (window + kLanes - 1) / kLanes * kLanes;
    for (int64_t w = window; w < padded; ++w) scores[w] = -std::numeric_limits<float>::infinity();
    for (int64_t w = 0; w < padded; w += kLanes) {
      const vf weights = exp_lanes(load<vf>(scores + w) - best);
      std::memcpy(scores + w, &weights, sizeof weights);
    }
    vf sums[kMostChunks] = {};
    float total = 0.0f;
    for (int64_t w = 0; w < window; ++w) {
      const float weight = scores[w];
      if (weight == 0.0f) continue;  // masked, or too small to count
      total += weight;
      const float* value = values + w * kv_row_stride;
      for (int64_t c = 0; c < chunks; ++c) sums[c] += weight * load<vf>(value + c * kLanes);
    }
    const float inverse = 1.0f / total;  // total >= 1: the row's maximum contributes exp(0)
    for (int64_t c = 0; c < chunks; ++c) {
      const vf result = sums[c] * inverse;
      std::memcpy(dest + c * kLanes, &result, sizeof result);
    }
  }
}

}  // namespace BLOCKS_NS
}  // namespace specserve_blocks
