// What the packed linear's two files share: linear_cpu.cpp (packing, the FMA and vdpbf16ps paths, the op) and
// linear_amx_cpu.cpp (the AMX path). kernels/cpu.py builds both into one library.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvscope_linear {

constexpr int kLanes = 16;          // output columns per panel (one fp32 vector, one AMX tile row)
constexpr int kBlockCols = 2 * kLanes;  // a work item's columns: a pair of panels
constexpr int64_t kRowChunk = 128;  // rows per work item: the panel pair's weights stay in cache across them

// Work items on the OpenMP team torch was told to use (at::get_num_threads), handed out one at a time.
template <typename Body>
inline void parallel_items(int64_t count, const Body& body) {
  const int64_t threads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
  for (int64_t item = 0; item < count; ++item) body(item);
}

// Writes sums (+ bias) for rows [r0, r0 + rows) of panels p and p + 1: sums is [rows][kBlockCols] fp32, and
// columns at or past n are the pack's zero padding, dropped here.
template <typename Out>
inline void store_block(const float* sums, int rows, int64_t r0, int64_t p, int64_t n, const float* bias, Out* out) {
  const int64_t col0 = p * kLanes;
  const int64_t cols = std::min<int64_t>(kBlockCols, n - col0);
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<Out, float>) {
    if (cols == kBlockCols) {
      const __m512 b0 = bias ? _mm512_loadu_ps(bias + col0) : _mm512_setzero_ps();
      const __m512 b1 = bias ? _mm512_loadu_ps(bias + col0 + kLanes) : _mm512_setzero_ps();
      for (int r = 0; r < rows; ++r) {
        float* o = out + (r0 + r) * n + col0;
        const float* s = sums + r * kBlockCols;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(s), b0));
        _mm512_storeu_ps(o + kLanes, _mm512_add_ps(_mm512_loadu_ps(s + kLanes), b1));
      }
      return;
    }
  }
#endif
  for (int r = 0; r < rows; ++r) {
    Out* o = out + (r0 + r) * n + col0;
    const float* s = sums + r * kBlockCols;
    for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<Out>(s[c] + (bias ? bias[col0 + c] : 0.0f));
  }
}

// dst[i] = src[i] rounded to bf16, to nearest even (as x.to(torch.bfloat16) does, denormals aside: the bf16 dot
// products treat those as zero anyway). 32 values an instruction where the CPU has AVX512-BF16: a prefill's
// activations are hundreds of thousands of values, and converting them one by one took longer than AMX's products.
inline void round_to_bf16(const float* src, int64_t count, c10::BFloat16* dst) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 32 <= count; i += 32) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, reinterpret_cast<const __m512i&>(pair));
  }
#endif
  for (; i < count; ++i) dst[i] = c10::BFloat16(src[i]);
}

// ---- the AMX path (linear_amx_cpu.cpp) ------------------------------------------------------------------------

// Whether this build has AMX-BF16 and Linux let this process use the tile registers (asked once).
bool amx_available();

// out[m, n] (+ bias) = x [m, k] (fp32 or bf16) rounded to bf16, times the packed bf16 weight [panels][pairs][kLanes][2]
// (panels even), summed in fp32 on AMX tiles.
template <typename Out>
void amx_linear(const at::Tensor& x, const c10::BFloat16* packed, int64_t panels, int64_t pairs, int64_t n,
                const float* bias, Out* out);

}  // namespace kvscope_linear
