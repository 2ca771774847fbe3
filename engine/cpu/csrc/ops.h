// What the op files share: the block product as a function (blocks_ops.cpp), for ops that call it
// from C++ (forward_ops.cpp's decoder layer) rather than through torch's dispatcher.
#pragma once
#include <ATen/core/Tensor.h>

namespace specserve_blocks {

// x [N, I] float32 times the blocks' weight [O, I].T into out [N, O] (rows contiguous), over torch's threads
// the output rows of a weight held as blocks [rows of blocks, row bytes] in format
int64_t output_rows(const at::Tensor& blocks, int64_t format);

void blocks_times(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t in_features, int64_t isa,
                  at::Tensor& out);

}  // namespace specserve_blocks
