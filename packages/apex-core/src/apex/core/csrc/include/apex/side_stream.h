// apex::SideStream: part of an op's work on a second stream of the current device, beside what the
// op queues on the current ("main") stream, joined back before the op returns.
//
// What it is for: a backward's weight-gradient GEMMs do not feed the rest of the backward, so they
// can run while the main stream goes on with the input gradient's GEMM and the next layer's
// memory-bound pass; the two streams fill each other's idle multiprocessors (a GEMM's last,
// partial wave; an element-wise pass that cannot use the tensor cores).
//
//   apex::SideStream side;                       // on the current device, after the CUDAGuard
//   at::Tensor dw = at::empty_like(w);           // outputs: allocate on the main stream, before
//   side.run({x, dz, dw}, [&] { ...dw... });     // runs after all the main stream has queued so far
//   ...main-stream work...
//   side.join();                                 // (the destructor joins too)
//
// Rules the callers keep:
// - Allocate what the side work returns on the main stream before run() (the caching allocator
//   ties a block to the stream it was allocated on; an output allocated on the side stream could
//   be handed out again to side-stream work while the main stream still reads it).
// - Name in run()'s list every tensor from the main stream the side work reads or writes: each is
//   recorded on the side stream, so freeing it early (a temporary of the op's loop) does not let the
//   main stream reuse its memory before the side work is done.
// - A cuBLASLt runner (apex::lt::Runner) is bound to one stream's use of its workspace: give the
//   side work its own runner.
// Everything before join() on the side stream is ordered after what the main stream queued before
// run(); everything on the main stream after join() is ordered after all side work.
//
// APEX_SIDE_STREAM=0 in the environment (read when a SideStream is made) runs the side work inline
// on the main stream instead: the same kernels in one stream (benchmarks compare the two).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace apex {
namespace {

// The side stream of a device: one for the library's lifetime (each library that includes this
// header has its own). The caching allocator reuses a freed block only on the stream it was
// allocated on, so a fresh pool stream per call would leave a cached workspace on each of the
// pool's streams. None while it does not exist yet and `main` is being captured into a CUDA graph:
// its first use may create the device's pool of streams, and nothing is created inside a capture
// (the caller runs the side work inline for that call; cudaStreamIsCapturing is safe in a capture).
inline std::optional<c10::cuda::CUDAStream> side_stream_of(const c10::cuda::CUDAStream& main) {
  static std::mutex mutex;
  static std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  const c10::DeviceIndex device = main.device_index();
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(main.stream(), &status));
    if (status != cudaStreamCaptureStatusNone) return std::nullopt;
    it = streams.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device)).first;
  }
  return it->second;
}

inline bool side_stream_enabled() {
  const char* text = std::getenv("APEX_SIDE_STREAM");
  return text == nullptr || std::strcmp(text, "0") != 0;
}

// The largest GEMM (multiply-adds, m * n * k) a caller puts beside another one. Two GEMMs that each
// fill the GPU many times over gain nothing from a second stream and lose to the contention: H100,
// bf16, the ops' forward + backward, one stream against the side stream, alternating in one process
// (2026-12-06): dense layers of 5.5e11 multiply-adds per GEMM (8192x4096x16384) 1.007-1.020x with it,
// of 4.4e12 (16384x8192x32768) 0.991x. 2^40 (1.1e12) lies between.
constexpr double kSideStreamMaxGemmMacs = 1099511627776.0;

// Whether GEMMs of `macs` multiply-adds go on the side stream (callers pass their largest).
inline bool side_stream_pays(double macs) {
  return macs <= kSideStreamMaxGemmMacs;
}

class SideStream {
 public:
  // use=false (a caller's size rule, side_stream_pays) runs the side work inline, as APEX_SIDE_STREAM=0.
  explicit SideStream(bool use = true)
      : main_(c10::cuda::getCurrentCUDAStream()), enabled_(use && side_stream_enabled()) {}
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    try {
      join();
    } catch (...) {  // a CUDA error here shows again at the next call that checks
    }
  }

  // Runs work() with the side stream current (inline on the main stream when disabled).
  template <typename Work>
  void run(std::initializer_list<at::Tensor> uses, Work&& work) {
    if (!enabled_) {
      work();
      return;
    }
    if (!side_) side_ = side_stream_of(main_);
    if (!side_) {  // inside a capture before the side stream exists
      work();
      return;
    }
    at::cuda::CUDAEvent fork;
    fork.record(main_);
    fork.block(*side_);
    {
      const c10::cuda::CUDAStreamGuard guard(*side_);
      work();
    }
    for (const at::Tensor& t : uses) {
      if (t.defined() && t.has_storage() && t.storage().data_ptr().get() != nullptr) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *side_);
      }
    }
    pending_ = true;
  }

  // The main stream waits for all side work queued so far.
  void join() {
    if (!pending_) return;
    at::cuda::CUDAEvent done;
    done.record(*side_);
    done.block(main_);
    pending_ = false;
  }

 private:
  c10::cuda::CUDAStream main_;
  bool enabled_;
  std::optional<c10::cuda::CUDAStream> side_;
  bool pending_ = false;
};

}  // namespace
}  // namespace apex
