// Paged attention for CPUs, reading keys and values straight out of the block pool.
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
// (in lanes of 16), so a row is a handful of registers. kvscope/kernels/cpu.py builds this file on first use.

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

namespace {

constexpr int kLanes = 16;
// aligned(4) and may_alias: a vfloat may be loaded from or stored to any float*.
typedef float vfloat __attribute__((vector_size(64), aligned(4), __may_alias__));
typedef float vfloat8 __attribute__((vector_size(32), aligned(4)));
typedef float vfloat4 __attribute__((vector_size(16), aligned(4)));
typedef uint16_t vuint16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vuint32 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vint32 __attribute__((vector_size(64), aligned(4)));

constexpr int kQueryTile = 16;  // prefill: query tokens per work item
constexpr int kRowBlock = 4;    // prefill: query rows whose scores are computed together (independent FMAs)

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

inline float max(vfloat v) {
  float top = v[0];
  for (int i = 1; i < kLanes; ++i) top = std::max(top, v[i]);
  return top;
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

Pool pool_of(const at::Tensor& kv_layer) {
  return {kv_layer.size(1), kv_layer.size(2), kv_layer.size(3), kv_layer.size(4)};
}

// Runs body(item) for item in [0, count) on torch's threads, handing items out one at a time.
template <typename Body>
void for_each_item(int64_t count, const Body& body) {
  const int64_t threads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
  for (int64_t item = 0; item < count; ++item) body(item);
}

// ---- decode: one query per sequence ----------------------------------------------------------------------------
//
// Decode reads far more bytes than it computes on, and the blocks of a context lie anywhere in the pool, so the
// kernel is written for memory: a work item is one sequence with all its kv heads (each block then read front to
// back) when there are enough sequences to share among the threads, else one (sequence, kv head); while a token
// is used, the same token of the next block is prefetched. Keys give every score first (kLanes positions at a
// time, reduced together), then an exact softmax, then values are summed with those weights: each key and value
// row is read once.

// lane i of the result = the sum of v[i]'s lanes: a tree of shuffles, four levels for kLanes vectors.
inline vfloat reduce_lanes(const vfloat* v) {
  vfloat halves[8], quarters[4], eighths[2];
  for (int k = 0; k < 8; ++k) {
    halves[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                        30, 31);
  }
  for (int k = 0; k < 4; ++k) {
    quarters[k] = __builtin_shufflevector(halves[2 * k], halves[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                          24, 25, 26, 27) +
                  __builtin_shufflevector(halves[2 * k], halves[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23,
                                          28, 29, 30, 31);
  }
  for (int k = 0; k < 2; ++k) {
    eighths[k] = __builtin_shufflevector(quarters[2 * k], quarters[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                         21, 24, 25, 28, 29) +
                 __builtin_shufflevector(quarters[2 * k], quarters[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                         23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(eighths[0], eighths[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(eighths[0], eighths[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline vint32 lane_index() {
  vint32 lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  return lane;
}

struct DecodeItem {
  const int32_t* table;
  int64_t context_len, head_begin, heads, group;
};

// In place over [rows, padded] scores of which the first len count: e^(score - row max) (0 past len); returns
// each row's sum in totals. A row's sink (sinks[r], when given) counts towards its max and its sum.
inline void softmax_rows(float* scores, int64_t rows, int64_t padded, int64_t len, const float* sinks,
                         float* totals) {
  const vint32 lane = lane_index();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * padded;
    vfloat top = splat(sinks ? sinks[r] : -std::numeric_limits<float>::max());
    for (int64_t i = 0; i < padded; i += kLanes) {
      const vfloat s = lane + static_cast<int32_t>(i) < static_cast<int32_t>(len) ? load(row + i) : top;
      top = s > top ? s : top;
    }
    const float row_top = max(top);
    vfloat total = {};
    for (int64_t i = 0; i < padded; i += kLanes) {
      const vfloat visible = exp_nonpositive(load(row + i) - row_top);
      const vfloat e = lane + static_cast<int32_t>(i) < static_cast<int32_t>(len) ? visible : vfloat{};
      store(row + i, e);
      total += e;
    }
    totals[r] = sum(total) + (sinks ? exp_nonpositive(sinks[r] - row_top) : 0.0f);
  }
}

template <int C, typename T>
void decode_item(const T* query, int64_t stride_head, const T* kv, const Pool& pool, const DecodeItem& item,
                 const Variant& variant, float scale, T* out) {
  constexpr int64_t dim = C * kLanes;
  const int64_t heads = item.heads, group = item.group, rows = heads * group;
  // Positions begin .. context_len - 1 are visible; from here on, i indexes them from 0 to len - 1.
  const int64_t begin = variant.first_visible(item.context_len - 1), len = item.context_len - begin;
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes, stride = pool.token_stride();
  float* scores = scratch(rows * padded + rows * dim + rows * kLanes * kLanes + rows);
  float* acc = scores + rows * padded;
  vfloat* partial = reinterpret_cast<vfloat*>(acc + rows * dim);  // [rows, kLanes]: a score before its lane sum
  float* totals = reinterpret_cast<float*>(partial + rows * kLanes);
  int64_t* offsets = scratch<int64_t>(len);  // element offset of each visible position's token row
  for (int64_t position = begin; position < item.context_len;) {
    const int64_t within = position % pool.block_size;
    const int64_t count = std::min(pool.block_size - within, item.context_len - position);
    const int64_t first = item.table[position / pool.block_size] * pool.block_size + within;
    for (int64_t t = 0; t < count; ++t) offsets[position - begin + t] = (first + t) * stride;
    position += count;
  }
  const int64_t row_bytes = heads * dim * static_cast<int64_t>(sizeof(T));
  auto prefetch_next_block = [&](const T* base, int64_t position) {
    if (position + pool.block_size >= len) return;
    const char* next = reinterpret_cast<const char*>(base + offsets[position + pool.block_size]);
    for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(next + byte);
  };
  std::vector<Row<C>> queries(rows);
  for (int64_t r = 0; r < rows; ++r) {
    queries[r] = Row<C>::load_from(query + (item.head_begin * group + r) * stride_head);
    for (int c = 0; c < C; ++c) queries[r].v[c] *= scale;
  }
  const T* keys = kv + item.head_begin * dim;
  for (int64_t first = 0; first < padded; first += kLanes) {
    for (int64_t t = 0; t < kLanes; ++t) {
      if (first + t >= len) {
        for (int64_t r = 0; r < rows; ++r) partial[r * kLanes + t] = vfloat{};
        continue;
      }
      prefetch_next_block(keys, first + t);
      const T* token = keys + offsets[first + t];
      for (int64_t h = 0; h < heads; ++h) {
        const Row<C> key = Row<C>::load_from(token + h * dim);
        for (int64_t g = 0; g < group; ++g) {
          const Row<C>& q = queries[h * group + g];
          vfloat products = q.v[0] * key.v[0];
          for (int c = 1; c < C; ++c) products += q.v[c] * key.v[c];
          partial[(h * group + g) * kLanes + t] = products;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) store(scores + r * padded + first, reduce_lanes(partial + r * kLanes));
  }
  if (variant.softcap != 0.0f) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < len; ++i) scores[r * padded + i] = soft_cap(scores[r * padded + i], variant.softcap);
    }
  }
  softmax_rows(scores, rows, padded, len, variant.sinks ? variant.sinks + item.head_begin * group : nullptr, totals);
  std::fill(acc, acc + rows * dim, 0.0f);
  const T* values = keys + pool.values_offset();
  for (int64_t position = 0; position < len; ++position) {
    prefetch_next_block(values, position);
    const T* token = values + offsets[position];
    for (int64_t h = 0; h < heads; ++h) {
      const Row<C> value = Row<C>::load_from(token + h * dim);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = h * group + g;
        const vfloat weight = splat(scores[r * padded + position]);
        float* a = acc + r * dim;
        for (int c = 0; c < C; ++c) store(a + c * kLanes, load(a + c * kLanes) + weight * value.v[c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_row<C>(acc + r * dim, 1.0f / totals[r], out + r * dim);
}

template <int C, typename T>
void decode(const at::Tensor& query, const at::Tensor& kv_layer, const at::Tensor& block_tables,
            const at::Tensor& context_lens, const Variant& variant, float scale, at::Tensor& out) {
  const Pool pool = pool_of(kv_layer);
  const int64_t num_seqs = query.size(0), num_q_heads = query.size(1);
  const int64_t group = num_q_heads / pool.num_kv_heads;
  const int64_t heads_per_item = num_seqs >= 4 * at::get_num_threads() ? pool.num_kv_heads : 1;
  const int64_t items_per_seq = pool.num_kv_heads / heads_per_item;
  const T* q = query.data_ptr<T>();
  const T* kv = kv_layer.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  const int64_t sq = query.stride(0), sh = query.stride(1), st = block_tables.stride(0);
  for_each_item(num_seqs * items_per_seq, [&](int64_t index) {
    const int64_t seq = index / items_per_seq, head = (index % items_per_seq) * heads_per_item;
    const DecodeItem item{tables + seq * st, lens[seq], head, heads_per_item, group};
    decode_item<C>(q + seq * sq, sh, kv, pool, item, variant, scale,
                   o + (seq * num_q_heads + head * group) * pool.head_dim);
  });
}

// ---- prefill: causal chunks over a cached prefix ---------------------------------------------------------------
//
// A work item is (sequence, kv head, tile of kQueryTile query tokens); its rows are those tokens times the query
// heads sharing the kv head. Keys are walked in tiles of kLanes positions (each position looks up its own block,
// so any block size works): a tile's keys are transposed into fp32 so that a row's kLanes scores are one vector,
// kRowBlock rows at a time; an online softmax folds the tiles in. No position past the item's last query is read.

struct PrefillItem {
  int64_t seq, head, first_token, num_tokens, first_position;
};

template <int C, typename T>
void load_key_tile(const T* kv, const Pool& pool, const int32_t* table, int64_t head, int64_t start, int64_t count,
                   float* keys_t, Row<C>* values) {
  constexpr int64_t dim = C * kLanes;
  const int64_t stride = pool.token_stride();
  for (int64_t t = 0; t < kLanes; ++t) {
    if (t >= count) {
      for (int64_t d = 0; d < dim; ++d) keys_t[d * kLanes + t] = 0.0f;
      values[t] = Row<C>{};
      continue;
    }
    const int64_t offset = pool.slot(table, start + t) * stride + head * dim;
    const Row<C> key = Row<C>::load_from(kv + offset);
    for (int c = 0; c < C; ++c) {
      for (int i = 0; i < kLanes; ++i) keys_t[(c * kLanes + i) * kLanes + t] = key.v[c][i];
    }
    values[t] = Row<C>::load_from(kv + pool.values_offset() + offset);
  }
}

// scores[r] = (queries[r] . key t for each t of the tile), for every (padded) row.
template <int C>
inline void tile_scores(const float* queries, int64_t padded_rows, const float* keys_t, vfloat* scores) {
  constexpr int64_t dim = C * kLanes;
  for (int64_t r0 = 0; r0 < padded_rows; r0 += kRowBlock) {
    vfloat acc[kRowBlock] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const vfloat k = load(keys_t + d * kLanes);
      for (int rr = 0; rr < kRowBlock; ++rr) acc[rr] += queries[(r0 + rr) * dim + d] * k;
    }
    for (int rr = 0; rr < kRowBlock; ++rr) scores[r0 + rr] = acc[rr];
  }
}

template <int C, typename T>
void prefill_item(const T* query, int64_t stride_token, int64_t stride_head, const T* kv, const Pool& pool,
                  const int32_t* table, const PrefillItem& item, int64_t group, const Variant& variant, float scale,
                  T* out, int64_t out_stride_token) {
  constexpr int64_t dim = C * kLanes;
  const int64_t rows = item.num_tokens * group;
  const int64_t padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  std::vector<float> queries(padded_rows * dim, 0.0f), acc(padded_rows * dim, 0.0f), totals(padded_rows, 0.0f);
  std::vector<float> top(padded_rows, -std::numeric_limits<float>::infinity()), keys_t(dim * kLanes);
  if (variant.sinks) {  // the online softmax starts from the sink: its e^(sink - top) is 1
    for (int64_t r = 0; r < rows; ++r) {
      top[r] = variant.sinks[item.head * group + r % group];
      totals[r] = 1.0f;
    }
  }
  std::vector<vfloat> scores(padded_rows);
  std::vector<Row<C>> values(kLanes);
  for (int64_t i = 0; i < item.num_tokens; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const Row<C> q = Row<C>::load_from(query + (item.first_token + i) * stride_token +
                                         (item.head * group + g) * stride_head);
      for (int c = 0; c < C; ++c) store(&queries[(i * group + g) * dim + c * kLanes], q.v[c] * scale);
    }
  }
  vint32 lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  const int64_t last_position = item.first_position + item.num_tokens - 1;
  for (int64_t start = variant.first_visible(item.first_position); start <= last_position; start += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, last_position + 1 - start);
    load_key_tile<C>(kv, pool, table, item.head, start, count, keys_t.data(), values.data());
    tile_scores<C>(queries.data(), padded_rows, keys_t.data(), scores.data());
    for (int64_t r = 0; r < rows; ++r) {
      // Lanes [from, to) of this tile are visible to row r: not past its position, not before its window.
      const int64_t position = item.first_position + r / group;
      const int64_t from = std::max<int64_t>(0, variant.first_visible(position) - start);
      const int64_t to = std::min(count, position - start + 1);
      if (to <= from) continue;
      const vint32 visible = (lane >= static_cast<int32_t>(from)) & (lane < static_cast<int32_t>(to));
      const vfloat capped = variant.softcap != 0.0f ? soft_cap(scores[r], variant.softcap) : scores[r];
      const vfloat masked = visible ? capped : splat(-3.0e38f);
      const float new_top = std::max(top[r], max(masked));
      const float rescale = exp_nonpositive(top[r] - new_top);
      top[r] = new_top;
      const vfloat weights = visible ? exp_nonpositive(masked - new_top) : vfloat{};
      totals[r] = totals[r] * rescale + sum(weights);
      Row<C> a = Row<C>::load_from(&acc[r * dim]);
      for (int c = 0; c < C; ++c) a.v[c] *= rescale;
      for (int64_t t = from; t < to; ++t) {
        for (int c = 0; c < C; ++c) a.v[c] += weights[t] * values[t].v[c];
      }
      for (int c = 0; c < C; ++c) store(&acc[r * dim + c * kLanes], a.v[c]);
    }
  }
  for (int64_t i = 0; i < item.num_tokens; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      store_row<C>(&acc[r * dim], 1.0f / totals[r],
                   out + (item.first_token + i) * out_stride_token + (item.head * group + g) * dim);
    }
  }
}

template <int C, typename T>
void prefill(const at::Tensor& query, const at::Tensor& kv_layer, const at::Tensor& block_tables,
             const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, const Variant& variant, float scale,
             at::Tensor& out) {
  const Pool pool = pool_of(kv_layer);
  const int64_t num_q_heads = query.size(1), group = num_q_heads / pool.num_kv_heads;
  const int32_t* starts = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  std::vector<PrefillItem> items;
  for (int64_t seq = 0; seq < context_lens.size(0); ++seq) {
    const int64_t first = starts[seq], query_len = starts[seq + 1] - first;
    for (int64_t tile = 0; tile < query_len; tile += kQueryTile) {
      const int64_t count = std::min<int64_t>(kQueryTile, query_len - tile);
      for (int64_t head = 0; head < pool.num_kv_heads; ++head) {
        items.push_back({seq, head, first + tile, count, lens[seq] - query_len + tile});
      }
    }
  }
  // The costliest items (furthest into their context) first, so that the dynamic schedule ends evenly.
  std::stable_sort(items.begin(), items.end(), [](const PrefillItem& a, const PrefillItem& b) {
    return a.first_position + a.num_tokens > b.first_position + b.num_tokens;
  });
  const T* q = query.data_ptr<T>();
  const T* kv = kv_layer.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  const int64_t sq = query.stride(0), sh = query.stride(1), st = block_tables.stride(0);
  for_each_item(static_cast<int64_t>(items.size()), [&](int64_t index) {
    const PrefillItem& item = items[index];
    prefill_item<C>(q, sq, sh, kv, pool, tables + item.seq * st, item, group, variant, scale, o,
                    num_q_heads * pool.head_dim);
  });
}

// ---- dispatch, checks and registration --------------------------------------------------------------------------

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

void check_common(const at::Tensor& query, const at::Tensor& kv_layer, const at::Tensor& block_tables) {
  TORCH_CHECK(query.device().is_cpu() && kv_layer.device().is_cpu(), "kvscope_cpu: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && kv_layer.dim() == 5 && kv_layer.size(0) == 2, "kvscope_cpu: bad shapes");
  TORCH_CHECK(query.scalar_type() == kv_layer.scalar_type(), "kvscope_cpu: query and cache dtypes differ");
  TORCH_CHECK(query.stride(2) == 1 && kv_layer.is_contiguous(), "kvscope_cpu: rows must be contiguous");
  TORCH_CHECK(query.size(2) == kv_layer.size(4) && query.size(1) % kv_layer.size(3) == 0,
              "kvscope_cpu: query heads must be a multiple of kv heads, with the same head_dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "kvscope_cpu: block tables must be int32 rows");
}

void check_int32(const at::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == at::kInt && tensor.is_contiguous(), "kvscope_cpu: ", name,
              " must be contiguous int32");
}

// Every block a sequence reads must be in the pool: a wrong id would read another process's memory, or crash,
// without a word. A sequence reads the entries from the block of the earliest position its first query sees
// (first_query[seq]; -1: no query, nothing read) to the block of its last token; entries before stay unread, and
// unchecked, as the engine may have freed those blocks. One pass over the ids read, before any attention: a few
// hundred integer compares next to the attention's millions of multiply-adds.
void check_block_ids(const at::Tensor& kv_layer, const at::Tensor& block_tables, const at::Tensor& context_lens,
                     const std::vector<int64_t>& first_query, const Variant& variant) {
  const Pool pool = pool_of(kv_layer);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t st = block_tables.stride(0), width = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) >= context_lens.size(0), "kvscope_cpu: fewer block tables than sequences");
  for (int64_t seq = 0; seq < context_lens.size(0); ++seq) {
    const int64_t used = (static_cast<int64_t>(lens[seq]) + pool.block_size - 1) / pool.block_size;
    TORCH_CHECK(lens[seq] >= 0 && used <= width, "kvscope_cpu: sequence ", seq, " has context_len ", lens[seq],
                " but its block table holds only ", width, " blocks of ", pool.block_size);
    if (first_query[seq] < 0) continue;
    for (int64_t i = variant.first_visible(first_query[seq]) / pool.block_size; i < used; ++i) {
      const int32_t block = tables[seq * st + i];
      TORCH_CHECK(block >= 0 && block < pool.num_blocks, "kvscope_cpu: sequence ", seq, " reads block id ", block,
                  " at table entry ", i, ", outside the pool of ", pool.num_blocks, " blocks");
    }
  }
}

Variant variant_of(const at::Tensor& query, int64_t sliding_window, double softcap,
                   const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0.0, "kvscope_cpu: sliding_window and softcap must be >= 0");
  if (sinks) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->numel() == query.size(1),
                "kvscope_cpu: sinks must be one contiguous float32 logit per query head");
  }
  return {sliding_window, static_cast<float>(softcap), sinks ? sinks->data_ptr<float>() : nullptr};
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_layer,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t sliding_window, double softcap, const std::optional<at::Tensor>& sinks) {
  check_common(query, kv_layer, block_tables);
  check_int32(context_lens, "context_lens");
  TORCH_CHECK(context_lens.size(0) == query.size(0), "kvscope_cpu: one context_len per query row");
  const Variant variant = variant_of(query, sliding_window, softcap, sinks);
  std::vector<int64_t> first_query(context_lens.size(0));
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t seq = 0; seq < context_lens.size(0); ++seq) first_query[seq] = lens[seq] - 1;
  check_block_ids(kv_layer, block_tables, context_lens, first_query, variant);
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (query.size(0) == 0) return out;
  dispatch(query, [&]<int C, typename T>() {
    decode<C, T>(query, kv_layer, block_tables, context_lens, variant, static_cast<float>(scale), out);
  });
  return out;
}

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_layer,
                                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& context_lens, double scale, int64_t sliding_window,
                                   double softcap, const std::optional<at::Tensor>& sinks) {
  check_common(query, kv_layer, block_tables);
  check_int32(cu_seqlens_q, "cu_seqlens_q");
  check_int32(context_lens, "context_lens");
  TORCH_CHECK(cu_seqlens_q.size(0) == context_lens.size(0) + 1, "kvscope_cpu: cu_seqlens_q needs one more entry "
              "than context_lens");
  const Variant variant = variant_of(query, sliding_window, softcap, sinks);
  std::vector<int64_t> first_query(context_lens.size(0));
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* starts = cu_seqlens_q.data_ptr<int32_t>();
  for (int64_t seq = 0; seq < context_lens.size(0); ++seq) {
    const int64_t query_len = starts[seq + 1] - starts[seq];
    first_query[seq] = query_len > 0 ? lens[seq] - query_len : -1;
  }
  check_block_ids(kv_layer, block_tables, context_lens, first_query, variant);
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (query.size(0) == 0) return out;
  dispatch(query, [&]<int C, typename T>() {
    prefill<C, T>(query, kv_layer, block_tables, cu_seqlens_q, context_lens, variant, static_cast<float>(scale),
                  out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvscope_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_layer, Tensor block_tables, Tensor context_lens, "
        "float scale, int sliding_window, float softcap, Tensor? sinks) -> Tensor");
  m.def("paged_prefill_attention(Tensor query, Tensor kv_layer, Tensor block_tables, Tensor cu_seqlens_q, "
        "Tensor context_lens, float scale, int sliding_window, float softcap, Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvscope_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
