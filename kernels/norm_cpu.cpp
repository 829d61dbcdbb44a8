// RMSNorm for CPUs in one op: what transformers' *RMSNorm modules compute in seven (a cast up, pow, mean, add,
// rsqrt, mul, a cast back) and then the weight's multiply, each a pass over the hidden states and a few
// microseconds of dispatch. A 30-layer model runs 61 norms a step.
//
// It computes exactly the stock module's formula, roundings included:
//   normalized = x in fp32 * rsqrt(mean(x^2) + eps), rounded to x's dtype;  out = weight * normalized,
// in the dtype torch promotes weight and x to. Only the order of the mean's sum differs. engine/fused_ops.py checks
// each module against its own forward before it plugs this in. kernels/cpu.py builds this file with the others.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename In, typename W, typename Out>
void rms_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const In* xp = x.data_ptr<In>();
  const W* wp = weight.data_ptr<W>();
  Out* op = out.data_ptr<Out>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const In* row = xp + r * dim;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += widen(row[i]) * widen(row[i]);
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
      Out* o = op + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        o[i] = static_cast<Out>(widen(wp[i]) * round_to<In>(widen(row[i]) * inverse));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "kvscope_cpu: CPU tensors only");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(-1), "kvscope_cpu: weight must be [hidden]");
  const auto in = input.scalar_type(), w = weight.scalar_type();
  TORCH_CHECK((in == at::kFloat || in == at::kBFloat16) && (w == at::kFloat || w == at::kBFloat16),
              "kvscope_cpu: rms_norm takes float32 and bfloat16");
  const at::Tensor x = input.reshape({-1, input.size(-1)}).contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty(input.sizes(), input.options().dtype(at::promote_types(in, w)));
  at::Tensor flat = out.view({-1, input.size(-1)});
  const bool in_f = in == at::kFloat, w_f = w == at::kFloat;
  using BF = c10::BFloat16;
  if (in_f && w_f) rms_rows<float, float, float>(x, wc, eps, flat);
  else if (in_f && !w_f) rms_rows<float, BF, float>(x, wc, eps, flat);
  else if (!in_f && w_f) rms_rows<BF, float, float>(x, wc, eps, flat);
  else rms_rows<BF, BF, BF>(x, wc, eps, flat);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvscope_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
