// Paged decode attention for CPUs: one query per sequence, reading keys and values straight out of the pool.

#include "paged_attention_cpu.h"

namespace kvscope_attention {
namespace {

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

}  // namespace

void run_decode(const at::Tensor& query, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                const at::Tensor& context_lens, const Variant& variant, float scale, at::Tensor& out) {
  dispatch(query, [&]<int C, typename T>() {
    decode<C, T>(query, kv_layer, block_tables, context_lens, variant, scale, out);
  });
}

}  // namespace kvscope_attention
