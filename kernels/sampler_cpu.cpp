// The sampler's rows in two ops for CPUs: greedy (the first maximum), and random rows (temperature, min-p, a draw,
// top-p), a row at a time.
//
// engine/model/sampler.py's torch path does the same as tensor ops over the whole batch: every stage is a pass
// over [rows, vocab] floats from memory (about 50 MB at batch 256), and top-p's test costs three more passes per
// round. Here a row's logits are read from memory once; its probabilities then stay in a per-thread buffer the
// size of one row (about 200 KB, resident in L2) for every later pass.
//
// The algorithm, and so the distribution, is the torch path's (the sampler's docstring says why it is exact):
//   p_i = exp((x_i - max) / T), zero under min_p (the row's maximum is 1);
//   a draw by inverse CDF over the row in token order with one uniform (chunk sums first, then a chunk);
//   top-p by rejection: the drawn token is in the nucleus when the mass strictly above it is under top_p of the
//   row's mass; otherwise it and everything at or below it are cut and the row draws again with the next uniform;
//   after `rounds` rejections the nucleus is found exactly by sorting what is left of that one row.
// The exponential is the attention kernels' (relative error about 2e-7); anything under e^-87 counts as 0.
// A row holding NaN gets -1. kvscope/kernels/cpu.py builds this file with the others.

#include "paged_attention_cpu.h"

namespace {

using kvscope_attention::exp_nonpositive;
using kvscope_attention::kLanes;
using kvscope_attention::load;
using kvscope_attention::splat;
using kvscope_attention::store;
using kvscope_attention::vfloat;
using kvscope_attention::vint32;

constexpr int64_t kChunk = 256;  // probabilities per chunk sum: a draw scans the chunk sums, then one chunk

struct RowBuffer {
  std::vector<float> probs;       // padded to whole chunks, zero past the vocabulary
  std::vector<double> chunk_sums;
};

// The row's maximum, and whether it holds NaN (two chains of lanes, so neither waits on the other's compare).
float row_max(const float* x, int64_t vocab, bool& any_nan) {
  const float lowest = -std::numeric_limits<float>::infinity();
  vint32 nan{};
  vfloat top[2] = {splat(lowest), splat(lowest)};
  int64_t i = 0;
  for (; i + 2 * kLanes <= vocab; i += 2 * kLanes) {
    for (int c = 0; c < 2; ++c) {
      const vfloat v = load(x + i + c * kLanes);
      nan |= v != v;
      top[c] = v > top[c] ? v : top[c];
    }
  }
  float best = std::max(kvscope_attention::max(top[0]), kvscope_attention::max(top[1]));
  for (; i < vocab; ++i) {
    nan[0] |= std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  any_nan = false;
  for (int lane = 0; lane < kLanes; ++lane) any_nan |= nan[lane] != 0;
  return best;
}

// p = exp((x - top) * scale), zero under min_p; fills the chunk sums, returns the row's mass.
double exponentiate(const float* x, int64_t vocab, float top, float scale, float min_p, RowBuffer& buffer) {
  float* p = buffer.probs.data();
  const int64_t chunks = static_cast<int64_t>(buffer.chunk_sums.size());
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk, end = std::min(begin + kChunk, vocab);
    vfloat acc{};
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      const vfloat t = (load(x + i) - top) * scale;
      vfloat e = exp_nonpositive(t);
      e = (t < -87.0f) | (e < min_p) ? splat(0.0f) : e;
      store(p + i, e);
      acc += e;
    }
    float chunk = kvscope_attention::sum(acc);
    for (; i < end; ++i) {
      const float t = (x[i] - top) * scale;
      const float e = exp_nonpositive(t);
      p[i] = t < -87.0f || e < min_p ? 0.0f : e;
      chunk += p[i];
    }
    buffer.chunk_sums[c] = chunk;
    total += chunk;
  }
  return total;
}

// Inverse CDF: the first token whose cumulative mass passes u * total (never one of zero mass).
int64_t draw(const RowBuffer& buffer, int64_t vocab, double total, float u) {
  const double target = static_cast<double>(u) * total;
  const int64_t chunks = static_cast<int64_t>(buffer.chunk_sums.size());
  double before = 0.0;
  int64_t chunk = -1, last_nonempty = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (buffer.chunk_sums[c] <= 0.0) continue;
    last_nonempty = c;
    if (before + buffer.chunk_sums[c] > target) {
      chunk = c;
      break;
    }
    before += buffer.chunk_sums[c];
  }
  if (chunk < 0) chunk = last_nonempty;  // rounding put the target past the last sum: its last token
  const float* p = buffer.probs.data();
  const int64_t begin = chunk * kChunk, end = std::min(begin + kChunk, vocab);
  int64_t token = -1;
  double cumulative = before;
  for (int64_t i = begin; i < end; ++i) {
    if (p[i] <= 0.0f) continue;
    token = i;
    cumulative += p[i];
    if (cumulative > target) break;
  }
  return token;
}

// The mass strictly above `pivot`; with `cut`, everything at or below it is zeroed and the chunk sums follow.
double mass_above(RowBuffer& buffer, float pivot, bool cut) {
  float* p = buffer.probs.data();
  const int64_t chunks = static_cast<int64_t>(buffer.chunk_sums.size());
  const vfloat zero = splat(0.0f);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    vfloat acc{};
    for (int64_t i = c * kChunk; i < (c + 1) * kChunk; i += kLanes) {
      const vfloat v = load(p + i);
      const vfloat kept = v > pivot ? v : zero;
      if (cut) store(p + i, kept);
      acc += kept;
    }
    const double chunk = kvscope_attention::sum(acc);
    if (cut) buffer.chunk_sums[c] = chunk;
    total += chunk;
  }
  return total;
}

// What rejection did not settle: the smallest value still in the nucleus, by sorting the row's survivors.
float nucleus_floor(const RowBuffer& buffer, double limit) {
  std::vector<float> values;
  for (float v : buffer.probs) {
    if (v > 0.0f) values.push_back(v);
  }
  std::sort(values.begin(), values.end(), std::greater<float>());
  double above = 0.0;  // the mass strictly above the current group of equal values
  size_t i = 0;
  float floor = values.empty() ? 0.0f : values[0];
  while (i < values.size() && above < limit) {
    floor = values[i];
    double group = 0.0;
    for (; i < values.size() && values[i] == floor; ++i) group += values[i];
    above += group;
  }
  return floor;
}

int64_t sample_row(const float* x, int64_t vocab, float scale, float top_p, float min_p, const float* uniforms,
                   int64_t rounds, RowBuffer& buffer) {
  bool nan = false;
  const float top = row_max(x, vocab, nan);
  if (nan || top == -std::numeric_limits<float>::infinity()) return -1;  // NaN, or nothing drawable
  const double base = exponentiate(x, vocab, top, scale, min_p, buffer);
  double total = base;
  const double limit = static_cast<double>(top_p) * base;
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t token = draw(buffer, vocab, total, uniforms[round]);
    if (top_p >= 1.0f) return token;
    const float pivot = buffer.probs[token];
    if (mass_above(buffer, pivot, false) < limit) return token;
    total = mass_above(buffer, pivot, true);
  }
  const float floor = nucleus_floor(buffer, limit);
  total = mass_above(buffer, std::nextafter(floor, 0.0f), true);
  return draw(buffer, vocab, total, uniforms[rounds]);
}

at::Tensor sample_nucleus(const at::Tensor& logits, const at::Tensor& scales, const at::Tensor& top_ps,
                          const at::Tensor& min_ps, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "kvscope_cpu: sample_nucleus takes float32 CPU logits [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == rows && uniforms.size(1) >= 2,
              "kvscope_cpu: uniforms must be [rows, rounds + 1]");
  const at::Tensor x = logits.contiguous();
  const at::Tensor s = scales.to(at::kFloat).contiguous(), p = top_ps.to(at::kFloat).contiguous();
  const at::Tensor m = min_ps.to(at::kFloat).contiguous(), u = uniforms.to(at::kFloat).contiguous();
  const int64_t rounds = u.size(1) - 1;
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float *xp = x.data_ptr<float>(), *sp = s.data_ptr<float>(), *pp = p.data_ptr<float>();
  const float *mp = m.data_ptr<float>(), *up = u.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    RowBuffer buffer{std::vector<float>(chunks * kChunk, 0.0f), std::vector<double>(chunks, 0.0)};
    for (int64_t r = begin; r < end; ++r) {
      out[r] = sample_row(xp + r * vocab, vocab, sp[r], pp[r], mp[r], up + r * (rounds + 1), rounds, buffer);
    }
  });
  return tokens;
}

// One row's first maximum in one read, or -1 where it holds NaN. Four chains of lanes each keep their best value
// and the index where it first stood (a strictly greater value replaces it), so no chain waits on another's
// compare; the answer is the smallest index among the lanes that hold the row's maximum.
int64_t row_first_argmax(const float* row, int64_t vocab) {
  constexpr int kChains = 4;
  const float lowest = -std::numeric_limits<float>::infinity();
  vint32 lane_index;
  for (int lane = 0; lane < kLanes; ++lane) lane_index[lane] = lane;
  vfloat best[kChains];
  vint32 at[kChains];
  vint32 nan{};
  for (int c = 0; c < kChains; ++c) {
    best[c] = splat(lowest);
    at[c] = vint32{} + std::numeric_limits<int32_t>::max();
  }
  int64_t i = 0;
  for (; i + kChains * kLanes <= vocab; i += kChains * kLanes) {
    for (int c = 0; c < kChains; ++c) {
      const vfloat v = load(row + i + c * kLanes);
      nan |= v != v;
      const vint32 greater = v > best[c];
      best[c] = greater ? v : best[c];
      at[c] = greater ? lane_index + static_cast<int32_t>(i + c * kLanes) : at[c];
    }
  }
  float top = lowest;
  int64_t found = std::numeric_limits<int64_t>::max();
  for (int c = 0; c < kChains; ++c) {
    for (int lane = 0; lane < kLanes; ++lane) {
      if (nan[lane]) return -1;
      const float v = best[c][lane];
      if (v > top || (v == top && at[c][lane] < found)) {
        top = v;
        found = at[c][lane];
      }
    }
  }
  for (; i < vocab; ++i) {   // the tail comes after every index above, so only a strictly greater value wins
    if (std::isnan(row[i])) return -1;
    if (row[i] > top) {
      top = row[i];
      found = i;
    }
  }
  return top == lowest ? 0 : found;   // a row of -inf only: its first maximum is token 0
}

// Greedy: each row's first maximum, -1 where it holds NaN.
at::Tensor first_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "kvscope_cpu: first_argmax takes float32 CPU logits [rows, vocab]");
  TORCH_CHECK(logits.size(1) < std::numeric_limits<int32_t>::max(), "kvscope_cpu: first_argmax's vocabulary "
              "fits int32");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const at::Tensor x = logits.contiguous();
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_first_argmax(xp + r * vocab, vocab);
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m) {
  m.def("sample_nucleus(Tensor logits, Tensor scales, Tensor top_ps, Tensor min_ps, Tensor uniforms) -> Tensor");
  m.def("first_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvscope_cpu, CPU, m) {
  m.impl("sample_nucleus", &sample_nucleus);
  m.impl("first_argmax", &first_argmax);
}
