// The eager forward of a CPU float32 model around its products, one op where torch launches several
// (engine/model/kernels.py, engine/model/attention.py, engine/model/kv.py use them): specserve::rms_norm,
// add_rms_norm, rotate, rotate_into_cache, silu_gate and decode_attention; and specserve::decode_layer,
// a whole decoder layer of a decode or verify step whose products are all GGUF blocks, in one call.
// At a decode step each reads and writes a few KB, so what they save is the launches (a norm is
// about eight, a layer about forty), not arithmetic.
//
// Every op splits its work between threads by whole rows (a token's), never inside one (the gate's
// elements, each alone, by pieces of a row), and computes a row by the same instructions whatever rows
// come with it: a position's values are the same bits in a prompt pass, a decode step or a verify,
// at any thread count. torch's silu splits a tensor by elements, and the tail of each thread's share
// goes through scalar exp instead of the vector one, so where the split falls (the thread count and
// the number of rows decide it) moved the last bit.
//
// rotate rounds as the eager ops do: no contraction into fused multiply-adds (the
// pragma below), so a*b + c*d is two rounded products and a rounded sum, as torch's mul, mul and
// add. The norm's sum of squares is taken in double, so it differs from torch's float32 reduction
// only in rounding.
#pragma GCC optimize("fp-contract=off")
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "blocks.h"
#include "ops.h"

namespace specserve_forward {
namespace {

constexpr int64_t kGrainElements = 1 << 15;  // rows per task: about this many elements (small inputs run inline)

int64_t grain(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width)); }

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// rows of x [R, E] (contiguous) into out, times weight [E]; total, when given, receives x first
void normalise(const float* x, const float* delta, const float* weight, float* total, float* out, int64_t num_rows,
               int64_t width, double eps) {
  at::parallel_for(0, num_rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* in = x + row * width;
      float* sum_out = total != nullptr ? total + row * width : nullptr;
      double squares = 0.0;
      for (int64_t i = 0; i < width; ++i) {
        float value = in[i];
        if (delta != nullptr) {
          value += delta[row * width + i];
          sum_out[i] = value;
        }
        squares += static_cast<double>(value) * value;
      }
      const float scale = static_cast<float>(1.0 / std::sqrt(squares / width + eps));
      const float* source = delta != nullptr ? sum_out : in;
      float* dest = out + row * width;
      for (int64_t i = 0; i < width; ++i) dest[i] = weight[i] * (source[i] * scale);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "x");
  check_float(weight, "weight");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width, "weight must be [E] for x [..., E]");
  const at::Tensor input = x.contiguous(), scale = weight.contiguous();
  at::Tensor out = at::empty_like(input);
  normalise(input.data_ptr<float>(), nullptr, scale.data_ptr<float>(), nullptr, out.data_ptr<float>(),
            input.numel() / std::max<int64_t>(1, width), width, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_float(residual, "residual");
  check_float(delta, "delta");
  check_float(weight, "weight");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "residual and delta must have one shape");
  const int64_t width = residual.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width, "weight must be [E] for x [..., E]");
  const at::Tensor base = residual.contiguous(), added = delta.contiguous(), scale = weight.contiguous();
  at::Tensor total = at::empty_like(base), out = at::empty_like(base);
  normalise(base.data_ptr<float>(), added.data_ptr<float>(), scale.data_ptr<float>(), total.data_ptr<float>(),
            out.data_ptr<float>(), base.numel() / std::max<int64_t>(1, width), width, eps);
  return {total, out};
}

// gate_up [..., 2I] (each row the gate's I values, then up's) -> silu(gate) * up [..., I], as
// gate / (1 + exp(-gate)) * up, element by element by libm's scalar expf, so an element's value does
// not depend on which task computes it: a task is kSiluPiece elements of a row. (A row a task, a
// decode step's one row ran on one thread, 3% of its time on a Zen 3 host, while the other waited;
// a verify's few rows were one task too, by the grain.)
constexpr int64_t kSiluPiece = 256;

at::Tensor silu_gate(const at::Tensor& gate_up) {
  check_float(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1), inner = width / 2;
  TORCH_CHECK(width % 2 == 0, "gate_up's last dimension must be even (the gate's rows, then up's)");
  const at::Tensor input = gate_up.contiguous();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = inner;
  at::Tensor out = at::empty(sizes, input.options());
  const float* in = input.data_ptr<float>();
  float* dest = out.data_ptr<float>();
  const int64_t pieces = (inner + kSiluPiece - 1) / kSiluPiece;  // a row's
  // expf takes a few ns an element: one piece is worth a thread (grain 1), where a norm's row is not
  at::parallel_for(0, input.numel() / std::max<int64_t>(1, width) * pieces, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / pieces, first = task % pieces * kSiluPiece, last = std::min(first + kSiluPiece, inner);
      const float *gate = in + row * width, *up = gate + inner;
      float* d = dest + row * inner;
      for (int64_t i = first; i < last; ++i) d[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// one head's row of D values, halves rotated as Llama's: x * cos + rotate_half(x) * sin
inline void rotate_row(const float* x, const float* cos, const float* sin, float* dest, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) dest[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < dim; ++i) dest[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// x [B, H, T, D] (any strides, D contiguous), cos and sin [T, D] -> x * cos + rotate_half(x) * sin, contiguous
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float(x, "x");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0, "x must be [B, H, T, D] with D contiguous");
  const int64_t batch = x.size(0), heads = x.size(1), length = x.size(2), dim = x.size(3);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == length && cos.size(1) == dim,
              "cos and sin must be [T, D]");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({batch, heads, length, dim}, x.options());
  const float* xs = x.data_ptr<float>();
  const float *cs = c.data_ptr<float>(), *ss = s.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  at::parallel_for(0, batch * heads * length, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t t = index % length, h = (index / length) % heads, b = index / (length * heads);
      rotate_row(xs + b * sb + h * sh + t * st, cs + t * dim, ss + t * dim, os + index * dim, dim);
    }
  });
  return out;
}

// One layer's new tokens into its cache: qkv [1, T, (H + 2 H_kv) D] (the fused product's output:
// q's heads, k's, v's) with cos and sin [T, D] of their positions -> q rotated [1, H, T, D]; k
// rotated and v written to keys and values [1, H_kv, S, D] (views of the cache, D contiguous) at
// positions [start, start + T). The rotation rounds as rotate's; the copies are exact.
at::Tensor rotate_into_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                             at::Tensor& values, int64_t heads, int64_t start) {
  check_float(qkv, "qkv");
  check_float(keys, "keys");
  check_float(values, "values");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.stride(3) == 1 && values.stride(3) == 1,
              "keys and values must be [1, H_kv, S, D] with D contiguous");
  const int64_t kv_heads = keys.size(1), dim = keys.size(3), length = qkv.size(1);
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(0) == 1 && qkv.size(2) == (heads + 2 * kv_heads) * dim && dim % 2 == 0,
              "qkv must be [1, T, (heads + 2 kv_heads) D]");
  TORCH_CHECK(start >= 0 && start + length <= keys.size(2), "positions past the cache");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == length && cos.size(1) == dim,
              "cos and sin must be [T, D]");
  const at::Tensor input = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor q = at::empty({1, heads, length, dim}, qkv.options());
  const float *in = input.data_ptr<float>(), *cs = c.data_ptr<float>(), *ss = s.data_ptr<float>();
  float *qs = q.data_ptr<float>(), *ks = keys.data_ptr<float>(), *vs = values.data_ptr<float>();
  const int64_t width = (heads + 2 * kv_heads) * dim, kh = keys.stride(1), kt = keys.stride(2);
  const int64_t vh = values.stride(1), vt = values.stride(2);
  at::parallel_for(0, length * (heads + 2 * kv_heads), grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t t = index / (heads + 2 * kv_heads), head = index % (heads + 2 * kv_heads);
      const float* x = in + t * width + head * dim;
      float* dest;
      if (head < heads) {
        dest = qs + (head * length + t) * dim;
      } else if (head < heads + kv_heads) {
        dest = ks + (head - heads) * kh + (start + t) * kt;
      } else {
        std::memcpy(vs + (head - heads - kv_heads) * vh + (start + t) * vt, x, sizeof(float) * dim);
        continue;
      }
      rotate_row(x, cs + t * dim, ss + t * dim, dest, dim);
    }
  });
  return q;
}

// query [1, H_kv, Q, D] over keys and values [1, H_kv, W, D] (rows of D contiguous), mask [Q, W]
// (true: attend; none: every position), by instruction set ``isa`` (-1: the widest this CPU runs
// whose vectors divide D), into ``out``: [1, H_kv, Q, D] where ``tokens`` is 1; where Q holds the G
// query heads of each KV head for T = ``tokens`` tokens (decode_layer's grouped rows, G T), [T, H_kv G D]
// with tokens token_stride floats apart, as the o product reads them (no copy between)
void attend_into(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                 const std::optional<at::Tensor>& mask, double scale, int64_t isa, float* o, int64_t tokens,
                 int64_t token_stride) {
  check_float(query, "query");
  check_float(keys, "keys");
  check_float(values, "values");
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 && query.stride(3) == 1, "query must be [1, H_kv, Q, D]");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.strides() == values.strides() &&
                  keys.stride(3) == 1 && keys.size(1) == query.size(1) && keys.size(3) == query.size(3),
              "keys and values must be [1, H_kv, W, D] views of one layout");
  const int64_t heads = query.size(1), num_queries = query.size(2), dim = query.size(3), window = keys.size(2);
  constexpr int64_t kLanes[] = {4, 8, 16};  // float32 lanes of the portable, AVX2 and AVX-512 kernels
  if (isa < 0) {
    isa = specserve_blocks::best_isa();
    while (isa > 0 && dim % kLanes[isa] != 0) --isa;
  }
  TORCH_CHECK(isa <= specserve_blocks::best_isa(), "this CPU lacks instruction set ", isa);
  TORCH_CHECK(dim % kLanes[isa] == 0 && dim <= 256, "the head dimension must be a multiple of ", kLanes[isa],
              ", at most 256");
  const bool* allowed = nullptr;
  at::Tensor mask_rows;
  if (mask.has_value()) {
    mask_rows = mask->contiguous();
    TORCH_CHECK(mask_rows.scalar_type() == at::kBool && mask_rows.dim() == 2 && mask_rows.size(0) == num_queries &&
                    mask_rows.size(1) == window,
                "mask must be bool [Q, W]");
    allowed = mask_rows.data_ptr<bool>();
  }
  TORCH_CHECK(tokens >= 1 && num_queries % tokens == 0, "the query rows must be whole groups of tokens");
  const float *q = query.data_ptr<float>(), *k = keys.data_ptr<float>(), *v = values.data_ptr<float>();
  const int64_t tasks = heads * num_queries;
  auto run = isa == 2 ? specserve_blocks::avx512::attend
             : isa == 1 ? specserve_blocks::avx2::attend
                        : specserve_blocks::portable::attend;
  // a short window is one task (threads cost more than it); a longer one, whose keys and values come
  // from memory (the weights a step reads evict them from the caches), a task per (head, row)
  const int64_t task_grain = window * dim * tasks < kGrainElements ? tasks : 1;
  at::parallel_for(0, tasks, task_grain, [&](int64_t begin, int64_t end) {
    // a group of a KV head's rows at a time (kAttendGroupRows), each row's window padded to whole vectors
    const int64_t padded = (window + kLanes[isa] - 1) / kLanes[isa] * kLanes[isa];
    std::vector<float> scores(std::min(end - begin, specserve_blocks::kAttendGroupRows) * padded);
    run(q, query.stride(1), query.stride(2), k, v, keys.stride(1), keys.stride(2), allowed, window, num_queries,
        window, dim, static_cast<float>(scale), begin, end, o, tokens, token_stride, scores.data());
  });
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const std::optional<at::Tensor>& mask, double scale, int64_t isa) {
  check_float(query, "query");
  TORCH_CHECK(query.dim() == 4, "query must be [1, H_kv, Q, D]");
  at::Tensor out = at::empty({1, query.size(1), query.size(2), query.size(3)}, query.options());
  attend_into(query, keys, values, mask, scale, isa, out.data_ptr<float>(), 1, 0);
  return out;
}

// One decoder layer of a decode or verify step at positions [start, start + T), its four products
// (q/k/v, o, gate/up, down) all GGUF blocks: CausalLM._body's native path for one layer, in one call.
// hidden [1, T, E] and delta (what the last block adds, none before the first layer) -> (the
// residual stream entering the layer, after its attention, and its MLP's output). The same
// kernels in the same order as the ops one by one, so the same values bit for bit.
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& delta, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_blocks, int64_t qkv_format,
    const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_blocks, int64_t o_format,
    const at::Tensor& gate_up_blocks, int64_t gate_up_format, const at::Tensor& down_blocks, int64_t down_format,
    int64_t isa, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys, at::Tensor& values, int64_t heads,
    int64_t start, const std::optional<at::Tensor>& mask, double scale) {
  check_float(hidden, "hidden");
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1, "hidden must be [1, T, E]");
  const int64_t length = hidden.size(1), width = hidden.size(2), kv_heads = keys.size(1), dim = keys.size(3);
  const int64_t inner = specserve_blocks::output_rows(gate_up_blocks, gate_up_format) / 2;
  const int64_t qkv_width = specserve_blocks::output_rows(qkv_blocks, qkv_format);
  at::Tensor entering, x;
  if (delta.has_value()) {
    std::tie(entering, x) = add_rms_norm(hidden, *delta, input_norm, eps);
  } else {
    entering = hidden;
    x = rms_norm(hidden, input_norm, eps);
  }
  at::Tensor qkv = at::empty({1, length, qkv_width}, hidden.options());  // [1, T, (H + 2 H_kv) D]
  at::Tensor qkv_rows = qkv.view({length, qkv_width});
  specserve_blocks::blocks_times(x.view({length, width}), qkv_blocks, qkv_format, width, isa, qkv_rows);
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  const at::Tensor q = rotate_into_cache(qkv, cos, sin, keys, values, heads, start);  // [1, H, T, D]
  const int64_t window = start + length;
  const at::Tensor grouped = q.view({1, kv_heads, heads / kv_heads * length, dim});  // [1, H_kv, G*T, D]
  at::Tensor rows = at::empty({length, heads * dim}, hidden.options());  // [T, H*D], each token's heads in order
  attend_into(grouped, keys.narrow(2, 0, window), values.narrow(2, 0, window), mask, scale, -1, rows.data_ptr<float>(),
              length, heads * dim);
  at::Tensor attention_out = at::empty({1, length, width}, hidden.options());  // [1, T, E]
  at::Tensor attention_rows = attention_out.view({length, width});
  specserve_blocks::blocks_times(rows, o_blocks, o_format, heads * dim, isa, attention_rows);
  auto [after, x_mlp] = add_rms_norm(entering, attention_out, post_norm, eps);
  at::Tensor gate_up = at::empty({1, length, 2 * inner}, hidden.options());  // [1, T, 2I]
  at::Tensor gate_up_rows = gate_up.view({length, 2 * inner});
  specserve_blocks::blocks_times(x_mlp.view({length, width}), gate_up_blocks, gate_up_format, width, isa, gate_up_rows);
  const at::Tensor gated = silu_gate(gate_up);  // [1, T, I]
  at::Tensor mlp_out = at::empty({1, length, width}, hidden.options());
  at::Tensor mlp_rows = mlp_out.view({length, width});
  specserve_blocks::blocks_times(gated.view({length, inner}), down_blocks, down_format, inner, isa, mlp_rows);
  return {entering, after, mlp_out};
}

// Every layer of a decode or verify step in one call: decode_layer for each of L layers in turn, the
// same calls in the same order (the same values); from Python, 30 calls a step and the arguments of
// each cost more than a tenth of a step's time outside its kernels. Layer i: input_norms[i],
// post_norms[i], blocks and formats [4 i, 4 i + 4) (q/k/v, o, gate/up, down), qkv_biases[i], keys[i]
// and values[i]; where feature_slots[i] >= 0, the residual stream entering it is copied to
// features[slot] at positions [start, start + T). -> (the residual stream after the last layer's
// attention, its MLP's output), as decode_layer's last two.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, at::TensorList input_norms, at::TensorList post_norms, double eps, at::TensorList blocks,
    at::IntArrayRef formats, const c10::List<std::optional<at::Tensor>>& qkv_biases, int64_t isa, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList keys, at::TensorList values, int64_t heads, int64_t start,
    const std::optional<at::Tensor>& mask, double scale, const std::optional<at::Tensor>& features,
    at::IntArrayRef feature_slots) {
  const size_t layers = input_norms.size();
  TORCH_CHECK(layers > 0 && post_norms.size() == layers && blocks.size() == 4 * layers &&
                  formats.size() == 4 * layers && qkv_biases.size() == layers && keys.size() == layers &&
                  values.size() == layers && feature_slots.size() == layers,
              "decode_layers needs, per layer, two norms, four products and their formats, a bias, keys and values");
  at::Tensor state = hidden;
  std::optional<at::Tensor> delta;
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor layer_keys = keys[i], layer_values = values[i];
    auto [entering, after, added] = decode_layer(
        state, delta, input_norms[i], post_norms[i], eps, blocks[4 * i], formats[4 * i], qkv_biases.get(i),
        blocks[4 * i + 1], formats[4 * i + 1], blocks[4 * i + 2], formats[4 * i + 2], blocks[4 * i + 3],
        formats[4 * i + 3], isa, cos, sin, layer_keys, layer_values, heads, start, mask, scale);
    if (feature_slots[i] >= 0) {
      TORCH_CHECK(features.has_value(), "a layer's features asked for without a features tensor");
      features->select(0, feature_slots[i]).narrow(0, start, entering.size(1)).copy_(entering[0]);
    }
    state = after;
    delta = added;
  }
  return {state, *delta};
}

}  // namespace
}  // namespace specserve_forward

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotate(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_gate(Tensor gate_up) -> Tensor");
  m.def("rotate_into_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, int heads, "
        "int start) -> Tensor");
  m.def(
      "decode_layer(Tensor hidden, Tensor? delta, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv_blocks, "
      "int qkv_format, Tensor? qkv_bias, Tensor o_blocks, int o_format, Tensor gate_up_blocks, int gate_up_format, "
      "Tensor down_blocks, int down_format, int isa, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, "
      "int heads, int start, Tensor? mask, float scale) -> (Tensor, Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor hidden, Tensor[] input_norms, Tensor[] post_norms, float eps, Tensor[] blocks, "
      "int[] formats, Tensor?[] qkv_biases, int isa, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, "
      "int heads, int start, Tensor? mask, float scale, Tensor(c!)? features, int[] feature_slots) -> (Tensor, Tensor)");
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor? mask, float scale, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
  m.impl("rms_norm", specserve_forward::rms_norm);
  m.impl("add_rms_norm", specserve_forward::add_rms_norm);
  m.impl("rotate", specserve_forward::rotate);
  m.impl("silu_gate", specserve_forward::silu_gate);
  m.impl("rotate_into_cache", specserve_forward::rotate_into_cache);
  m.impl("decode_attention", specserve_forward::decode_attention);
  m.impl("decode_layer", specserve_forward::decode_layer);
  m.impl("decode_layers", specserve_forward::decode_layers);
}
