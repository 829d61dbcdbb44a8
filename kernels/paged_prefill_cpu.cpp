// Paged prefill attention for CPUs: causal chunks of queries over their cached prefix, read out of the pool.

#include "paged_attention_cpu.h"

#include <utility>

namespace kvscope_attention {
namespace {

constexpr int kQueryTile = 16;  // query tokens per work item
constexpr int kRowBlock = 8;    // query rows whose scores are computed together (independent FMAs)

// ---- prefill: causal chunks over a cached prefix ---------------------------------------------------------------
//
// A work item is (sequence, kv head, tile of kQueryTile query tokens); its rows are those tokens times the query
// heads sharing the kv head. Keys are walked in tiles of kLanes positions (each position looks up its own block,
// so any block size works): a tile's keys are transposed into fp32 (in registers, a 16x16 block at a time) so that
// a row's kLanes scores are one vector, kRowBlock rows at a time; an online softmax folds the tiles in, and the
// values are summed two rows at a time. No position past the item's last query is read. Against one row at a
// time with a scalar transpose, this took a 256-token prefill's attention from 0.65 to 0.48 ms a layer and a
// 1,024-token one's from 9.7 to 6.9 ms (SmolLM2's shape, 2 cores, `kvscope bench kernels --only attention`).

struct PrefillItem {
  int64_t seq, head, first_token, num_tokens, first_position;
};

// One step of a 16x16 transpose: rows i and i + B (B a power of two, i without bit B) swap the halves of their
// columns that differ in bit B. After the four steps B = 8, 4, 2, 1, row i holds what column i held.
template <int B, size_t... I>
inline void swap_bit(vfloat& low, vfloat& high, std::index_sequence<I...>) {
  const vfloat a = low, b = high;
  low = __builtin_shufflevector(a, b, ((I & B) ? kLanes + (I ^ B) : I)...);
  high = __builtin_shufflevector(a, b, ((I & B) ? kLanes + I : (I ^ B))...);
}

template <int B>
inline void transpose_step(vfloat* rows) {
  for (int i = 0; i < kLanes; ++i) {
    if (!(i & B)) swap_bit<B>(rows[i], rows[i + B], std::make_index_sequence<kLanes>{});
  }
}

inline void transpose(vfloat* rows) {
  transpose_step<8>(rows);
  transpose_step<4>(rows);
  transpose_step<2>(rows);
  transpose_step<1>(rows);
}

// The tile's keys transposed into fp32 (keys_t[d * kLanes + t]) and its values, zero past ``count`` keys.
template <int C, typename T>
void load_key_tile(const T* kv, const Pool& pool, const int32_t* table, int64_t head, int64_t start, int64_t count,
                   float* keys_t, Row<C>* values) {
  constexpr int64_t dim = C * kLanes;
  const int64_t stride = pool.token_stride();
  Row<C> keys[kLanes];
  for (int64_t t = 0; t < kLanes; ++t) {
    if (t >= count) {
      keys[t] = values[t] = Row<C>{};
      continue;
    }
    const int64_t offset = pool.slot(table, start + t) * stride + head * dim;
    keys[t] = Row<C>::load_from(kv + offset);
    values[t] = Row<C>::load_from(kv + pool.values_offset() + offset);
  }
  for (int c = 0; c < C; ++c) {
    vfloat block[kLanes];
    for (int t = 0; t < kLanes; ++t) block[t] = keys[t].v[c];
    transpose(block);
    for (int i = 0; i < kLanes; ++i) store(keys_t + (c * kLanes + i) * kLanes, block[i]);
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

// acc[r] = acc[r] * rescales[r] + sum over the tile's keys t of probs[r][t] * values[t], two rows at a time: the two
// rows share each value load and give eight independent sums instead of four chains of kLanes dependent FMAs.
// A key a row may not see has probability 0 there.
template <int C>
inline void accumulate_values(const float* probs, const float* rescales, int64_t rows, int64_t count,
                              const Row<C>* values, float* acc) {
  constexpr int64_t dim = C * kLanes;
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    Row<C> a = Row<C>::load_from(acc + r * dim), b = Row<C>::load_from(acc + (r + 1) * dim);
    for (int c = 0; c < C; ++c) {
      a.v[c] *= rescales[r];
      b.v[c] *= rescales[r + 1];
    }
    const float* pa = probs + r * kLanes;
    const float* pb = pa + kLanes;
    for (int64_t t = 0; t < count; ++t) {
      for (int c = 0; c < C; ++c) {
        a.v[c] += pa[t] * values[t].v[c];
        b.v[c] += pb[t] * values[t].v[c];
      }
    }
    for (int c = 0; c < C; ++c) {
      store(acc + r * dim + c * kLanes, a.v[c]);
      store(acc + (r + 1) * dim + c * kLanes, b.v[c]);
    }
  }
  for (; r < rows; ++r) {
    Row<C> a = Row<C>::load_from(acc + r * dim);
    for (int c = 0; c < C; ++c) a.v[c] *= rescales[r];
    for (int64_t t = 0; t < count; ++t) {
      for (int c = 0; c < C; ++c) a.v[c] += probs[r * kLanes + t] * values[t].v[c];
    }
    for (int c = 0; c < C; ++c) store(acc + r * dim + c * kLanes, a.v[c]);
  }
}

// kVariant: compiled with the window, soft-cap and sink arithmetic; without it, a plain causal layer's rows pay
// none of it (about 15% of prefill's time when they did).
template <int C, bool kVariant, typename T>
void prefill_item(const T* query, int64_t stride_token, int64_t stride_head, const T* kv, const Pool& pool,
                  const int32_t* table, const PrefillItem& item, int64_t group, const Variant& variant, float scale,
                  T* out, int64_t out_stride_token) {
  constexpr int64_t dim = C * kLanes;
  const int64_t rows = item.num_tokens * group;
  const int64_t padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  std::vector<float> queries(padded_rows * dim, 0.0f), acc(padded_rows * dim, 0.0f), totals(padded_rows, 0.0f);
  std::vector<float> top(padded_rows, -std::numeric_limits<float>::infinity()), keys_t(dim * kLanes);
  if (kVariant && variant.sinks) {  // the online softmax starts from the sink: its e^(sink - top) is 1
    for (int64_t r = 0; r < rows; ++r) {
      top[r] = variant.sinks[item.head * group + r % group];
      totals[r] = 1.0f;
    }
  }
  std::vector<vfloat> scores(padded_rows);
  std::vector<float> probs(padded_rows * kLanes), rescales(padded_rows);
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
  const int64_t first_key = kVariant ? variant.first_visible(item.first_position) : 0;
  for (int64_t start = first_key; start <= last_position; start += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, last_position + 1 - start);
    load_key_tile<C>(kv, pool, table, item.head, start, count, keys_t.data(), values.data());
    tile_scores<C>(queries.data(), padded_rows, keys_t.data(), scores.data());
    for (int64_t r = 0; r < rows; ++r) {
      // Lanes [from, to) of this tile are visible to row r: not past its position, not before its window.
      const int64_t position = item.first_position + r / group;
      const int64_t from = kVariant ? std::max<int64_t>(0, variant.first_visible(position) - start) : 0;
      const int64_t to = std::min(count, position - start + 1);
      if (to <= from) {
        rescales[r] = 1.0f;
        store(&probs[r * kLanes], vfloat{});
        continue;
      }
      vint32 visible = lane < static_cast<int32_t>(to);
      vfloat score = scores[r];
      if constexpr (kVariant) {
        visible &= lane >= static_cast<int32_t>(from);
        if (variant.softcap != 0.0f) score = soft_cap(score, variant.softcap);
      }
      const vfloat masked = visible ? score : splat(-3.0e38f);
      const float new_top = std::max(top[r], max(masked));
      rescales[r] = exp_nonpositive(top[r] - new_top);
      top[r] = new_top;
      const vfloat weights = visible ? exp_nonpositive(masked - new_top) : vfloat{};
      totals[r] = totals[r] * rescales[r] + sum(weights);
      store(&probs[r * kLanes], weights);
    }
    accumulate_values<C>(probs.data(), rescales.data(), rows, count, values.data(), acc.data());
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
  const bool plain = variant.is_plain();
  for_each_item(static_cast<int64_t>(items.size()), [&](int64_t index) {
    const PrefillItem& item = items[index];
    if (plain) {
      prefill_item<C, false>(q, sq, sh, kv, pool, tables + item.seq * st, item, group, variant, scale, o,
                             num_q_heads * pool.head_dim);
    } else {
      prefill_item<C, true>(q, sq, sh, kv, pool, tables + item.seq * st, item, group, variant, scale, o,
                            num_q_heads * pool.head_dim);
    }
  });
}

}  // namespace

void run_prefill(const at::Tensor& query, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                 const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, const Variant& variant, float scale,
                 at::Tensor& out) {
  dispatch(query, [&]<int C, typename T>() {
    prefill<C, T>(query, kv_layer, block_tables, cu_seqlens_q, context_lens, variant, scale, out);
  });
}

}  // namespace kvscope_attention
