// scaled_softmax_forward: y = softmax(scale * x, masked) over the last dimension, fp32 math.
// Masking: none; causal (element j of row i of each [sq, sk] matrix is excluded when j > i, and
// those elements are neither read nor exponentiated, only written as 0); or a padding mask of
// shape [b or 1, 1, sq, sk] (nonzero = masked: score -10000, upstream's; a row with every
// element masked gives 0). Kernel shapes: softmax_common.cuh.

#include <cmath>
#include <type_traits>

#include "softmax_common.cuh"
#include "cuda_ops.h"

namespace apex_transformer::softmax {
namespace {

// Resident blocks of kMaxGroup threads a multiprocessor the in-registers kernel is built for:
// 3, i.e. 1536 threads and at most 40 registers a thread (ptxas fits every variant without
// spilling); also 12 blocks of 128 threads.
constexpr int kForwardMinBlocks = 3;
// Padding masks: rows of at least this many bytes are taken heads fastest (locate_row).
constexpr int64_t kHeadsFastestRowBytes = 1024;

template <typename T>
struct ForwardParams {
  const T* input;
  const uint8_t* mask;  // padding masking only
  T* output;
  int64_t rows;
  int64_t sk;
  int64_t sq;     // rows of one [sq, sk] matrix: a row's query index is row % sq
  int64_t share;       // padding: the [sq, sk] matrices one mask matrix serves (np, or b * np for a
                       // mask of batch 1)
  bool heads_fastest;  // padding: take the rows heads fastest (locate_row), else in input order
  float scale;         // scale * log2(e): scores are kept in base-2 units, for exp2 (never 0 with a mask)
  uint32_t sentinel;   // padding: what a masked element's bits become, the value whose score is -inf
                       // (-inf for a positive scale, +inf for a negative one), twice for 16-bit types
  int group;           // threads per row
  int rows_per_block;  // in registers: block / group
  int64_t row_groups;  // in registers: ceil(rows / rows_per_block), the blocks' work items
};

// V elements of T as loaded, as 32-bit words when they fill whole words (the 16-byte vectors):
// the compiler then keeps them as 4 registers, never as separate 16-bit halves.
template <typename T, int V>
struct alignas(sizeof(T) * V) RawVector {
  static constexpr bool kWords = (sizeof(T) * V) % 4 == 0;
  using Unit = std::conditional_t<kWords, uint32_t, T>;
  static constexpr int kUnits = kWords ? static_cast<int>(sizeof(T) * V / 4) : V;
  Unit u[kUnits];

  __device__ __forceinline__ void to_floats(float (&dst)[V]) const {
    if constexpr (!kWords) {
#pragma unroll
      for (int j = 0; j < V; ++j) dst[j] = static_cast<float>(u[j]);
    } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
      for (int j = 0; j < V; ++j) dst[j] = __uint_as_float(u[j]);
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#pragma unroll
      for (int i = 0; i < kUnits; ++i) {
        dst[2 * i] = __uint_as_float(u[i] << 16);
        dst[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      }
    } else {
      static_assert(std::is_same_v<T, c10::Half>, "float, bfloat16 or float16");
#pragma unroll
      for (int i = 0; i < kUnits; ++i) {
        dst[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(u[i] & 0xffffu)));
        dst[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(u[i] >> 16)));
      }
    }
  }
};

// V mask bytes (aligned to V), read as 32-bit words when V >= 4.
template <int V>
struct alignas(V) MaskWords {
  std::conditional_t<(V >= 4), uint32_t, uint8_t> val[V >= 4 ? V / 4 : V];
};

// 0xff in each nonzero byte of w, 0 in the others (no carry crosses a byte: the flags 0x80 are
// moved to bit 0 of their byte and multiplied by 0xff).
__device__ __forceinline__ uint32_t nonzero_bytes(uint32_t w) {
  return (((((w & 0x7f7f7f7fu) + 0x7f7f7f7fu) | w) & 0x80808080u) >> 7) * 0xffu;
}

// Element j of a vector masked by its mask byte: its bits replaced by the sentinel (whose score is
// -inf, so that it takes no part in the max, the sum or the output without a test an element);
// returns how many elements were masked. 16-bit pairs take a PRMT (each half its flag byte twice)
// and a LOP3 a word; float32 words a PRMT and a LOP3 each. (__byte_perm has no sign-replicating
// selectors: bit 3 of each selector nibble is dropped, hence flag bytes of 0xff.)
template <typename T, int V>
__device__ __forceinline__ int mask_out(RawVector<T, V>& raw, const MaskWords<V>& mask, uint32_t sentinel) {
  using R = RawVector<T, V>;
  if constexpr (V == 1) {
    const bool m = mask.val[0] != 0;
    if constexpr (R::kWords) {
      if (m) raw.u[0] = sentinel;
    } else {
      if (m) raw.u[0] = T(static_cast<uint16_t>(sentinel), T::from_bits());
    }
    return m ? 1 : 0;
  } else if constexpr (sizeof(T) == 2) {
    static_assert(V == 8, "16-byte vectors of 16-bit elements");
    int count = 0;
#pragma unroll
    for (int w = 0; w < 2; ++w) {  // mask word w: elements 4w .. 4w + 3, raw words 2w, 2w + 1
      const uint32_t nz = nonzero_bytes(mask.val[w]);
      const uint32_t lo = __byte_perm(nz, 0u, 0x1100), hi = __byte_perm(nz, 0u, 0x3322);
      raw.u[2 * w] = (raw.u[2 * w] & ~lo) | (sentinel & lo);
      raw.u[2 * w + 1] = (raw.u[2 * w + 1] & ~hi) | (sentinel & hi);
      count += __popc(nz) >> 3;
    }
    return count;
  } else {
    static_assert(sizeof(T) == 4 && V == 4, "16-byte vectors of float32");
    const uint32_t nz = nonzero_bytes(mask.val[0]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t lane = __byte_perm(nz, 0u, 0x1111 * j);
      raw.u[j] = (raw.u[j] & ~lane) | (sentinel & lane);
    }
    return __popc(nz) >> 3;
  }
}

// The input row of work item `item` (0 .. rows - 1) and, with padding, its mask row. Without a
// mask the rows go in input order. With one (and rows of at least kHeadsFastestRowBytes), the items walk the p.share matrices that one mask
// matrix serves fastest: item -> (mask matrix, query q, head h), so a mask row is read from memory
// once and served from cache to the other heads while they run. In input order (a head's sq rows,
// then the next head's) a mask matrix larger than the cache is read again for every head: one
// more byte an element, 25% more traffic than the 4 bytes of x and y (bf16), which held the
// forward at 76-79% of the copy rate from sk = 2048 on.
struct RowPlace {
  int64_t row;       // of the input and output
  int64_t mask_row;  // of the mask (padding)
};
template <Masking kMasking, typename T>
__device__ __forceinline__ RowPlace locate_row(const ForwardParams<T>& p, int64_t item) {
  if constexpr (kMasking != Masking::kPadding) {
    return {item, 0};
  } else {
    if (!p.heads_fastest) {  // item = (matrix * share + head) * sq + q
      return {item, item / (p.share * p.sq) * p.sq + item % p.sq};
    }
    // item = (matrix * sq + q) * share + head, in 32 bits (the host sets heads_fastest only when
    // the rows fit): three divisions by runtime values a row, in the 40 registers of the kernel.
    const auto i = static_cast<uint32_t>(item);
    const auto share = static_cast<uint32_t>(p.share), sq = static_cast<uint32_t>(p.sq);
    const uint32_t mask_row = i / share;  // matrix * sq + q
    const uint32_t head = i - mask_row * share;
    const uint32_t matrix = mask_row / sq;
    const uint32_t q = mask_row - matrix * sq;
    return {(static_cast<int64_t>(matrix) * share + head) * p.sq + q, mask_row};
  }
}

// The readable length of a row: causal rows end at the diagonal.
template <Masking kMasking, typename T>
__device__ __forceinline__ int64_t row_length(const ForwardParams<T>& p, int64_t row) {
  if constexpr (kMasking == Masking::kCausal) {
    return row % p.sq + 1;
  } else {
    return p.sk;
  }
}

// Scores (base 2) of the V elements at column col from their loaded values and mask bytes;
// `unmasked` is set when a padding-masked element is not masked.
template <Masking kMasking, int V, typename T>
__device__ __forceinline__ void scores(float (&s)[V], const AlignedVector<T, V>& x,
                                       const AlignedVector<uint8_t, V>& mask, int64_t col, int64_t len, float scale,
                                       bool& unmasked) {
  apex::to_floats(s, x);
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] *= scale;
  if constexpr (kMasking == Masking::kCausal) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (col + j >= len) s[j] = -INFINITY;
    }
  } else if constexpr (kMasking == Masking::kPadding) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (mask.val[j] != 0) {
        s[j] = kMaskedScore * kLog2e;
      } else {
        unmasked = true;
      }
    }
  }
}

// One row per group of p.group threads, held in registers: kVecs vectors of V elements a thread,
// kept as loaded (16 registers for 32 bf16 elements). A padding mask is applied once, to the
// loaded bits: masked elements become the sentinel (score -inf: no part in the max, the sum or the
// output), and each thread adds its count of masked elements' terms, exp2(kMasked - m), to its sum
// and kMasked to its max; a masked element's output, exp2(kMasked - M) / S, is 0 in float32 unless
// every unmasked score of the row is within ~126 (base 2) of -10000 * log2(e), which the store
// checks once a row (then it reads the mask again, from cache, to write it). Upstream's semantics exactly, without
// a test an element in the three passes (the per-element tests made the padding kernel twice the
// none kernel's instructions and held it at 78-80% of the copy rate).
// One reduction: each thread's own max m_t and sum s_t = sum exp2(score - m_t), combined by
// group_stats (the online-softmax rule, the padding flag in the same exchange); the scores are
// recomputed from the loaded vectors for the sum and again for the store,
// y = exp2(score - M) / S (two exp2 an element: the SFU has the throughput, registers are what
// limits how many blocks stay resident).
template <typename T, int V, Masking kMasking>
__global__ void __launch_bounds__(kMaxGroup, kForwardMinBlocks)
    forward_in_registers(const ForwardParams<T> p) {
  __shared__ StatsShared shared;
  constexpr bool kPadding = kMasking == Masking::kPadding;
  constexpr bool kCausal = kMasking == Masking::kCausal;
  static_assert(kVecs * V <= 32, "one mask bit an element of a thread");
  constexpr float kMasked = kMaskedScore * kLog2e;  // a masked element's score, base 2
  const int group = p.group;
  const int lane = threadIdx.x & (group - 1);
  const int group_shift = __ffs(group) - 1;  // group: a power of two
  // Columns within a row fit in int here: rows of this kernel hold at most kMaxGroup * kVecs
  // vectors. Vector k of a thread starts at column first + k * stride.
  const int first = lane * V;
  const int stride = group * V;
  const unsigned offset = static_cast<unsigned>(stride);  // pointer steps: unsigned, no sign extension
  const float scale = p.scale;
  int parity = 0;
  for (int64_t g = blockIdx.x; g < p.row_groups; g += gridDim.x, parity ^= 1) {
    const int64_t item = g * p.rows_per_block + (threadIdx.x >> group_shift);
    const bool active = item < p.rows;
    const RowPlace place = locate_row<kMasking>(p, active ? item : 0);
    const int64_t row = place.row;
    // Readable elements from `first` on (causal rows end at the diagonal; none for an
    // inactive row): vector k is read when k * stride < rem.
    const int rem = (active ? static_cast<int>(row_length<kMasking>(p, row)) : 0) - first;
    const T* x = p.input + row * p.sk + first;
    T* y = p.output + row * p.sk + first;
    const uint8_t* mrow = kPadding && active ? p.mask + place.mask_row * p.sk + first : nullptr;

    // Every load in flight before the first use. The mask as 32-bit words (bytes when V < 4),
    // tested in place rather than unpacked.
    // (Zeroed first: a register left unset would stay live from one row to the next.)
    RawVector<T, V> raw[kVecs] = {};
    MaskWords<V> raw_mask[kPadding ? kVecs : 1] = {};
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (k * stride < rem) {
        raw[k] = *reinterpret_cast<const RawVector<T, V>*>(x + k * offset);
        if constexpr (kPadding) raw_mask[k] = *reinterpret_cast<const MaskWords<V>*>(mrow + k * offset);
      }
    }
    // Padding: masked elements to the sentinel, n_masked of this thread's; `unmasked` when one of
    // its elements is not.
    int n_masked = 0;
    bool unmasked = false;
    if constexpr (kPadding) {
      int n_held = 0;
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        if (k * stride < rem) {
          n_held += V;
          n_masked += mask_out(raw[k], raw_mask[k], p.sentinel);
        }
      }
      unmasked = n_masked < n_held;
    }
    // Whether element j of vector k takes part (causal: up to the diagonal; the others of a
    // vector that was read do).
    auto in_row = [&](int k, int j) { return !kCausal || k * stride + j < rem; };

    // This thread's max score.
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (k * stride < rem) {
        float v[V];
        raw[k].to_floats(v);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (in_row(k, j)) m = fmaxf(m, v[j] * scale);
        }
      }
    }
    if (kPadding && n_masked > 0) m = fmaxf(m, kMasked);
    // exp2(score - base) of element j of vector k (v: its value); 0 when it takes no part (and for
    // a masked element: its score is -inf).
    auto exp_shifted = [&](int k, int j, float v, float base) {
      return in_row(k, j) ? exp2f(fmaf(v, scale, -base)) : 0.0f;
    };
    // This thread's sum of exp2(score - m); a -inf m (no element here) shifts by 0: every term is 0.
    float s = 0.0f;
    {
      const float base = m == -INFINITY ? 0.0f : m;
      float part[2] = {0.0f, 0.0f};  // two chains of additions
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        if (k * stride < rem) {
          float v[V];
          raw[k].to_floats(v);
#pragma unroll
          for (int j = 0; j < V; ++j) part[(k * V + j) % 2] += exp_shifted(k, j, v[j], base);
        }
      }
      s = part[0] + part[1];
      if (kPadding && n_masked > 0) s = fmaf(static_cast<float>(n_masked), exp2f(kMasked - base), s);
    }
    group_stats<kPadding>(m, s, unmasked, group, shared, parity);
    if (!active) continue;
    // m, s: the row's max and sum. A padding row with every element masked gives 0.
    const float row_max = m == -INFINITY ? 0.0f : m;
    const float inv = kPadding && !unmasked ? 0.0f : 1.0f / s;
    // A masked element's output: 0 unless the row's unmasked scores all lie near kMasked.
    const float masked_out = kPadding ? exp2f(kMasked - row_max) * inv : 0.0f;
    const int rem_out = static_cast<int>(p.sk) - first;  // columns to write from `first` on
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (k * stride < rem_out) {
        float out[V];
        if (k * stride < rem) {
          float v[V];
          raw[k].to_floats(v);
#pragma unroll
          for (int j = 0; j < V; ++j) out[j] = exp_shifted(k, j, v[j], row_max) * inv;
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) out[j] = 0.0f;
        }
        store_elements<V>(y + k * offset, out);
      }
    }
    if (kPadding && masked_out != 0.0f) {
      // The masked elements' nonzero output over the 0s just written (the same for the whole
      // group; rare, so the mask is read again, from cache, and its row found from y's: no
      // register holds either through the row).
      const int64_t out_row = (y - p.output - first) / p.sk;
      const uint8_t* mr = p.mask + (out_row / (p.share * p.sq) * p.sq + out_row % p.sq) * p.sk + first;
      for (int k = 0; k < kVecs; ++k) {
        for (int j = 0; j < V; ++j) {
          if (k * stride + j < rem && mr[k * offset + j] != 0) y[k * offset + j] = static_cast<T>(masked_out);
        }
      }
    }
  }
}

// One row per block of kMaxGroup threads, for rows longer than the registers hold: the max and
// sum in one online pass, then a second pass over the row writes the output.
template <typename T, int V, Masking kMasking>
__global__ void __launch_bounds__(kStreamBlock) forward_streaming(const ForwardParams<T> p) {
  __shared__ float shared[64];
  constexpr bool kPadding = kMasking == Masking::kPadding;
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  for (int64_t item = blockIdx.x; item < p.rows; item += gridDim.x) {
    const RowPlace place = locate_row<kMasking>(p, item);
    const int64_t row = place.row;
    const uint8_t* m = kPadding ? p.mask + place.mask_row * p.sk : nullptr;
    const int64_t len = row_length<kMasking>(p, row);
    const T* x = p.input + row * p.sk;
    AlignedVector<uint8_t, V> no_mask{};
    float run_max = -INFINITY;
    float run_sum = 0.0f;
    bool unmasked = false;
    for (int64_t col = threadIdx.x * V; col < len; col += step) {
      float s[V];
      const auto raw = *reinterpret_cast<const AlignedVector<T, V>*>(x + col);
      const auto raw_mask = kPadding ? *reinterpret_cast<const AlignedVector<uint8_t, V>*>(m + col) : no_mask;
      scores<kMasking, V>(s, raw, raw_mask, col, len, p.scale, unmasked);
      float vmax = s[0];
#pragma unroll
      for (int j = 1; j < V; ++j) vmax = fmaxf(vmax, s[j]);
      if (vmax > run_max) {
        run_sum *= exp2f(run_max - vmax);
        run_max = vmax;
      }
      if (run_max != -INFINITY) {
#pragma unroll
        for (int j = 0; j < V; ++j) run_sum += exp2f(s[j] - run_max);
      }
    }
    float stats[2] = {run_max, unmasked ? 1.0f : 0.0f};
    group_reduce<2>(stats, blockDim.x, shared, Max{});
    const float row_max = stats[0];
    const float mine = run_max == -INFINITY ? 0.0f : run_sum * exp2f(run_max - row_max);
    const float sum = group_reduce1(mine, blockDim.x, shared, Sum{});
    const float inv = kPadding && stats[1] == 0.0f ? 0.0f : 1.0f / sum;
    T* y = p.output + row * p.sk;
    for (int64_t col = threadIdx.x * V; col < p.sk; col += step) {
      float out[V];
      if (col < len) {
        const auto raw = *reinterpret_cast<const AlignedVector<T, V>*>(x + col);
        const auto raw_mask = kPadding ? *reinterpret_cast<const AlignedVector<uint8_t, V>*>(m + col) : no_mask;
        scores<kMasking, V>(out, raw, raw_mask, col, len, p.scale, unmasked);
#pragma unroll
        for (int j = 0; j < V; ++j) out[j] = exp2f(out[j] - row_max) * inv;
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) out[j] = 0.0f;
      }
      store_elements<V>(y + col, out);
    }
  }
}

template <typename T, int V, Masking kMasking>
void launch_width(const ForwardParams<T>& p, const Plan& plan, cudaStream_t stream) {
  if (plan.streaming) {
    forward_streaming<T, V, kMasking><<<grid_for(p.rows), kStreamBlock, 0, stream>>>(p);
  } else {
    forward_in_registers<T, V, kMasking><<<grid_for(p.row_groups), plan.block, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, Masking kMasking>
void launch_forward(const ForwardParams<T>& p, const Plan& plan) {
  constexpr int kWidth = 16 / sizeof(T);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (plan.vectorized) {
    launch_width<T, kWidth, kMasking>(p, plan, stream);
  } else {
    launch_width<T, 1, kMasking>(p, plan, stream);
  }
}

// The bits whose score (value * scale) is -inf: -inf for a positive scale, +inf for a negative one;
// a 16-bit pattern twice (a 32-bit word holds two elements).
template <typename T>
uint32_t sentinel_bits(bool negative_scale) {
  if constexpr (std::is_same_v<T, float>) {
    return negative_scale ? 0x7f800000u : 0xff800000u;
  } else {
    const uint32_t half = std::is_same_v<T, c10::BFloat16> ? (negative_scale ? 0x7f80u : 0xff80u)
                                                           : (negative_scale ? 0x7c00u : 0xfc00u);
    return half | (half << 16);
  }
}

}  // namespace

at::Tensor scaled_softmax_forward_cuda(const at::Tensor& strided_input, const std::optional<at::Tensor>& mask,
                                       double scale, bool causal) {
  const char* op = "scaled_softmax_forward";
  const at::Tensor* m = apex::optional_tensor(mask);
  check_forward(op, strided_input, m, causal);
  const c10::cuda::CUDAGuard device_guard(strided_input.device());
  // A zero scale with a mask: the scores are x * 0 (0, or NaN for an infinite x), which x * 0
  // with scale 1 gives again; the masked elements' sentinel needs a nonzero scale (it is the
  // value whose score is -inf).
  const bool zero_scale = m != nullptr && scale == 0.0;
  const at::Tensor input = zero_scale ? strided_input.mul(0) : strided_input.contiguous();
  if (zero_scale) scale = 1.0;
  at::Tensor output = at::empty(input.sizes(), input.options());
  if (input.numel() == 0) return output;
  const int64_t sk = input.size(-1);
  const int64_t sq = input.size(-2);
  APEX_DISPATCH_FLOAT_TYPES(input.scalar_type(), op, "input", T, {
    constexpr int kWidth = 16 / sizeof(T);
    ForwardParams<T> p{};
    p.input = static_cast<const T*>(input.const_data_ptr());
    p.mask = m != nullptr ? static_cast<const uint8_t*>(m->const_data_ptr()) : nullptr;
    p.output = static_cast<T*>(output.data_ptr());
    p.rows = input.numel() / sk;
    p.sk = sk;
    p.sq = sq;
    // Padding: heads fastest (locate_row) where rows are long enough that scattering them costs
    // nothing (whole 128-byte lines a row); short rows stay in input order.
    if (m != nullptr) {
      p.share = m->size(0) == 1 ? p.rows / sq : input.size(1);
      p.heads_fastest = p.share > 1 && sk * static_cast<int64_t>(sizeof(T)) >= kHeadsFastestRowBytes &&
                        p.rows <= int64_t{UINT32_MAX};
    }
    p.scale = static_cast<float>(scale) * kLog2e;
    p.sentinel = sentinel_bits<T>(p.scale < 0.0f);
    const bool aligned = apex::aligned16(p.input) && apex::aligned16(p.output) &&
                         (p.mask == nullptr || apex::aligned_to(p.mask, kWidth));
    const Plan pl = plan(sk, kWidth, aligned);
    p.group = pl.group;
    p.rows_per_block = pl.block / pl.group;
    p.row_groups = apex::ceil_div(p.rows, p.rows_per_block);
    if (causal) {
      launch_forward<T, Masking::kCausal>(p, pl);
    } else if (m != nullptr) {
      launch_forward<T, Masking::kPadding>(p, pl);
    } else {
      launch_forward<T, Masking::kNone>(p, pl);
    }
  });
  return output;
}

}  // namespace apex_transformer::softmax

