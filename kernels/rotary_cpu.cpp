// Rotary position embedding for CPUs in one op: what transformers' apply_rotary_pos_emb (the rotate-half form of
// Llama, Mistral, Qwen, Gemma, ...) computes in ten (for q and for k: a multiply by cos, a negation and a
// concatenation for rotate_half, a multiply by sin, an add), each a pass over the heads and a few microseconds of
// dispatch. In a decode step those ten are a tenth of the time outside the linears; in a prefill, 7% of it all.
//
// It computes exactly the stock formula, roundings included: out = x * cos + rotate_half(x) * sin, each product
// rounded, then their sum; so x1 * c + (-x2) * s for the first half of a head and x2 * c + x1 * s for the second.
// No multiply-add is fused (`separate` keeps the compiler from contracting one), so every output bit is the stock
// one; engine/model/fused_ops.py checks that on a probe before it plugs this in. kernels/cpu.py builds this file.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <tuple>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;

// v as it is, hidden from the optimiser: a product passed through here is rounded on its own, never fused into
// the add that follows (GCC contracts a * b + c into one FMA where it may).
inline __m512 separate(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

inline __m512 negated(__m512 v) {  // the sign bit flipped, as torch's neg does (-0 for +0, unlike 0 - v)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}

// One head's row: out[0, half) and out[half, dim) from x's two halves and the position's cos and sin.
inline void rotate_row(const float* x, const float* cos, const float* sin, int64_t half, float* out) {
  for (int64_t d = 0; d < half; d += kLanes) {
    const __mmask16 mask = half - d >= kLanes ? static_cast<__mmask16>(0xFFFF)
                                              : static_cast<__mmask16>((1u << (half - d)) - 1);
    const __m512 x1 = _mm512_maskz_loadu_ps(mask, x + d), x2 = _mm512_maskz_loadu_ps(mask, x + half + d);
    const __m512 c1 = _mm512_maskz_loadu_ps(mask, cos + d), c2 = _mm512_maskz_loadu_ps(mask, cos + half + d);
    const __m512 s1 = _mm512_maskz_loadu_ps(mask, sin + d), s2 = _mm512_maskz_loadu_ps(mask, sin + half + d);
    const __m512 first = _mm512_add_ps(separate(_mm512_mul_ps(x1, c1)), separate(_mm512_mul_ps(negated(x2), s1)));
    const __m512 second = _mm512_add_ps(separate(_mm512_mul_ps(x2, c2)), separate(_mm512_mul_ps(x1, s2)));
    _mm512_mask_storeu_ps(out + d, mask, first);
    _mm512_mask_storeu_ps(out + half + d, mask, second);
  }
}
#else
// Without AVX-512: the same arithmetic a value at a time, each product stored through a volatile so that it is
// rounded on its own.
inline void rotate_row(const float* x, const float* cos, const float* sin, int64_t half, float* out) {
  for (int64_t d = 0; d < half; ++d) {
    volatile float a = x[d] * cos[d], b = -x[half + d] * sin[d];
    out[d] = a + b;
    volatile float c = x[half + d] * cos[half + d], e = x[d] * sin[half + d];
    out[half + d] = c + e;
  }
}
#endif

// x [batch, heads, tokens, dim] (any strides, unit stride along dim), cos and sin [batch, tokens, dim].
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out = at::empty_like(x);
  const int64_t batch = x.size(0), heads = x.size(1), tokens = x.size(2), half = x.size(3) / 2;
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xb = x.stride(0), xh = x.stride(1), xt = x.stride(2);
  const int64_t ob = out.stride(0), oh = out.stride(1), ot = out.stride(2);
  const int64_t cb = cos.stride(0), ct = cos.stride(1);   // sin is laid out as cos: both made contiguous
  at::parallel_for(0, batch * tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (tokens * heads), t = row / heads % tokens, h = row % heads;
      const int64_t position = b * cb + t * ct;
      rotate_row(xp + b * xb + h * xh + t * xt, cp + position, sp + position, half, op + b * ob + h * oh + t * ot);
    }
  });
  return out;
}

void check(const at::Tensor& x, const at::Tensor& cos, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4, "kvscope_cpu: rotary's ", name,
              " must be a float32 CPU tensor [batch, heads, tokens, dim]");
  TORCH_CHECK(x.stride(3) == 1 && x.size(3) % 2 == 0, "kvscope_cpu: rotary's ", name,
              " needs an even head dim with unit stride");
  TORCH_CHECK(x.size(0) == cos.size(0) && x.size(2) == cos.size(1) && x.size(3) == cos.size(2),
              "kvscope_cpu: rotary's ", name, " and cos/sin disagree in shape");
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_in,
                                          const at::Tensor& sin_in) {
  TORCH_CHECK(cos_in.scalar_type() == at::kFloat && sin_in.scalar_type() == at::kFloat && cos_in.dim() == 3 &&
                  cos_in.sizes() == sin_in.sizes() && cos_in.device().is_cpu() && sin_in.device().is_cpu(),
              "kvscope_cpu: rotary's cos and sin must be float32 CPU tensors [batch, tokens, dim]");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  check(q, cos, "q");
  check(k, cos, "k");
  return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m) {
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvscope_cpu, CPU, m) {
  m.impl("rotary", &rotary);
}
