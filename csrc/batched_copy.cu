// CUDA implementation of launch_batched_copy (see batched_copy.h).
//
// One launch copies up to kMaxSegmentsPerLaunch segments. The grid is 1-D: each
// block owns one kChunkBytes chunk of one segment and finds its segment by a
// binary search over the segments' first block indices. Where source and
// destination share their alignment modulo 16 (always the case for the
// 16-byte-aligned offsets ds_pipe_ckpt lays out), the body of the chunk is
// moved with 16-byte vector loads and stores; the unaligned head and tail,
// and chunks whose pointers disagree modulo 16, go byte by byte.

#include <cuda_runtime.h>

#include <cstdint>

#include "batched_copy.h"

namespace ds_pipe_ckpt {
namespace {

constexpr int kThreads = 256;
constexpr int kVectorsPerThread = 4;
constexpr std::int64_t kVectorBytes = 16;
constexpr std::int64_t kChunkBytes = kThreads * kVectorsPerThread * kVectorBytes;  // 16 KiB

struct LaunchBatch {
  CopySegment segments[kMaxSegmentsPerLaunch];
  // first_block[s] is the first block of segment s; first_block[count] is the grid size.
  std::int64_t first_block[kMaxSegmentsPerLaunch + 1];
  int count;
};

__device__ __forceinline__ int segment_of_block(const LaunchBatch& batch, std::int64_t block) {
  int lo = 0;
  int hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads) batched_copy_kernel(const LaunchBatch batch) {
  const std::int64_t block = blockIdx.x;
  const int s = segment_of_block(batch, block);
  const CopySegment seg = batch.segments[s];
  const std::int64_t begin = (block - batch.first_block[s]) * kChunkBytes;
  const std::int64_t n = (seg.nbytes - begin < kChunkBytes) ? seg.nbytes - begin : kChunkBytes;
  std::uint8_t* dst = seg.dst + begin;
  const std::uint8_t* src = seg.src == nullptr ? nullptr : seg.src + begin;

  const auto dst_misalignment = reinterpret_cast<std::uintptr_t>(dst) % kVectorBytes;
  const bool vectorise =
      src == nullptr || reinterpret_cast<std::uintptr_t>(src) % kVectorBytes == dst_misalignment;
  if (!vectorise) {
    for (std::int64_t i = threadIdx.x; i < n; i += kThreads) {
      dst[i] = src[i];
    }
    return;
  }
  const std::int64_t head_bytes = (kVectorBytes - static_cast<std::int64_t>(dst_misalignment)) % kVectorBytes;
  const std::int64_t head = head_bytes < n ? head_bytes : n;
  const std::int64_t vectors = (n - head) / kVectorBytes;
  const std::int64_t tail = head + vectors * kVectorBytes;

  for (std::int64_t i = threadIdx.x; i < head; i += kThreads) {
    dst[i] = src == nullptr ? 0 : src[i];
  }
  uint4* dst_vectors = reinterpret_cast<uint4*>(dst + head);
  if (src == nullptr) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (std::int64_t i = threadIdx.x; i < vectors; i += kThreads) {
      dst_vectors[i] = zero;
    }
  } else {
    const uint4* src_vectors = reinterpret_cast<const uint4*>(src + head);
    for (std::int64_t i = threadIdx.x; i < vectors; i += kThreads) {
      dst_vectors[i] = src_vectors[i];
    }
  }
  for (std::int64_t i = tail + threadIdx.x; i < n; i += kThreads) {
    dst[i] = src == nullptr ? 0 : src[i];
  }
}

}  // namespace

const char* launch_batched_copy(const CopySegment* segments, std::int64_t count, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  for (std::int64_t start = 0; start < count; start += kMaxSegmentsPerLaunch) {
    LaunchBatch batch;
    batch.count = 0;
    std::int64_t blocks = 0;
    const std::int64_t stop = count - start < kMaxSegmentsPerLaunch ? count : start + kMaxSegmentsPerLaunch;
    for (std::int64_t i = start; i < stop; ++i) {
      if (segments[i].nbytes <= 0) {
        continue;
      }
      batch.segments[batch.count] = segments[i];
      batch.first_block[batch.count] = blocks;
      blocks += (segments[i].nbytes + kChunkBytes - 1) / kChunkBytes;
      ++batch.count;
    }
    batch.first_block[batch.count] = blocks;
    if (blocks == 0) {
      continue;
    }
    if (blocks > 0x7fffffffLL) {
      return "ds_pipe_ckpt: batched copy of more than 32 TiB in one launch";
    }
    batched_copy_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, cuda_stream>>>(batch);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) {
      return cudaGetErrorString(error);
    }
  }
  return nullptr;
}

}  // namespace ds_pipe_ckpt
