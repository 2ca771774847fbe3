// torch ops over the kernels: specserve::blocks_times (x [N, I] times W [O, I].T into out [N, O]),
// specserve::blocks_decode (W's float32 values into out [O, I]) and specserve::blocks_rows (rows
// ids [T] of W into out [T, I]: an embedding lookup in a table held as blocks). W is held as the
// GGUF holds it: O rows of row_bytes, uint8 (or repacked for int8 activations, 16 rows a group).
// Output rows are split over torch's intra-op threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "blocks.h"
#include "ops.h"

namespace specserve_blocks {
namespace {

// Instruction sets by index: 0 portable, 1 AVX2, 2 AVX-512.
bool has_isa(int64_t isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == 2) return has_isa(1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
#endif
  return isa == 0;
}

int64_t block_elements(int64_t format) { return format == kQ4_K || format == kQ6_K ? 256 : 32; }

void check(const at::Tensor& blocks, int64_t format, int64_t in_features, int64_t isa) {
  TORCH_CHECK(format == kQ4_0 || format == kQ4_1 || format == kQ5_0 || format == kQ5_1 || format == kQ8_0 ||
                  format == kQ4_K || format == kQ6_K || format == kInt8Q4 || format == kInt8Q8,
              "unsupported block format ", format);
  TORCH_CHECK(has_isa(isa), "this CPU lacks instruction set ", isa);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.stride(1) == 1,
              "blocks must be a CPU uint8 [O, row bytes] tensor with contiguous rows");
  TORCH_CHECK(in_features % block_elements(format) == 0, "in_features must be a multiple of the block size");
  TORCH_CHECK(format != kInt8Q4 || blocks.size(1) == in_features * 10, "a kInt8Q4 group is 320 bytes a block");
  TORCH_CHECK(format != kInt8Q8 || blocks.size(1) == in_features * 18, "a kInt8Q8 group is 576 bytes a block");
}

// at least 8 output rows per task, and about as many tasks as threads
int64_t grain(int64_t rows) { return std::max<int64_t>(8, rows / (4 * at::get_num_threads())); }

// the decoding kernel of instruction set ``isa`` (checked against the CPU)
using Decode = void (*)(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
Decode decoder(int64_t isa) { return isa == 2 ? avx512::decode : isa == 1 ? avx2::decode : portable::decode; }

void blocks_decode(const at::Tensor& blocks, int64_t format, int64_t in_features, int64_t isa, at::Tensor& out) {
  check(blocks, format, in_features, isa);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == output_rows(blocks, format) && out.size(1) == in_features,
              "out must be float32 [O, in_features] with contiguous rows");
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* os = out.data_ptr<float>();
  const int64_t row_bytes = blocks.stride(0), o_stride = out.stride(0);
  at::parallel_for(0, blocks.size(0), grain(blocks.size(0)), [&](int64_t begin, int64_t end) {
    if (format >= kInt8Q4) return int8_decode(format, w, in_features, begin, end, os, o_stride);
    decoder(isa)(static_cast<int>(format), w, row_bytes, in_features, begin, end, os, o_stride);
  });
}

void blocks_rows(const at::Tensor& blocks, int64_t format, const at::Tensor& ids, int64_t in_features, int64_t isa,
                 at::Tensor& out) {
  check(blocks, format, in_features, isa);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be a CPU int64 [T] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == ids.size(0) &&
                  out.size(1) == in_features,
              "out must be float32 [T, in_features] with contiguous rows");
  const at::Tensor held = ids.contiguous();
  const int64_t* id = held.data_ptr<int64_t>();
  const int64_t count = held.size(0), total = output_rows(blocks, format);
  for (int64_t t = 0; t < count; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < total, "row ", id[t], " of ", total, " rows");
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* os = out.data_ptr<float>();
  const int64_t row_bytes = blocks.stride(0), o_stride = out.stride(0);
  const Decode run = decoder(isa);
  at::parallel_for(0, count, grain(count), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (format >= kInt8Q4) {  // the group holding the row, and the row's lane in it
        int8_decode_row(format, w + id[t] / kInt8Rows * row_bytes, in_features, id[t] % kInt8Rows, os + t * o_stride);
        continue;
      }
      run(static_cast<int>(format), w + id[t] * row_bytes, row_bytes, in_features, 0, 1, os + t * o_stride, o_stride);
    }
  });
}

}  // namespace

int64_t output_rows(const at::Tensor& blocks, int64_t format) {
  return blocks.size(0) * (format >= kInt8Q4 ? kInt8Rows : 1);
}

void blocks_times(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t in_features, int64_t isa,
                  at::Tensor& out) {
  check(blocks, format, in_features, isa);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) == in_features,
              "x must be float32 [N, in_features] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == output_rows(blocks, format),
              "out must be float32 [N, O] with contiguous rows");
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t row_bytes = blocks.stride(0), num_rows = x.size(0), x_stride = x.stride(0), o_stride = out.stride(0);
  if (format >= kInt8Q4) return int8_times(format, xs, num_rows, x_stride, w, blocks.size(0), in_features, isa, os, o_stride);
  at::parallel_for(0, blocks.size(0), grain(blocks.size(0)), [&](int64_t begin, int64_t end) {
    auto run = isa == 2 ? avx512::times : isa == 1 ? avx2::times : portable::times;
    run(static_cast<int>(format), w, row_bytes, in_features, begin, end, xs, num_rows, x_stride, os, o_stride);
  });
}

int64_t best_isa() { return has_isa(2) ? 2 : has_isa(1) ? 1 : 0; }

}  // namespace specserve_blocks

TORCH_LIBRARY(specserve, m) {
  m.def("blocks_times(Tensor x, Tensor blocks, int format, int in_features, int isa, Tensor(a!) out) -> ()");
  m.def("blocks_decode(Tensor blocks, int format, int in_features, int isa, Tensor(a!) out) -> ()");
  m.def("blocks_rows(Tensor blocks, int format, Tensor ids, int in_features, int isa, Tensor(a!) out) -> ()");
  m.def("blocks_isa() -> int");
  m.def("blocks_has_isa(int isa) -> bool");
  m.def("blocks_has_vnni() -> bool");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
  m.impl("blocks_times", specserve_blocks::blocks_times);
  m.impl("blocks_decode", specserve_blocks::blocks_decode);
  m.impl("blocks_rows", specserve_blocks::blocks_rows);
}

TORCH_LIBRARY_IMPL(specserve, CompositeExplicitAutograd, m) {
  m.impl("blocks_isa", specserve_blocks::best_isa);
  m.impl("blocks_has_isa", specserve_blocks::has_isa);
  m.impl("blocks_has_vnni", specserve_blocks::has_vnni);
}
