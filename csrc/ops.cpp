// torch ops ds_pipe_ckpt::pack and ds_pipe_ckpt::unpack: multi-tensor pack of a
// checkpointed segment's saved inputs into this rank's shard, and unpack of the
// gathered buffer into the inputs' own tensors.
//
// The byte layout is planned in Python (ds_pipe_ckpt/pack.py, PackLayout):
// tensor i occupies bytes [offsets[i], offsets[i] + nbytes(i)) of a virtual
// buffer (offsets are 16-byte aligned there, but any non-overlapping,
// non-decreasing offsets are accepted here); rank r keeps bytes
// [r * shard, (r + 1) * shard). Bytes no tensor covers (alignment gaps, the
// padding at the end) are written as zeros, so a shard's bytes are fully
// determined by its inputs.
//
// Both ops reduce to a list of byte-copy segments, planned here once and run by
// a memcpy loop on CPU or by one batched-copy kernel launch on CUDA, so the
// planning logic that the CPU implementation exercises (and tests compare with
// the pure-torch fallback) is the logic the CUDA kernel runs.
//
// Light headers only: <torch/extension.h> (pybind11, the whole C++ frontend) is
// not needed for ops registered through TORCH_LIBRARY and loaded with
// torch.ops.load_library.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#ifdef DS_PIPE_CKPT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "batched_copy.h"

namespace ds_pipe_ckpt {
namespace {

std::int64_t nbytes_of(const at::Tensor& t) {
  return t.numel() * static_cast<std::int64_t>(t.element_size());
}

void check_byte_buffer(const at::Tensor& buffer, const char* op, const char* name) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte, "ds_pipe_ckpt::", op, ": ", name,
              " must be a uint8 tensor, got ", buffer.scalar_type());
  TORCH_CHECK(buffer.dim() == 1 && buffer.is_contiguous(), "ds_pipe_ckpt::", op, ": ", name,
              " must be a contiguous 1-D tensor, got sizes ", buffer.sizes(), " and strides ",
              buffer.strides());
}

// Tensors must be contiguous, on the buffer's device, and laid out at
// non-decreasing, non-overlapping byte offsets.
void check_tensors(at::TensorList tensors, c10::IntArrayRef offsets, const at::Tensor& buffer,
                   const char* op, const char* name) {
  TORCH_CHECK(tensors.size() == offsets.size(), "ds_pipe_ckpt::", op, ": got ", tensors.size(),
              " ", name, " but ", offsets.size(), " offsets");
  std::int64_t previous_end = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.is_contiguous(), "ds_pipe_ckpt::", op, ": ", name, "[", i,
                "] must be contiguous (pass its storage-order view), got strides ", t.strides());
    TORCH_CHECK(t.device() == buffer.device(), "ds_pipe_ckpt::", op, ": ", name, "[", i, "] is on ",
                t.device(), " but the buffer is on ", buffer.device());
    TORCH_CHECK(offsets[i] >= previous_end, "ds_pipe_ckpt::", op, ": offsets must be non-decreasing and ",
                name, " must not overlap: ", name, "[", i, "] starts at byte ", offsets[i],
                " but the previous one ends at byte ", previous_end);
    previous_end = offsets[i] + nbytes_of(t);
  }
}

std::vector<CopySegment> plan_pack(at::TensorList tensors, c10::IntArrayRef offsets, std::int64_t begin,
                                   const at::Tensor& out) {
  check_byte_buffer(out, "pack", "out");
  check_tensors(tensors, offsets, out, "pack", "tensors");
  TORCH_CHECK(begin >= 0, "ds_pipe_ckpt::pack: begin must be >= 0, got ", begin);
  const std::int64_t end = begin + out.numel();
  auto* dst = static_cast<std::uint8_t*>(out.data_ptr());
  std::vector<CopySegment> segments;
  segments.reserve(2 * tensors.size() + 1);
  std::int64_t cursor = begin;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::int64_t first = offsets[i];
    const std::int64_t lo = std::max(first, begin);
    const std::int64_t hi = std::min(first + nbytes_of(tensors[i]), end);
    if (lo >= hi) {
      continue;
    }
    if (lo > cursor) {
      segments.push_back({nullptr, dst + (cursor - begin), lo - cursor});
    }
    const auto* src = static_cast<const std::uint8_t*>(tensors[i].const_data_ptr());
    segments.push_back({src + (lo - first), dst + (lo - begin), hi - lo});
    cursor = hi;
  }
  if (cursor < end) {
    segments.push_back({nullptr, dst + (cursor - begin), end - cursor});
  }
  return segments;
}

std::vector<CopySegment> plan_unpack(const at::Tensor& buffer, c10::IntArrayRef offsets, at::TensorList outs) {
  check_byte_buffer(buffer, "unpack", "buffer");
  check_tensors(outs, offsets, buffer, "unpack", "outs");
  const auto* src = static_cast<const std::uint8_t*>(buffer.const_data_ptr());
  std::vector<CopySegment> segments;
  segments.reserve(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    const std::int64_t nbytes = nbytes_of(outs[i]);
    TORCH_CHECK(offsets[i] + nbytes <= buffer.numel(), "ds_pipe_ckpt::unpack: outs[", i, "] needs bytes [",
                offsets[i], ", ", offsets[i] + nbytes, ") but the buffer has ", buffer.numel());
    segments.push_back({src + offsets[i], static_cast<std::uint8_t*>(outs[i].data_ptr()), nbytes});
  }
  return segments;
}

void run_on_cpu(const std::vector<CopySegment>& segments) {
  for (const CopySegment& seg : segments) {
    if (seg.src == nullptr) {
      std::memset(seg.dst, 0, static_cast<size_t>(seg.nbytes));
    } else {
      std::memcpy(seg.dst, seg.src, static_cast<size_t>(seg.nbytes));
    }
  }
}

void pack_cpu(at::TensorList tensors, c10::IntArrayRef offsets, std::int64_t begin, const at::Tensor& out) {
  run_on_cpu(plan_pack(tensors, offsets, begin, out));
}

void unpack_cpu(const at::Tensor& buffer, c10::IntArrayRef offsets, at::TensorList outs) {
  run_on_cpu(plan_unpack(buffer, offsets, outs));
}

#ifdef DS_PIPE_CKPT_WITH_CUDA
void run_on_cuda(const std::vector<CopySegment>& segments, const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  const char* error =
      launch_batched_copy(segments.data(), static_cast<std::int64_t>(segments.size()), stream.stream());
  TORCH_CHECK(error == nullptr, "ds_pipe_ckpt: batched copy kernel launch failed: ", error);
}

void pack_cuda(at::TensorList tensors, c10::IntArrayRef offsets, std::int64_t begin, const at::Tensor& out) {
  run_on_cuda(plan_pack(tensors, offsets, begin, out), out.device());
}

void unpack_cuda(const at::Tensor& buffer, c10::IntArrayRef offsets, at::TensorList outs) {
  run_on_cuda(plan_unpack(buffer, offsets, outs), buffer.device());
}
#endif

}  // namespace
}  // namespace ds_pipe_ckpt

TORCH_LIBRARY(ds_pipe_ckpt, m) {
  m.def("pack(Tensor[] tensors, int[] offsets, int begin, Tensor(a!) out) -> ()");
  m.def("unpack(Tensor buffer, int[] offsets, Tensor(a!)[] outs) -> ()");
}

TORCH_LIBRARY_IMPL(ds_pipe_ckpt, CPU, m) {
  m.impl("pack", &ds_pipe_ckpt::pack_cpu);
  m.impl("unpack", &ds_pipe_ckpt::unpack_cpu);
}

#ifdef DS_PIPE_CKPT_WITH_CUDA
TORCH_LIBRARY_IMPL(ds_pipe_ckpt, CUDA, m) {
  m.impl("pack", &ds_pipe_ckpt::pack_cuda);
  m.impl("unpack", &ds_pipe_ckpt::unpack_cuda);
}
#endif
