// Rotary positional embeddings (rope, rope_cached, rope_thd, rope_2d): the math and the
// argument conventions are in _rope_ops.py; the checks here say the same words as its checks.
//
// One kernel serves the four layouts and both directions. The tensor is seen as "positions"
// (s of [s, b, h, d], the tokens of [t, h, d], the pixels of [b, H, W, h, d]), each holding
// rows (b * h, h, h) of the head dim d. A row splits into items of V channels (V elements make
// 16 bytes when the layout allows it): a rotary item is a pair of vectors, channels c..c+V-1 and
// c+k..c+k+V-1 of a rotated segment of width 2k (the two halves that rotate_half pairs); a
// pass-through item (the channels past the rotated ones, P vectors) is likewise a pair of
// vectors, j and j + P/2 (so every item keeps the same bytes in flight), and one single vector
// when P is odd. 2-D RoPE has two rotated segments (d/2 channels each, the row's and the
// column's angles), the others one.
//
// A thread owns one item of one position and a chunk of that position's rows: it computes its
// 2V angles' cos and sin once (from freqs with a reduced-range sincos, or read from the cached
// tables) and applies them to every row of its chunk, a few rows' loads in flight at a time.
// Memory traffic is then the input read once and the output written once (4 bytes per 16-bit
// element) plus the angle table; sin/cos cost 2V evaluations per chunk of rows (plan() sizes the
// chunks to fill the device twice over, in whole steps of the rows in flight, and at least 16
// rows where that still fills it: 16 rows a chunk for [4096, 8, 32, d] and for thd with h = 32).
// Offsets are 64-bit; the input may have any strides (16-byte accesses where every row start
// and the head-dim stride allow, narrower ones otherwise).

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace apex_transformer {
namespace {

constexpr int kThreads = 128;
// Rows whose loads a thread has in flight at once: 64 bytes a thread either way for a pair of
// vectors (more spills the 16-byte variants out of the register budget below).
constexpr int rows_in_flight(size_t vector_bytes) { return vector_bytes >= 16 ? 2 : 4; }
template <typename T, int V>
constexpr int kRowUnroll = rows_in_flight(sizeof(T) * V);
// Rows of a chunk, at least: the angles' cost (and for thd the search of cu_seqlens) spread over
// them; kFullChunkRows when chunks of that many rows still fill the device.
constexpr int kMinChunkRows = 4;
constexpr int kFullChunkRows = 16;
// At most 96 registers a thread (the 16-byte variants use 93-95, unspilled): five blocks (640
// threads) resident per multiprocessor, 40 KiB of loads in flight.
constexpr int kMinBlocks = 5;

enum class Positions : int { kSequence, kPacked, kImage };

// Where position `index`'s rows are: index -> (i0, i1, i2) with i2 = index % n2,
// i1 = index / n2 % n1, i0 = index / (n1 * n2); row -> (rb, rh) with rh = row % rows_h.
struct Geometry {
  int64_t positions;  // number of position indices
  int64_t n1, n2;
  int64_t in_index_stride[3], out_index_stride[3];
  int64_t rows_b, rows_h;
  int64_t in_row_stride[2], out_row_stride[2];
  int64_t in_stride_d;
  int64_t rows_per_chunk, chunks;
};

// The rotated segments of a row and where their angles come from.
struct Angles {
  int width[2];  // rotated channels per segment (even; 0 for an absent segment)
  int items[2];  // rotary items per segment (width / 2V)
  int pass_items;  // pass-through items: pass_pairs pairs, then one single vector if P is odd
  int pass_pairs;  // P / 2 (P = pass-through vectors): item j pairs vectors j and j + pass_pairs
  Positions positions;
  bool backward;
  bool cached;        // cos/sin tables, else freqs
  bool table_float;   // the cached tables are float32 (else the input's type)
  const float* freqs;
  const void* cos[2];
  const void* sin[2];
  int64_t table_positions;  // freqs' max_s (packed sequences)
  const int* cu_seqlens;
  int64_t sequences;
};

// sin and cos of x in float32 to a few ulp for |x| up to ~1e5 whatever --use_fast_math does to
// sincosf: x reduced by pi/2 in three fused steps (Cody-Waite), then the hardware's sin and cos
// on |r| <= pi/4, where they are accurate to ~2^-21 absolute.
__device__ __forceinline__ void reduced_sincos(float x, float& s, float& c) {
  const float k = rintf(x * 0.636619772367581f);
  float r = fmaf(k, -1.5707962512969971e+00f, x);
  r = fmaf(k, -7.5497894158615964e-08f, r);
  r = fmaf(k, -5.3903029534742384e-15f, r);
  const float sr = __sinf(r), cr = __cosf(r);
  switch (static_cast<int>(k) & 3) {
    case 0: s = sr; c = cr; break;
    case 1: s = cr; c = -sr; break;
    case 2: s = -sr; c = -cr; break;
    default: s = -cr; c = sr; break;
  }
}

template <typename T>
__device__ __forceinline__ float table_value(const void* table, bool is_float, int64_t i) {
  return is_float ? static_cast<const float*>(table)[i] : static_cast<float>(static_cast<const T*>(table)[i]);
}

// The position of packed token `token` and whether it lies in a sequence: the last i with
// cu_seqlens[i] <= token < cu_seqlens[i + 1] (binary search; cu_seqlens non-decreasing).
__device__ __forceinline__ bool packed_position(const int* cu, int64_t sequences, int64_t token, int64_t& position) {
  if (token < cu[0] || token >= cu[sequences]) return false;
  int64_t lo = 0, hi = sequences;  // cu[lo] <= token < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= token) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  position = token - cu[lo];
  return true;
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    rope_kernel(const T* __restrict__ in, T* __restrict__ out, Geometry g, Angles a) {
  using Vec = apex::AlignedVector<T, V>;
  constexpr int U = kRowUnroll<T, V>;
  const int n_items = a.items[0] + a.items[1] + a.pass_items;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int item = static_cast<int>(thread % n_items);
  const int64_t rest = thread / n_items;
  const int64_t chunk = rest % g.chunks;
  const int64_t index = rest / g.chunks;
  if (index >= g.positions) return;

  const int64_t i2 = index % g.n2;
  const int64_t i1 = index / g.n2 % g.n1;
  const int64_t i0 = index / g.n2 / g.n1;
  const int64_t in_base = i0 * g.in_index_stride[0] + i1 * g.in_index_stride[1] + i2 * g.in_index_stride[2];
  const int64_t out_base = i0 * g.out_index_stride[0] + i1 * g.out_index_stride[1] + i2 * g.out_index_stride[2];

  // The item's channels: top, and bottom = top + half for a pair (rotary, or pass-through).
  int segment = -1, top, half = 0, table_channel = 0;
  bool pair = true;
  if (item < a.items[0]) {
    segment = 0;
    top = item * V;
    half = a.width[0] / 2;
    table_channel = top;
  } else if (item < a.items[0] + a.items[1]) {
    segment = 1;
    table_channel = (item - a.items[0]) * V;
    top = a.width[0] + table_channel;
    half = a.width[1] / 2;
  } else {
    const int pass_item = item - a.items[0] - a.items[1];
    // pairs j, j + pass_pairs; the single vector (odd P): vector 2 * pass_pairs = pass_item + pass_pairs
    top = a.width[0] + a.width[1] + (pass_item < a.pass_pairs ? pass_item : pass_item + a.pass_pairs) * V;
    half = a.pass_pairs * V;
    pair = pass_item < a.pass_pairs;
  }

  // out_top = x_top * c_top - x_bot * s_top; out_bot = x_bot * c_bot + x_top * s_bot.
  float c_top[V], s_top[V], c_bot[V], s_bot[V];
  auto angles = [&] {
    bool identity = false, undefined = false;
    int64_t position = a.positions == Positions::kImage && segment == 0 ? i1 : i2;
    if (a.positions == Positions::kPacked) {
      identity = !packed_position(a.cu_seqlens, a.sequences, i2, position);
      undefined = !identity && position >= a.table_positions;
    }
    const int64_t row = position * (segment == 0 ? a.width[0] : a.width[1]);
    const void* cos_table = segment == 0 ? a.cos[0] : a.cos[1];
    const void* sin_table = segment == 0 ? a.sin[0] : a.sin[1];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float st, ct, sb, cb;
      if (identity) {
        st = sb = 0.f;
        ct = cb = 1.f;
      } else if (undefined) {
        st = sb = ct = cb = __int_as_float(0x7fc00000);
      } else if (a.cached) {
        const int64_t t = row + table_channel + j;
        ct = table_value<T>(cos_table, a.table_float, t);
        st = table_value<T>(sin_table, a.table_float, t);
        cb = table_value<T>(cos_table, a.table_float, t + half);
        sb = table_value<T>(sin_table, a.table_float, t + half);
      } else {
        const int64_t t = row + table_channel + j;
        reduced_sincos(a.freqs[t], st, ct);
        reduced_sincos(a.freqs[t + half], sb, cb);
      }
      // The backward applies the transpose: g_top c_top + g_bot s_bot, g_bot c_bot - g_top s_top.
      c_top[j] = ct;
      c_bot[j] = cb;
      s_top[j] = a.backward ? -sb : st;
      s_bot[j] = a.backward ? -st : sb;
    }
  };

  const int64_t rows = g.rows_b * g.rows_h;
  const int64_t first = chunk * g.rows_per_chunk;  // < rows: chunks = ceil(rows / rows_per_chunk)
  const int64_t last = min(first + g.rows_per_chunk, rows);
  const int64_t in_top = top * g.in_stride_d, in_bot = (top + half) * g.in_stride_d;
  // The chunk's rows, U at a time, every load of a step issued before its first use (those of
  // the first step before the angles, whose loads and search they overlap). Rotary and
  // pass-through items share one loop and its loads, and differ only in what they store (the
  // rotation, or the vectors as loaded): a warp holds items of both kinds where a row has
  // pass-through channels (d2 < d), and two loops, one a kind, ran one after the other there, each
  // with half the warp's loads in flight (d2 = 64 of 128: 72% of the copy rate, d2 = d 87%).
  const bool rotary = segment >= 0;
  const bool second = rotary || pair;  // the item has a bottom vector
  int64_t rb = first / g.rows_h, rh = first % g.rows_h;
  int64_t out_off[U];
  Vec x_top[U], x_bot[U];
  auto load_step = [&](int64_t r) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t in_off = in_base + rb * g.in_row_stride[0] + rh * g.in_row_stride[1];
      out_off[u] = out_base + rb * g.out_row_stride[0] + rh * g.out_row_stride[1] + top;
      if (++rh == g.rows_h) {
        rh = 0;
        ++rb;
      }
      if (r + u < last) {
        if constexpr (V == 1) {
          x_top[u].val[0] = in[in_off + in_top];
          if (second) x_bot[u].val[0] = in[in_off + in_bot];
        } else {
          x_top[u] = apex::load_vector<T, V>(in + in_off + in_top);
          if (second) x_bot[u] = apex::load_vector<T, V>(in + in_off + in_bot);
        }
      }
    }
  };
  load_step(first);
  if (rotary) angles();
#pragma unroll 1
  for (int64_t r = first;;) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r + u >= last) continue;
      T* dst = out + out_off[u];
      if (rotary) {
        float ft[V], fb[V], ot[V], ob[V];
        apex::to_floats(ft, x_top[u]);
        apex::to_floats(fb, x_bot[u]);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          ot[j] = ft[j] * c_top[j] - fb[j] * s_top[j];
          ob[j] = fb[j] * c_bot[j] + ft[j] * s_bot[j];
        }
        apex::store_floats(dst, ot);
        apex::store_floats(dst + half, ob);
      } else if constexpr (sizeof(Vec) % 16 == 0) {  // pass-through: the vectors as they are
        apex::store_vector_plain(dst, x_top[u]);      // one 16-byte store (a struct copy may split)
        if (pair) apex::store_vector_plain(dst + half, x_bot[u]);
      } else {
        *reinterpret_cast<Vec*>(dst) = x_top[u];
        if (pair) *reinterpret_cast<Vec*>(dst + half) = x_bot[u];
      }
    }
    r += U;
    if (r >= last) break;
    load_step(r);
  }
}

// ---------------------------------------------------------------------------------------------
// host side

struct Problem {
  Geometry g;
  Angles a;
  int d;
};

// The widest V (elements per access, at most 16 bytes) that every row start, the head-dim
// layout and the segment widths allow, and the row chunks: enough threads for two full waves of
// the device (2048 threads a multiprocessor), at least kMinChunkRows rows per chunk, at least
// kFullChunkRows where chunks of that size still give one full wave, and a multiple of the rows
// in flight (no half-empty steps but in the last chunk).
template <typename T>
int plan(Problem& p, const at::Tensor& input, const at::Tensor& output, int64_t index_sizes[3]) {
  Geometry& g = p.g;
  auto fits = [&](int v) {
    if (v == 1) return true;
    if (g.in_stride_d != 1) return false;
    for (int s = 0; s < 2; ++s) {
      if ((p.a.width[s] / 2) % v != 0) return false;
    }
    if ((p.d - p.a.width[0] - p.a.width[1]) % v != 0) return false;
    for (int i = 0; i < 3; ++i) {
      if (index_sizes[i] > 1 && (g.in_index_stride[i] % v != 0 || g.out_index_stride[i] % v != 0)) return false;
    }
    const int64_t row_sizes[2] = {g.rows_b, g.rows_h};
    for (int i = 0; i < 2; ++i) {
      if (row_sizes[i] > 1 && (g.in_row_stride[i] % v != 0 || g.out_row_stride[i] % v != 0)) return false;
    }
    const size_t bytes = static_cast<size_t>(v) * sizeof(T);
    return apex::aligned_to(input.const_data_ptr(), bytes) && apex::aligned_to(output.const_data_ptr(), bytes);
  };
  int v = static_cast<int>(16 / sizeof(T));
  while (!fits(v)) v /= 2;
  for (int s = 0; s < 2; ++s) p.a.items[s] = p.a.width[s] / (2 * v);
  const int pass_vectors = (p.d - p.a.width[0] - p.a.width[1]) / v;
  p.a.pass_pairs = pass_vectors / 2;
  p.a.pass_items = pass_vectors - p.a.pass_pairs;
  const int64_t n_items = p.a.items[0] + p.a.items[1] + p.a.pass_items;
  const int64_t rows = std::max<int64_t>(1, g.rows_b * g.rows_h);
  const int64_t unroll = rows_in_flight(static_cast<size_t>(v) * sizeof(T));
  const int64_t wave = static_cast<int64_t>(apex::sm_count()) * 2048;
  const int64_t per_chunk_threads = std::max<int64_t>(1, g.positions * n_items);
  const int64_t chunks = std::clamp<int64_t>(apex::ceil_div(2 * wave, per_chunk_threads), 1, rows);
  const bool full_chunks_fill = per_chunk_threads * apex::ceil_div(rows, kFullChunkRows) >= wave;
  const int64_t min_rows = full_chunks_fill ? kFullChunkRows : kMinChunkRows;
  int64_t rows_per_chunk = std::max<int64_t>(apex::ceil_div(rows, chunks), min_rows);
  rows_per_chunk = std::min(apex::ceil_div(rows_per_chunk, unroll) * unroll, rows);
  g.rows_per_chunk = rows_per_chunk;
  g.chunks = apex::ceil_div(rows, rows_per_chunk);
  return v;
}

template <typename T, int V>
void launch_kernel(const at::Tensor& input, at::Tensor& output, const Problem& p) {
  const int64_t n_items = p.a.items[0] + p.a.items[1] + p.a.pass_items;
  const int64_t threads = p.g.positions * p.g.chunks * n_items;
  const int64_t blocks = apex::ceil_div(threads, kThreads);
  TORCH_CHECK(blocks <= 0x7fffffff, "rope: too many rows for one launch");
  rope_kernel<T, V><<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const T*>(input.const_data_ptr()), static_cast<T*>(output.data_ptr()), p.g, p.a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run(const char* op, const at::Tensor& input, at::Tensor& output, Problem& p, int64_t index_sizes[3]) {
  if (output.numel() == 0) return;
  APEX_DISPATCH_FLOAT_TYPES(input.scalar_type(), op, "input", scalar_t, {
    const int v = plan<scalar_t>(p, input, output, index_sizes);
    switch (v) {
      case 8:
        if constexpr (sizeof(scalar_t) == 2) launch_kernel<scalar_t, 8>(input, output, p);
        break;
      case 4:
        launch_kernel<scalar_t, 4>(input, output, p);
        break;
      case 2:
        launch_kernel<scalar_t, 2>(input, output, p);
        break;
      default:
        launch_kernel<scalar_t, 1>(input, output, p);
    }
  });
}

// checks (the words of _rope_ops.py) -------------------------------------------------------------

std::string dtype_str(c10::ScalarType t) { return apex::checks::torch_dtype(t); }

void check_input(const char* op, const at::Tensor& input, int64_t ndim, const char* layout) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK_TYPE(apex::checks::contains(apex::checks::kFloatDtypes, dtype), op, ": input has dtype ",
                   dtype_str(dtype), "; expected one of float32, float16, bfloat16");
  TORCH_CHECK_VALUE(input.dim() == ndim, op, ": input must be ", ndim, "-D ", layout, ", got shape ",
                    apex::checks::shape_string(input.sizes()));
  apex::checks::placed(op, "input", input, input.device());
}

// float32, or float32 / the input's dtype for cached tables.
void check_dtype(const char* op, const char* name, const at::Tensor& t, c10::ScalarType input_dtype, bool cached) {
  const auto dtype = t.scalar_type();
  const bool ok = dtype == at::kFloat || (cached && dtype == input_dtype);
  if (!cached || input_dtype == at::kFloat) {
    TORCH_CHECK_TYPE(ok, op, ": ", name, " has dtype ", dtype_str(dtype), "; expected float32");
  } else {
    TORCH_CHECK_TYPE(ok, op, ": ", name, " has dtype ", dtype_str(dtype), "; expected float32 or ",
                     apex::checks::dtype_name(input_dtype));
  }
}

int64_t check_table(const char* op, const char* name, const at::Tensor& t, int64_t d, c10::Device device) {
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(1) == 1 && t.size(2) == 1, op, ": ", name,
                    " must have shape [positions, 1, 1, d2], got ", apex::checks::shape_string(t.sizes()));
  const int64_t d2 = t.size(3);
  TORCH_CHECK_VALUE(d2 <= d, op, ": ", name, " has d2 = ", d2, " channels but the input's head dim is ", d,
                    "; d2 must not exceed it");
  TORCH_CHECK_VALUE(d2 % 2 == 0, op, ": ", name, " has an odd number of channels (d2 = ", d2,
                    "); rotate-half needs an even d2");
  apex::checks::placed(op, name, t, device);
  return d2;
}

void check_positions(const char* op, const char* name, const at::Tensor& t, int64_t s) {
  TORCH_CHECK_VALUE(t.size(0) == s, op, ": ", name, " has ", t.size(0),
                    " positions but the input's sequence length is ", s);
}

void check_pair(const char* op, const char* cos_name, const at::Tensor& cos, const char* sin_name,
                const at::Tensor& sin) {
  TORCH_CHECK_TYPE(sin.scalar_type() == cos.scalar_type(), op, ": ", sin_name, " has dtype ",
                   dtype_str(sin.scalar_type()), " but ", cos_name, " has dtype ", dtype_str(cos.scalar_type()));
  TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), op, ": ", sin_name, " has shape ",
                    apex::checks::shape_string(sin.sizes()), " but ", cos_name, " has shape ",
                    apex::checks::shape_string(cos.sizes()));
}

// ops ------------------------------------------------------------------------------------------

Problem sequence_problem(const at::Tensor& input, const at::Tensor& output, int64_t d2, bool backward,
                         int64_t index_sizes[3]) {
  Problem p{};
  p.d = static_cast<int>(input.size(3));
  Geometry& g = p.g;
  g.positions = input.size(0);
  g.n1 = 1;
  g.n2 = std::max<int64_t>(1, input.size(0));
  g.in_index_stride[2] = input.stride(0);
  g.out_index_stride[2] = output.stride(0);
  g.rows_b = input.size(1);
  g.rows_h = input.size(2);
  g.in_row_stride[0] = input.stride(1);
  g.in_row_stride[1] = input.stride(2);
  g.out_row_stride[0] = output.stride(1);
  g.out_row_stride[1] = output.stride(2);
  g.in_stride_d = input.stride(3);
  p.a.width[0] = static_cast<int>(d2);
  p.a.positions = Positions::kSequence;
  p.a.backward = backward;
  index_sizes[0] = index_sizes[1] = 1;
  index_sizes[2] = input.size(0);
  return p;
}

at::Tensor sequence_output(const at::Tensor& input, bool transpose_output) {
  if (transpose_output) {
    return at::empty({input.size(1), input.size(0), input.size(2), input.size(3)}, input.options()).transpose(0, 1);
  }
  return at::empty(input.sizes(), input.options());
}

}  // namespace

at::Tensor rope_cuda(const at::Tensor& input, const at::Tensor& freqs, bool transpose_output, bool backward) {
  const char* op = "rope";
  check_input(op, input, 4, "[s, b, h, d]");
  check_dtype(op, "freqs", freqs, input.scalar_type(), false);
  const int64_t d2 = check_table(op, "freqs", freqs, input.size(3), input.device());
  check_positions(op, "freqs", freqs, input.size(0));
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = sequence_output(input, transpose_output);
  const at::Tensor table = freqs.contiguous();
  int64_t index_sizes[3];
  Problem p = sequence_problem(input, output, d2, backward, index_sizes);
  p.a.freqs = table.const_data_ptr<float>();
  run(op, input, output, p, index_sizes);
  return output;
}

at::Tensor rope_cached_cuda(const at::Tensor& input, const at::Tensor& cos, const at::Tensor& sin,
                            bool transpose_output, bool backward) {
  const char* op = "rope_cached";
  check_input(op, input, 4, "[s, b, h, d]");
  check_dtype(op, "cos", cos, input.scalar_type(), true);
  check_pair(op, "cos", cos, "sin", sin);
  const int64_t d2 = check_table(op, "cos", cos, input.size(3), input.device());
  check_positions(op, "cos", cos, input.size(0));
  check_table(op, "sin", sin, input.size(3), input.device());
  check_positions(op, "sin", sin, input.size(0));
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = sequence_output(input, transpose_output);
  const at::Tensor cos_table = cos.contiguous(), sin_table = sin.contiguous();
  int64_t index_sizes[3];
  Problem p = sequence_problem(input, output, d2, backward, index_sizes);
  p.a.cached = true;
  p.a.table_float = cos.scalar_type() == at::kFloat;
  p.a.cos[0] = cos_table.const_data_ptr();
  p.a.sin[0] = sin_table.const_data_ptr();
  run(op, input, output, p, index_sizes);
  return output;
}

at::Tensor rope_thd_cuda(const at::Tensor& input, const at::Tensor& cu_seqlens, const at::Tensor& freqs,
                         bool backward) {
  const char* op = "rope_thd";
  check_input(op, input, 3, "[t, h, d]");
  TORCH_CHECK_TYPE(cu_seqlens.scalar_type() == at::kInt, op, ": cu_seqlens has dtype ",
                   dtype_str(cu_seqlens.scalar_type()), "; expected int32");
  TORCH_CHECK_VALUE(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, op,
                    ": cu_seqlens must be 1-D with b + 1 >= 1 entries, got shape ",
                    apex::checks::shape_string(cu_seqlens.sizes()));
  apex::checks::placed(op, "cu_seqlens", cu_seqlens, input.device());
  check_dtype(op, "freqs", freqs, input.scalar_type(), false);
  const int64_t d2 = check_table(op, "freqs", freqs, input.size(2), input.device());
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = at::empty(input.sizes(), input.options());
  const at::Tensor table = freqs.contiguous(), cu = cu_seqlens.contiguous();
  Problem p{};
  p.d = static_cast<int>(input.size(2));
  Geometry& g = p.g;
  g.positions = input.size(0);
  g.n1 = 1;
  g.n2 = std::max<int64_t>(1, input.size(0));
  g.in_index_stride[2] = input.stride(0);
  g.out_index_stride[2] = output.stride(0);
  g.rows_b = 1;
  g.rows_h = input.size(1);
  g.in_row_stride[1] = input.stride(1);
  g.out_row_stride[1] = output.stride(1);
  g.in_stride_d = input.stride(2);
  p.a.width[0] = static_cast<int>(d2);
  p.a.positions = Positions::kPacked;
  p.a.backward = backward;
  p.a.freqs = table.const_data_ptr<float>();
  p.a.table_positions = freqs.size(0);
  p.a.cu_seqlens = cu.const_data_ptr<int>();
  p.a.sequences = cu.size(0) - 1;
  int64_t index_sizes[3] = {1, 1, input.size(0)};
  run(op, input, output, p, index_sizes);
  return output;
}

at::Tensor rope_2d_cuda(const at::Tensor& input, const at::Tensor& cos_h, const at::Tensor& sin_h,
                        const at::Tensor& cos_w, const at::Tensor& sin_w, bool backward) {
  const char* op = "rope_2d";
  check_input(op, input, 5, "[b, img_h, img_w, h, d]");
  const int64_t d = input.size(4);
  TORCH_CHECK_VALUE(d % 4 == 0, op, ": input's head dim d = ", d,
                    " must be a multiple of 4 (two rotated halves of even width)");
  check_dtype(op, "cos_h", cos_h, input.scalar_type(), true);
  const at::Tensor* tables[4] = {&cos_h, &sin_h, &cos_w, &sin_w};
  const char* names[4] = {"cos_h", "sin_h", "cos_w", "sin_w"};
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& t = *tables[i];
    const int64_t extent = input.size(i < 2 ? 1 : 2);
    TORCH_CHECK_TYPE(t.scalar_type() == cos_h.scalar_type(), op, ": ", names[i], " has dtype ",
                     dtype_str(t.scalar_type()), " but cos_h has dtype ", dtype_str(cos_h.scalar_type()));
    TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == 1 && t.size(2) == 1 && t.size(3) == d / 2, op, ": ", names[i],
                      " must have shape [1, positions, 1, d/2 = ", d / 2, "], got ",
                      apex::checks::shape_string(t.sizes()));
    TORCH_CHECK_VALUE(t.size(1) >= extent, op, ": ", names[i], " has ", t.size(1),
                      " positions but the image needs ", extent);
    apex::checks::placed(op, names[i], t, input.device());
  }
  check_pair(op, "cos_h", cos_h, "sin_h", sin_h);
  check_pair(op, "cos_w", cos_w, "sin_w", sin_w);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t b = input.size(0), img_h = input.size(1), img_w = input.size(2), h = input.size(3);
  at::Tensor output = at::empty({b, img_h * img_w, h, d}, input.options());
  at::Tensor contiguous[4];
  for (int i = 0; i < 4; ++i) contiguous[i] = tables[i]->contiguous();
  Problem p{};
  p.d = static_cast<int>(d);
  Geometry& g = p.g;
  g.positions = b * img_h * img_w;
  g.n1 = std::max<int64_t>(1, img_h);
  g.n2 = std::max<int64_t>(1, img_w);
  for (int i = 0; i < 3; ++i) g.in_index_stride[i] = input.stride(i);
  g.out_index_stride[0] = output.stride(0);
  g.out_index_stride[1] = img_w * output.stride(1);
  g.out_index_stride[2] = output.stride(1);
  g.rows_b = 1;
  g.rows_h = h;
  g.in_row_stride[1] = input.stride(3);
  g.out_row_stride[1] = output.stride(2);
  g.in_stride_d = input.stride(4);
  p.a.width[0] = p.a.width[1] = static_cast<int>(d / 2);
  p.a.positions = Positions::kImage;
  p.a.backward = backward;
  p.a.cached = true;
  p.a.table_float = cos_h.scalar_type() == at::kFloat;
  p.a.cos[0] = contiguous[0].const_data_ptr();
  p.a.sin[0] = contiguous[1].const_data_ptr();
  p.a.cos[1] = contiguous[2].const_data_ptr();
  p.a.sin[1] = contiguous[3].const_data_ptr();
  int64_t index_sizes[3] = {b, img_h, img_w};
  run(op, input, output, p, index_sizes);
  return output;
}

}  // namespace apex_transformer

