// Batched byte copy: the one device primitive behind ds_pipe_ckpt's pack and
// unpack ops. Plain C++ on purpose: this header is shared by the torch-facing
// ops.cpp and by batched_copy.cu, which includes no torch header so that nvcc
// compiles it in seconds.
#pragma once

#include <cstdint>

namespace ds_pipe_ckpt {

// Copy `nbytes` bytes from `src` to `dst`, or zero-fill `dst` when `src` is null.
struct CopySegment {
  const std::uint8_t* src;
  std::uint8_t* dst;
  std::int64_t nbytes;
};

// Segments per kernel launch (they travel as kernel arguments, which are
// limited to 4 KiB). Larger lists are split into ceil(count / kMaxSegmentsPerLaunch) launches.
constexpr int kMaxSegmentsPerLaunch = 64;

// Enqueue the copies on `stream` (a cudaStream_t). Segments must not overlap.
// Returns nullptr on success, else the CUDA error string.
const char* launch_batched_copy(const CopySegment* segments, std::int64_t count, void* stream);

}  // namespace ds_pipe_ckpt
