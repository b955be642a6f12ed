// Chunked multi-tensor apply: one kernel launch works on many tensors at once.
//
// The caller passes Depth tensor lists of one length (say inputs, outputs); tensor i of every
// list has the same number of elements. Each tensor is cut into chunks of chunk_size elements
// and every chunk becomes one thread block. The addresses, sizes and block -> (tensor, chunk)
// tables of a launch travel by value as a kernel parameter (TensorListMetadata): no host ->
// device copy and no host sync. A launch is issued whenever its tensor or block table is full;
// a tensor whose chunks do not all fit carries over into the next launch.
//
// A functor does the per-chunk work:
//
//   namespace {  // keeps the kernel instantiation private to this library
//   template <typename T>
//   struct Halve {
//     __device__ void operator()(const apex::Chunk<2>& chunk) const {
//       const T* in = chunk.data<T>(0);      // this chunk's first element in list 0
//       T* out = chunk.data<T>(1);
//       for (int64_t i = threadIdx.x; i < chunk.size; i += blockDim.x) out[i] = in[i] * T(0.5f);
//     }
//   };
//   }
//   apex::multi_tensor_apply<2>(chunk_size, {inputs, outputs}, Halve<float>{});
//
// Extra arguments after the functor are passed on to it by value at every launch
// (functor(chunk, args...)). chunk.tensor_index is the tensor's index in the lists, for
// per-tensor outputs; chunk.block_index numbers the chunks of the whole call in order
// (tensors in list order, then chunks in order; empty tensors have none), so a two-pass
// reduction can store one partial per chunk at partials[chunk.block_index] and find tensor i's
// partials at [sum_{j<i} num_chunks(numel_j), ... + num_chunks(numel_i)).
//
// All indexing is 64-bit; empty tensors launch nothing; launches go to the current stream of
// the tensors' device, under a device guard. Functors should live in an anonymous namespace:
// the kernel template is then instantiated with internal linkage, and two apex libraries that
// use the same header can never interpose each other's kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <limits>

namespace apex {

// Kernel parameters may take 32764 bytes since CUDA 12.1 on Volta and newer (4096 before).
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1))
constexpr int kMaxKernelParamBytes = 32764;
#else
constexpr int kMaxKernelParamBytes = 4096;
#endif
// Left to the functor, the extra arguments and chunk_size when sizing the tables.
constexpr int kReservedParamBytes = 256;
constexpr int kMultiTensorBlockSize = 512;

namespace detail {

// Bytes of kernel parameters of these types, laid out in order with natural alignment.
template <typename... Ts>
constexpr size_t param_bytes() {
  size_t offset = 0;
  ((offset = (offset + alignof(Ts) - 1) / alignof(Ts) * alignof(Ts) + sizeof(Ts)), ...);
  return offset;
}

template <int Depth>
struct MetadataCapacity {
  static constexpr int kBytesPerTensor = Depth * 8 /*address*/ + 8 /*size*/ + 4 /*index*/;
  static constexpr int kBytesPerBlock = 4 /*chunk*/ + 2 /*tensor slot*/;
  static constexpr int kBudget = kMaxKernelParamBytes - kReservedParamBytes - 16 /*first_block, padding*/;
  // Half the bytes for tensors, half for blocks: launches of many small tensors are limited by
  // the first, launches of a few large ones by the second.
  static constexpr int kTensors = kBudget / 2 / kBytesPerTensor;
  static constexpr int kBlocks = (kBudget - kTensors * kBytesPerTensor) / kBytesPerBlock;
};

}  // namespace detail

// One launch's work list. kMaxTensors tensors (per list) and kMaxBlocks blocks at most.
template <int Depth>
struct TensorListMetadata {
  static_assert(Depth >= 1 && Depth <= 8, "multi_tensor_apply supports 1 to 8 tensor lists");
  static constexpr int kDepth = Depth;
  static constexpr int kMaxTensors = detail::MetadataCapacity<Depth>::kTensors;
  static constexpr int kMaxBlocks = detail::MetadataCapacity<Depth>::kBlocks;
  static_assert(kMaxTensors <= std::numeric_limits<uint16_t>::max() + 1, "tensor slots must fit uint16");

  void* addresses[Depth][kMaxTensors];
  int64_t sizes[kMaxTensors];
  int64_t first_block;                  // block_index of this launch's block 0
  int32_t tensor_index[kMaxTensors];    // slot -> index of the tensor in the lists
  int32_t block_to_chunk[kMaxBlocks];   // block -> chunk of its tensor
  uint16_t block_to_tensor[kMaxBlocks]; // block -> tensor slot
};

static_assert(sizeof(TensorListMetadata<1>) <= kMaxKernelParamBytes - kReservedParamBytes);
static_assert(sizeof(TensorListMetadata<2>) <= kMaxKernelParamBytes - kReservedParamBytes);
static_assert(sizeof(TensorListMetadata<3>) <= kMaxKernelParamBytes - kReservedParamBytes);
static_assert(sizeof(TensorListMetadata<4>) <= kMaxKernelParamBytes - kReservedParamBytes);
static_assert(sizeof(TensorListMetadata<5>) <= kMaxKernelParamBytes - kReservedParamBytes);
static_assert(sizeof(TensorListMetadata<8>) <= kMaxKernelParamBytes - kReservedParamBytes);

// What one thread block works on: chunk `block_index` of the call, elements
// [start, start + size) of tensor `tensor_index` in every list.
template <int Depth>
struct Chunk {
  void* base[Depth];     // the tensor's first element, per list
  int64_t start;         // the chunk's first element within the tensor
  int64_t size;          // elements in this chunk, 1..chunk_size
  int64_t tensor_size;   // elements in the whole tensor
  int64_t tensor_index;  // index of the tensor in the lists
  int64_t block_index;   // index of the chunk among all chunks of the call

  template <typename T>
  C10_DEVICE C10_ALWAYS_INLINE T* data(int list) const {
    return static_cast<T*>(base[list]) + start;
  }
};

// Number of chunks (blocks) a tensor of `numel` elements takes.
inline int64_t num_chunks(int64_t numel, int64_t chunk_size) {
  return (numel + chunk_size - 1) / chunk_size;
}

template <int Depth, int BlockSize, typename Functor, typename... Args>
__global__ void __launch_bounds__(BlockSize)
    multi_tensor_apply_kernel(const __grid_constant__ TensorListMetadata<Depth> meta, int64_t chunk_size,
                              Functor functor, Args... args) {
  const int block = blockIdx.x;
  const int slot = meta.block_to_tensor[block];
  Chunk<Depth> chunk;
#pragma unroll
  for (int list = 0; list < Depth; ++list) chunk.base[list] = meta.addresses[list][slot];
  chunk.start = static_cast<int64_t>(meta.block_to_chunk[block]) * chunk_size;
  chunk.tensor_size = meta.sizes[slot];
  const int64_t remaining = chunk.tensor_size - chunk.start;
  chunk.size = remaining < chunk_size ? remaining : chunk_size;
  chunk.tensor_index = meta.tensor_index[slot];
  chunk.block_index = meta.first_block + block;
  functor(chunk, args...);
}

// Runs functor over every chunk of the tensors in `lists` (see the top of this file). The
// tensors must be on one CUDA device; the caller checks dtypes, devices and layouts.
template <int Depth, int BlockSize = kMultiTensorBlockSize, typename Functor, typename... Args>
void multi_tensor_apply(int64_t chunk_size, const std::array<at::TensorList, Depth>& lists, const Functor& functor,
                        const Args&... args) {
  using Meta = TensorListMetadata<Depth>;
  static_assert(detail::param_bytes<Meta, int64_t, Functor, Args...>() <= kMaxKernelParamBytes,
                "functor and extra arguments leave the kernel parameters over the limit");
  TORCH_CHECK(chunk_size > 0, "multi_tensor_apply: chunk_size must be positive, got ", chunk_size);
  const size_t n_tensors = lists[0].size();
  for (int list = 1; list < Depth; ++list) {
    TORCH_CHECK(lists[list].size() == n_tensors, "multi_tensor_apply: list ", list, " has ", lists[list].size(),
                " tensors, list 0 has ", n_tensors);
  }
  TORCH_CHECK(n_tensors <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
              "multi_tensor_apply: too many tensors (", n_tensors, ")");
  if (n_tensors == 0) return;

  const c10::cuda::CUDAGuard device_guard(lists[0][0].device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  Meta meta{};
  meta.first_block = 0;
  int tensors = 0;  // slots filled in this launch
  int blocks = 0;   // blocks filled in this launch
  auto launch = [&]() {
    multi_tensor_apply_kernel<Depth, BlockSize><<<blocks, BlockSize, 0, stream>>>(meta, chunk_size, functor, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    meta.first_block += blocks;
    blocks = 0;
  };

  for (size_t t = 0; t < n_tensors; ++t) {
    const int64_t numel = lists[0][t].numel();
    for (int list = 1; list < Depth; ++list) {
      TORCH_CHECK(lists[list][t].numel() == numel, "multi_tensor_apply: tensor ", t, " of list ", list, " has ",
                  lists[list][t].numel(), " elements, list 0's has ", numel);
    }
    if (numel == 0) continue;
    const int64_t chunks = num_chunks(numel, chunk_size);
    TORCH_CHECK(chunks <= std::numeric_limits<int32_t>::max(), "multi_tensor_apply: tensor ", t, " has ", numel,
                " elements, more than 2^31 - 1 chunks of chunk_size ", chunk_size);

    int slot = tensors++;
    for (int list = 0; list < Depth; ++list) meta.addresses[list][slot] = lists[list][t].data_ptr();
    meta.sizes[slot] = numel;
    meta.tensor_index[slot] = static_cast<int32_t>(t);

    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      meta.block_to_tensor[blocks] = static_cast<uint16_t>(slot);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(chunk);
      ++blocks;
      const bool last_chunk = chunk == chunks - 1;
      if (blocks == Meta::kMaxBlocks || (tensors == Meta::kMaxTensors && last_chunk)) {
        launch();
        if (last_chunk) {
          tensors = 0;
        } else {  // the rest of this tensor's chunks go to the next launch, in slot 0
          for (int list = 0; list < Depth; ++list) meta.addresses[list][0] = meta.addresses[list][slot];
          meta.sizes[0] = meta.sizes[slot];
          meta.tensor_index[0] = meta.tensor_index[slot];
          slot = 0;
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) launch();
}

}  // namespace apex
