// The paged-attention ops for CPUs: their checks (shapes, dtypes, every block id read in the pool) and their
// registration with torch. The kernels are paged_decode_cpu.cpp and paged_prefill_cpu.cpp; what they share,
// and the layout and variants they compute, is in paged_attention_cpu.h.

#include "paged_attention_cpu.h"

namespace {

using namespace kvscope_attention;

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
  run_decode(query, kv_layer, block_tables, context_lens, variant, static_cast<float>(scale), out);
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
  run_prefill(query, kv_layer, block_tables, cu_seqlens_q, context_lens, variant, static_cast<float>(scale), out);
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
