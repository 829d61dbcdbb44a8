// Linear layers for CPUs on weights packed once into column panels: y = x W^T (+ bias).
//
// Why not oneDNN for every call: torch's packed oneDNN linear (mkldnn::_linear_pointwise) costs about 35 us per
// call before any arithmetic, measured here on a [1, 64] x [64, 128] product; a 30-layer model makes over 200
// such calls a step, so a decode step paid ~7 ms in overhead alone. This kernel costs a few microseconds a call.
//
// The weight [N, K] is packed into panels of 16 output columns. bf16 weights are stored as K/2 pairs per column
// ([N/16][K/2][16][2]): one 64-byte load holds 16 columns x 2 consecutive k, which is exactly what the AVX-512 BF16
// dot product (vdpbf16ps) wants, and two shifts/masks turn it into two fp32 vectors for plain FMAs. fp32 weights
// are stored [N/16][K][16].
//
// Two ways through the arithmetic:
//   - exact: activations stay fp32 (a bf16 input is widened); each bf16 weight is widened in registers and FMA'd in
//     fp32. This is the fp32 product of the bf16 weights, so a bf16 model's linears and LM head lose nothing to
//     rounding their inputs. Reading each weight once per tile of rows, it runs at the memory's speed for decode.
//   - bf16 dot products, for bf16 weights from `bf16_min_rows` rows up: activations are rounded to bf16 (what a
//     stock bf16 linear does) and vdpbf16ps does 32 multiply-adds per instruction: twice the FMA path's rate, for
//     prefill. Only where the compiler targets AVX512-BF16; elsewhere the exact path serves every size.
//     From `amx_min_rows` rows up, where the CPU has AMX and Linux grants it, the same rounded products run on
//     AMX tiles instead (linear_amx_cpu.cpp): 5-9x the vdpbf16ps rate at 256-1024 rows.
// Every path sums in fp32 and writes the sums as they are, or rounded once where the caller asks for bf16.
//
// Work items are (pair of column panels, chunk of rows): a panel pair's weights stay in cache across the chunk's
// row tiles. kernels/cpu.py builds this file with linear_amx_cpu.cpp and the attention kernels into one library.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "linear_cpu.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace kvscope_linear;

constexpr int kRows = 8;         // rows of a register tile: 8 rows x 2 panels = 16 accumulators

typedef float vfloat __attribute__((vector_size(64), aligned(4), __may_alias__));
typedef uint32_t vuint32 __attribute__((vector_size(64), aligned(4), __may_alias__));
typedef float vacc __attribute__((vector_size(64)));  // accumulators: locals, never aliased

inline vfloat splat(float x) { return vfloat{} + x; }
inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat*>(p); }
inline vuint32 load_u32(const void* p) { return *reinterpret_cast<const vuint32*>(p); }
inline vfloat as_float(vuint32 v) {
  vfloat out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// ---- packing ---------------------------------------------------------------------------------------------------

int64_t panels_of(int64_t n) { return ((n + kLanes - 1) / kLanes + 1) / 2 * 2; }  // even: work goes by pairs

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "kvscope_cpu: weight must be a 2-D CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = panels_of(n);
  if (w.scalar_type() == at::kBFloat16) {
    const int64_t pairs = (k + 1) / 2;
    at::Tensor packed = at::zeros({panels, pairs, kLanes, 2}, w.options());
    const auto* src = w.data_ptr<c10::BFloat16>();
    auto* dst = packed.data_ptr<c10::BFloat16>();
    for (int64_t col = 0; col < n; ++col) {
      const int64_t panel = col / kLanes, lane = col % kLanes;
      for (int64_t kk = 0; kk < k; ++kk) dst[((panel * pairs + kk / 2) * kLanes + lane) * 2 + kk % 2] = src[col * k + kk];
    }
    return packed;
  }
  TORCH_CHECK(w.scalar_type() == at::kFloat, "kvscope_cpu: linear weights must be float32 or bfloat16");
  at::Tensor packed = at::zeros({panels, k, kLanes}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t col = 0; col < n; ++col) {
    const int64_t panel = col / kLanes, lane = col % kLanes;
    for (int64_t kk = 0; kk < k; ++kk) dst[(panel * k + kk) * kLanes + lane] = src[col * k + kk];
  }
  return packed;
}

// ---- the tile kernels: rows [r0, r0 + rows) x panels p, p+1, accumulators in acc[rows][2] ----------------------

// fp32 activations (already widened, row stride k) and fp32 weights.
template <int R>
inline void tile_f32(const float* x, int64_t k, const float* w0, const float* w1, vfloat (&acc)[kRows][2]) {
  vacc s[R][2] = {};
  for (int64_t kk = 0; kk < k; ++kk) {
    const vacc a = load(w0 + kk * kLanes), b = load(w1 + kk * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * k + kk];
      s[r][0] += xv * a;
      s[r][1] += xv * b;
    }
  }
  for (int r = 0; r < R; ++r) acc[r][0] = s[r][0], acc[r][1] = s[r][1];
}

// fp32 activations (row stride 2 * pairs) and bf16 weight pairs, widened in registers: the exact path.
template <int R>
inline void tile_bf16_exact(const float* x, int64_t pairs, const c10::BFloat16* w0, const c10::BFloat16* w1,
                            vfloat (&acc)[kRows][2]) {
  const vuint32 high = vuint32{} + 0xFFFF0000u;
  vacc s[R][2] = {};
  for (int64_t p = 0; p < pairs; ++p) {
    const vuint32 u = load_u32(w0 + p * 2 * kLanes), v = load_u32(w1 + p * 2 * kLanes);
    const vacc a_even = as_float(u << 16), a_odd = as_float(u & high);
    const vacc b_even = as_float(v << 16), b_odd = as_float(v & high);
    for (int r = 0; r < R; ++r) {
      const float x0 = x[r * 2 * pairs + 2 * p], x1 = x[r * 2 * pairs + 2 * p + 1];
      s[r][0] += x0 * a_even;
      s[r][1] += x0 * b_even;
      s[r][0] += x1 * a_odd;
      s[r][1] += x1 * b_odd;
    }
  }
  for (int r = 0; r < R; ++r) acc[r][0] = s[r][0], acc[r][1] = s[r][1];
}

#if defined(__AVX512BF16__)
// bf16 activation pairs (as uint32, row stride pairs) and bf16 weight pairs: vdpbf16ps.
template <int R>
inline void tile_bf16_dot(const uint32_t* x, int64_t pairs, const c10::BFloat16* w0, const c10::BFloat16* w1,
                          vfloat (&acc)[kRows][2]) {
  __m512 sum[kRows][2];
  for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + p * 2 * kLanes);
    const __m512bh b = (__m512bh)_mm512_loadu_si512(w1 + p * 2 * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + p]));
      sum[r][0] = _mm512_dpbf16_ps(sum[r][0], xv, a);
      sum[r][1] = _mm512_dpbf16_ps(sum[r][1], xv, b);
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(&acc[r][0], &sum[r][0], sizeof(vfloat));
    std::memcpy(&acc[r][1], &sum[r][1], sizeof(vfloat));
  }
}
#endif

// Calls tile<R>(...) with R = rows as a compile-time constant (1..kRows).
template <typename Fn>
inline void with_rows(int rows, const Fn& fn) {
  switch (rows) {
    case 1: return fn.template operator()<1>();
    case 2: return fn.template operator()<2>();
    case 3: return fn.template operator()<3>();
    case 4: return fn.template operator()<4>();
    case 5: return fn.template operator()<5>();
    case 6: return fn.template operator()<6>();
    case 7: return fn.template operator()<7>();
    default: return fn.template operator()<8>();
  }
}

// Writes acc (+ bias) for rows [r0, r0 + rows) and the valid columns of panels p, p + 1: acc is laid out as
// store_block's [rows][kBlockCols] sums.
template <typename Out>
inline void store_tile(const vfloat (&acc)[kRows][2], int rows, int64_t r0, int64_t p, int64_t n, const float* bias,
                       Out* out) {
  static_assert(sizeof(acc[0]) == kBlockCols * sizeof(float));
  store_block(reinterpret_cast<const float*>(acc), rows, r0, p, n, bias, out);
}

// The activations rounded to bf16 pairs, [m][pairs] uint32, zero past k values.
std::vector<uint32_t> bf16_pairs(const at::Tensor& x, int64_t pairs) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<uint32_t> xp(m * pairs, 0);
  auto* xb = reinterpret_cast<c10::BFloat16*>(xp.data());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (x.scalar_type() == at::kFloat) {
        round_to_bf16(x.data_ptr<float>() + r * k, k, xb + r * 2 * pairs);
      } else {
        std::memcpy(xb + r * 2 * pairs, x.data_ptr<c10::BFloat16>() + r * k, k * sizeof(c10::BFloat16));
      }
    }
  });
  return xp;
}

// ---- the op --------------------------------------------------------------------------------------------------

template <typename Out>
void run(const at::Tensor& x, const at::Tensor& packed, int64_t n, const float* bias, int64_t bf16_min_rows,
         int64_t amx_min_rows, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  const bool bf16_weights = packed.scalar_type() == at::kBFloat16;
  const int64_t pairs = bf16_weights ? packed.size(1) : 0;
  const int64_t row_stride = bf16_weights ? 2 * pairs : k;   // of the widened activations
  Out* o = out.data_ptr<Out>();
  const int64_t chunks = (m + kRowChunk - 1) / kRowChunk, items = panels / 2 * chunks;

#if defined(__AVX512BF16__)
  if (bf16_weights && m >= bf16_min_rows) {
    const auto* w = packed.data_ptr<c10::BFloat16>();
    // Every CPU with AMX-BF16 has AVX512-BF16, so the AMX path lives inside this one.
    if (m >= amx_min_rows && amx_available()) {
      amx_linear<Out>(x, w, panels, pairs, n, bias, o);
      return;
    }
    const std::vector<uint32_t> xp = bf16_pairs(x, pairs);
    parallel_items(items, [&](int64_t item) {
      const int64_t p = item / chunks * 2, first = item % chunks * kRowChunk, last = std::min(m, first + kRowChunk);
      const c10::BFloat16 *w0 = w + p * pairs * 2 * kLanes, *w1 = w0 + pairs * 2 * kLanes;
      vfloat acc[kRows][2];
      for (int64_t r0 = first; r0 < last; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, last - r0));
        with_rows(rows, [&]<int R>() { tile_bf16_dot<R>(xp.data() + r0 * pairs, pairs, w0, w1, acc); });
        store_tile(acc, rows, r0, p, n, bias, o);
      }
    });
    return;
  }
#endif
  // Widen the activations to fp32 rows of row_stride (zero-padded to the packed k), unless they already are.
  const float* xf = nullptr;
  std::vector<float> widened;
  if (x.scalar_type() == at::kFloat && row_stride == k) {
    xf = x.data_ptr<float>();
  } else {
    widened.assign(m * row_stride, 0.0f);
    for (int64_t r = 0; r < m; ++r) {
      if (x.scalar_type() == at::kFloat) {
        std::memcpy(widened.data() + r * row_stride, x.data_ptr<float>() + r * k, k * sizeof(float));
      } else {
        const c10::BFloat16* row = x.data_ptr<c10::BFloat16>() + r * k;
        for (int64_t kk = 0; kk < k; ++kk) widened[r * row_stride + kk] = to_float(row[kk]);
      }
    }
    xf = widened.data();
  }
  parallel_items(items, [&](int64_t item) {
    const int64_t p = item / chunks * 2, first = item % chunks * kRowChunk, last = std::min(m, first + kRowChunk);
    vfloat acc[kRows][2];
    for (int64_t r0 = first; r0 < last; r0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, last - r0));
      if (bf16_weights) {
        const c10::BFloat16* w0 = packed.data_ptr<c10::BFloat16>() + p * pairs * 2 * kLanes;
        with_rows(rows, [&]<int R>() {
          tile_bf16_exact<R>(xf + r0 * row_stride, pairs, w0, w0 + pairs * 2 * kLanes, acc);
        });
      } else {
        const float* w0 = packed.data_ptr<float>() + p * k * kLanes;
        with_rows(rows, [&]<int R>() { tile_f32<R>(xf + r0 * k, k, w0, w0 + k * kLanes, acc); });
      }
      store_tile(acc, rows, r0, p, n, bias, o);
    }
  });
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, int64_t bf16_min_rows,
                  int64_t amx_min_rows) {
  TORCH_CHECK(input.device().is_cpu() && packed.device().is_cpu(), "kvscope_cpu: CPU tensors only");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "kvscope_cpu: linear input must be float32 or bfloat16");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "kvscope_cpu: out_dtype float32 or bfloat16");
  const bool bf16_weights = packed.scalar_type() == at::kBFloat16;
  const int64_t k = input.size(-1);
  TORCH_CHECK(packed.dim() == (bf16_weights ? 4 : 3) && packed.is_contiguous(), "kvscope_cpu: not a packed weight");
  TORCH_CHECK(bf16_weights ? (k + 1) / 2 == packed.size(1) : k == packed.size(1),
              "kvscope_cpu: input features do not match the packed weight");
  TORCH_CHECK(out_features <= packed.size(0) * kLanes, "kvscope_cpu: out_features larger than the packed weight");
  const at::Tensor x = input.reshape({-1, k}).contiguous();
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = out_features;
  at::Tensor out = at::empty(shape, input.options().dtype(out_dtype));
  if (x.size(0) == 0) return out;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) bias_f32 = bias->to(at::kFloat).contiguous();
  const float* b = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  if (out_dtype == at::kFloat) {
    run<float>(x, packed, out_features, b, bf16_min_rows, amx_min_rows, out);
  } else {
    run<c10::BFloat16>(x, packed, out_features, b, bf16_min_rows, amx_min_rows, out);
  }
  return out;
}

bool has_bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor input, Tensor packed, int out_features, Tensor? bias, ScalarType out_dtype, "
        "int bf16_min_rows, int amx_min_rows) -> Tensor");
  m.def("has_bf16_dot() -> bool", [] { return has_bf16_dot(); });
  m.def("has_amx() -> bool", [] { return amx_available(); });
}

TORCH_LIBRARY_IMPL(kvscope_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("linear", &linear);
}
