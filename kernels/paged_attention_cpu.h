// What the paged-attention kernels for CPUs share (paged_decode_cpu.cpp, paged_prefill_cpu.cpp, and the ops in
// paged_attention_cpu.cpp): vectors of 16 floats, the pool's layout, a layer's attention variant, the thread loop.
//
// The torch reference gathers K/V rows into a workspace, upcasts 16-bit ones, then runs matmuls, a softmax
// and an embedding_bag over them: every byte of context crosses memory several times. Decode attention is bound
// by memory, so here each key and each value row is read once, widened to fp32 in registers and used at once.
//
// Layout (one layer): kv_layer[2, num_blocks, block_size, num_kv_heads, head_dim], keys then values; token slot
// s lives at block s / block_size, offset s % block_size. Scores and softmax are fp32 for every cache dtype.
// No slot past a context is ever read, so whatever the pool holds there cannot reach the output.
//
// Per call, a layer's variant (kernels/variants.py defines each): a sliding window W, where a query at position p
// sees only keys p-W+1 .. p and no block-table entry of a block wholly before a call's earliest visible position
// is read (an engine may have freed those blocks); a logit soft-cap c (s -> c * tanh(s / c)); per-head sink
// logits that join each softmax's denominator.
//
// The arithmetic is written with GCC/Clang vector types of 16 floats: one AVX-512 register with -march=native
// on x86, two AVX2 or four NEON registers elsewhere, with no intrinsics. head_dim is a template parameter
// (in lanes of 16), so a row is a handful of registers. kvscope/kernels/cpu.py builds these files on first
// use.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace kvscope_attention {

constexpr int kLanes = 16;
// aligned(4) and may_alias: a vfloat may be loaded from or stored to any float*.
typedef float vfloat __attribute__((vector_size(64), aligned(4), __may_alias__));
typedef float vfloat8 __attribute__((vector_size(32), aligned(4)));
typedef float vfloat4 __attribute__((vector_size(16), aligned(4)));
typedef uint16_t vuint16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vuint32 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vint32 __attribute__((vector_size(64), aligned(4)));

// ---- vectors --------------------------------------------------------------------------------------------------

inline vfloat splat(float x) { return vfloat{} + x; }

inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat*>(p); }

inline vfloat load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  vuint16 half;
  std::memcpy(&half, p, sizeof(half));
  const vuint32 widened = __builtin_convertvector(half, vuint32) << 16;
  vfloat out;
  std::memcpy(&out, &widened, sizeof(out));
  return out;
}

inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat*>(p) = v; }

inline float sum(vfloat v) {
  const vfloat8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float max(vfloat v) {  // a tree of halvings, not a scalar loop's 15 dependent steps (once per row and tile)
  const vfloat8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const vfloat8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat8 a = lo < hi ? hi : lo;
  const vfloat4 a_lo = __builtin_shufflevector(a, a, 0, 1, 2, 3), a_hi = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const vfloat4 b = a_lo < a_hi ? a_hi : a_lo;
  return std::max(std::max(b[0], b[2]), std::max(b[1], b[3]));
}

// e^x for the x <= 0 of a softmax (scores minus their maximum): Cephes' expf, 2^n * e^r with |r| <= ln2 / 2,
// as plain vector arithmetic. Relative error about 2e-7; below -87 it returns about 1e-38; NaN stays NaN.
inline vfloat exp_nonpositive(vfloat x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const vfloat n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const vint32 bits = (__builtin_convertvector(n, vint32) + 127) << 23;
  vfloat two_to_n;
  std::memcpy(&two_to_n, &bits, sizeof(two_to_n));
  return p * two_to_n;
}

inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

// A head_dim-long row as C vectors.
template <int C>
struct Row {
  vfloat v[C];
  template <typename T>
  static Row load_from(const T* p) {
    Row row;
    for (int c = 0; c < C; ++c) row.v[c] = load(p + c * kLanes);
    return row;
  }
};

template <int C>
inline float dot(const Row<C>& a, const Row<C>& b) {
  vfloat acc = a.v[0] * b.v[0];
  for (int c = 1; c < C; ++c) acc += a.v[c] * b.v[c];
  return sum(acc);
}

template <int C, typename T>
inline void store_row(const float* acc, float factor, T* out) {
  for (int i = 0; i < C * kLanes; ++i) out[i] = static_cast<T>(acc[i] * factor);
}

// Scratch that lives as long as its thread and only grows: no allocation per call once warm.
template <typename E = float>
inline E* scratch(int64_t count) {
  thread_local std::vector<E> buffer;
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

struct Variant {
  int64_t window;      // 0: full attention
  float softcap;       // 0: none
  const float* sinks;  // [num_q_heads] or nullptr

  int64_t first_visible(int64_t position) const { return window ? std::max<int64_t>(0, position - window + 1) : 0; }
  bool is_plain() const { return window == 0 && softcap == 0.0f && sinks == nullptr; }
};

inline float soft_cap(float score, float cap) { return cap * std::tanh(score / cap); }

inline vfloat soft_cap(vfloat scores, float cap) {
  for (int i = 0; i < kLanes; ++i) scores[i] = soft_cap(scores[i], cap);
  return scores;
}

struct Pool {
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
  int64_t token_stride() const { return num_kv_heads * head_dim; }
  int64_t values_offset() const { return num_blocks * block_size * token_stride(); }
  int64_t slot(const int32_t* table, int64_t position) const {
    return table[position / block_size] * block_size + position % block_size;
  }
};

inline Pool pool_of(const at::Tensor& kv_layer) {
  return {kv_layer.size(1), kv_layer.size(2), kv_layer.size(3), kv_layer.size(4)};
}

// Runs body(item) for item in [0, count) on torch's threads, handing items out one at a time.
template <typename Body>
void for_each_item(int64_t count, const Body& body) {
  const int64_t threads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
  for (int64_t item = 0; item < count; ++item) body(item);
}

// Calls fn.template operator()<C, T>() for the query's dtype and head_dim (in lanes); false if not covered.
template <typename Fn>
void dispatch(const at::Tensor& query, const Fn& fn) {
  const bool bf16 = query.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || query.scalar_type() == at::kFloat, "kvscope_cpu: float32 and bfloat16 only");
  switch (query.size(2)) {
    case 16: return bf16 ? fn.template operator()<1, c10::BFloat16>() : fn.template operator()<1, float>();
    case 32: return bf16 ? fn.template operator()<2, c10::BFloat16>() : fn.template operator()<2, float>();
    case 64: return bf16 ? fn.template operator()<4, c10::BFloat16>() : fn.template operator()<4, float>();
    case 128: return bf16 ? fn.template operator()<8, c10::BFloat16>() : fn.template operator()<8, float>();
    case 256: return bf16 ? fn.template operator()<16, c10::BFloat16>() : fn.template operator()<16, float>();
    default: TORCH_CHECK(false, "kvscope_cpu: head_dim must be 16, 32, 64, 128 or 256");
  }
}

void run_decode(const at::Tensor& query, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                const at::Tensor& context_lens, const Variant& variant, float scale, at::Tensor& out);
void run_prefill(const at::Tensor& query, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                 const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, const Variant& variant, float scale,
                 at::Tensor& out);

}  // namespace kvscope_attention
