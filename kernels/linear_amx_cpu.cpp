// The packed linear on AMX tiles: bf16 weights, many rows (prefill, batched decode), fp32 sums.
//
// Why: vdpbf16ps does 32 multiply-adds per instruction; one TDPBF16PS does 16 x 16 x 32. Measured here on a
// [256, 576] x [1536, 576]^T product, the vdpbf16ps path took 5.3 ms where oneDNN (on AMX) took 0.5 ms. oneDNN
// cannot serve instead: it rounds its outputs to bf16, and kvscope keeps every linear's output in fp32
// (engine/model/precision.py). This path keeps them: the tiles accumulate in fp32 and the sums are written as
// they are (or rounded once, when the caller asks for bf16).
//
// The weight needs no repacking: a packed bf16 panel [K/2][16][2] is AMX's VNNI layout for B, a B tile being 16
// consecutive k pairs of one panel, 1 KiB in one piece. The activations go as bf16 pairs (an fp32 one as two
// parts, see a_tiles) straight into A tiles laid out one after another ([row tiles][k steps][16 rows][16 pairs]), so every tile load reads 1 KiB
// in one piece too. The micro-kernel blocks 2 x 2: two A tiles (32 rows) against two B tiles (a work item's
// panel pair) into four fp32 C tiles, so each tile loaded feeds two products.
//
// Tails never change the tile shapes (one config, loaded per work item): the activations are zero-padded to
// whole tiles of rows and pairs, the last k step reads the weight's tail from a zero-padded copy (the pack's
// pairs need not be a multiple of 16, and reading past the last panel would leave the tensor), padded rows are
// computed and dropped, and padded columns are the pack's zero panels, dropped by store_block.
//
// Linux hands the tile registers only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM); where the build
// has no AMX, or the kernel says no, amx_available() is false and linear_cpu.cpp keeps its own paths.

#include "linear_cpu.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <initializer_list>
#include <memory>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVSCOPE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define KVSCOPE_AMX 0
#endif

namespace kvscope_linear {

#if KVSCOPE_AMX
namespace {

constexpr long kArchGetXcompPerm = 0x1022;
constexpr long kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
constexpr int64_t kTileRows = 16;    // rows of an A tile and of a C tile
constexpr int64_t kTilePairs = 16;   // k pairs per step: an A tile's row (64 bytes), a B tile's rows
constexpr int64_t kTileValues = kTileRows * kTilePairs;  // uint32 pairs in an A tile
constexpr int64_t kPanelStep = kTilePairs * 2 * kLanes;  // bf16 values of one B tile (1 KiB)
constexpr int64_t kPairsPerItem = 4;  // panel pairs of a work item

bool request_tile_data() {
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long granted = 0;
  return syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) == 0 && (granted >> kXfeatureXtiledata & 1);
}

// Palette 1, the layout LDTILECFG reads: tiles 0-3 are C, 4-5 A, 6-7 B; every one 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig() {
    for (int tile = 0; tile < 8; ++tile) colsb[tile] = 64, rows[tile] = 16;
  }
};

// x as A tiles of bf16 pairs: [ceil(m / 16)][steps][16 rows][16 pairs], zero-padded. An fp32 x is split in two,
// its bf16 rounding (hi) and the bf16 rounding of what that left out (lo), so that W hi + W lo carries about 16
// of the activations' 24 mantissa bits: near the exact path's fp32 product, not a bf16 linear's. Measured on
// SmolLM2's real chat prompts (tests/engine/model/test_truth.py), the rounded activations alone flipped a near
// tie of a first token that fp32 and the vdpbf16ps path both got right. A bf16 x is exact as it is: no lo.
struct ATiles {
  std::unique_ptr<uint32_t[]> hi, lo;   // lo null for a bf16 x
};

// Values [count, 32) of a k step's 32 (the last step's, past k) and whole padded rows are zeros: only those are
// written so, where zero-filling the whole buffer first cost a serial pass over it on every call.
inline void zero_tail(c10::BFloat16* dst, int64_t count) {
  std::memset(dst + count, 0, (2 * kTilePairs - count) * sizeof(c10::BFloat16));
}

inline __m512 widen_bf16(__m256i values) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(values), 16));
}

// x's 32 values at src as bf16 pairs at hi (their rounding) and lo (the rounding of what that left out). The
// scalar form (the last step's tail) computes the same, value by value.
inline void split_step(const float* src, int64_t count, c10::BFloat16* hi, c10::BFloat16* lo) {
  if (count == 2 * kTilePairs) {
    const __m512 x0 = _mm512_loadu_ps(src), x1 = _mm512_loadu_ps(src + kLanes);
    const __m512bh rounded_bh = _mm512_cvtne2ps_pbh(x1, x0);
    const __m512i rounded = reinterpret_cast<const __m512i&>(rounded_bh);
    // a bf16 value back to fp32 is its 16 bits moved up
    const __m512 h0 = widen_bf16(_mm512_castsi512_si256(rounded));
    const __m512 h1 = widen_bf16(_mm512_extracti64x4_epi64(rounded, 1));
    const __m512bh rest = _mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0));
    _mm512_storeu_si512(hi, rounded);
    _mm512_storeu_si512(lo, reinterpret_cast<const __m512i&>(rest));
    return;
  }
  float left[2 * kTilePairs];
  round_to_bf16(src, count, hi);
  for (int64_t i = 0; i < count; ++i) left[i] = src[i] - static_cast<float>(hi[i]);
  round_to_bf16(left, count, lo);
  zero_tail(hi, count);
  zero_tail(lo, count);
}

ATiles a_tiles(const at::Tensor& x, int64_t steps) {
  const int64_t m = x.size(0), k = x.size(1), padded = (m + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t size = padded * steps * kTilePairs;
  const bool split = x.scalar_type() == at::kFloat;
  ATiles tiles{std::unique_ptr<uint32_t[]>(new uint32_t[size]),
               split ? std::unique_ptr<uint32_t[]>(new uint32_t[size]) : nullptr};
  auto* hi = reinterpret_cast<c10::BFloat16*>(tiles.hi.get());
  auto* lo = reinterpret_cast<c10::BFloat16*>(tiles.lo.get());
  const float* x_fp32 = split ? x.data_ptr<float>() : nullptr;
  const c10::BFloat16* x_bf16 = split ? nullptr : x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, padded, kTileRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row_at = 2 * ((r / kTileRows * steps * kTileRows + r % kTileRows) * kTilePairs);
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t k0 = s * 2 * kTilePairs, count = r < m ? std::min<int64_t>(2 * kTilePairs, k - k0) : 0;
        const int64_t at = row_at + s * 2 * kTileValues;
        if (split) {
          split_step(x_fp32 + r * k + k0, count, hi + at, lo + at);
        } else {
          std::memcpy(hi + at, x_bf16 + r * k + k0, count * sizeof(c10::BFloat16));
          zero_tail(hi + at, count);
        }
      }
    }
  });
  return tiles;
}

// One k step of the 2 x 2 block: the A tile(s) at a (and a + steps tiles: the next 16 rows) times the B tiles
// of both panels, b0 and b1, already loaded in tiles 6 and 7.
template <bool TwoRowTiles>
inline void a_step(const uint32_t* a, int64_t steps) {
  _tile_loadd(4, a, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if constexpr (TwoRowTiles) {
    _tile_loadd(5, a + steps * kTileValues, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// One k step: the B tiles of both panels loaded once, then every part of x (hi, and lo where x is fp32) against
// them. Loading B once per step for both parts halves its traffic against a pass per part.
template <bool TwoRowTiles>
inline void step(const uint32_t* a, const uint32_t* a_lo, int64_t steps, const c10::BFloat16* b0,
                 const c10::BFloat16* b1) {
  _tile_loadd(6, b0, 64);
  _tile_loadd(7, b1, 64);
  a_step<TwoRowTiles>(a, steps);
  if (a_lo) a_step<TwoRowTiles>(a_lo, steps);
}

// Sums of 16 or 32 rows (from the row tile at a) by the panel pair (w0, w1) into sums [32][kBlockCols].
template <bool TwoRowTiles>
inline void row_block(const uint32_t* a, const uint32_t* a_lo, int64_t steps, const c10::BFloat16* w0,
                      const c10::BFloat16* w1, int64_t full_steps, const c10::BFloat16 (*tail)[kPanelStep],
                      float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TwoRowTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < full_steps; ++s) {
    step<TwoRowTiles>(a + s * kTileValues, a_lo ? a_lo + s * kTileValues : nullptr, steps, w0 + s * kPanelStep,
                      w1 + s * kPanelStep);
  }
  if (tail) {
    step<TwoRowTiles>(a + full_steps * kTileValues, a_lo ? a_lo + full_steps * kTileValues : nullptr, steps,
                      tail[0], tail[1]);
  }
  constexpr int64_t stride = kBlockCols * 4;
  _tile_stored(0, sums, stride);
  _tile_stored(1, sums + kLanes, stride);
  if constexpr (TwoRowTiles) {
    _tile_stored(2, sums + kTileRows * kBlockCols, stride);
    _tile_stored(3, sums + kTileRows * kBlockCols + kLanes, stride);
  }
}

}  // namespace

bool amx_available() {
  static const bool granted = request_tile_data();  // once per process; C++ makes the first call thread-safe
  return granted;
}

template <typename Out>
void amx_linear(const at::Tensor& x, const c10::BFloat16* packed, int64_t panels, int64_t pairs, int64_t n,
                const float* bias, Out* out) {
  TORCH_CHECK(amx_available(), "kvscope_cpu: AMX tiles are not available to this process");
  const int64_t m = x.size(0), chunks = (m + kRowChunk - 1) / kRowChunk;
  const int64_t pair_count = panels / 2, groups = (pair_count + kPairsPerItem - 1) / kPairsPerItem;
  const int64_t full_steps = pairs / kTilePairs, tail_pairs = pairs % kTilePairs;
  const int64_t steps = full_steps + (tail_pairs ? 1 : 0);
  const ATiles tiles = a_tiles(x, steps);
  const int64_t panel_values = pairs * 2 * kLanes;
  const TileConfig config;
  parallel_items(groups * chunks, [&](int64_t item) {
    const int64_t first_pair = item / chunks * kPairsPerItem;
    const int64_t pairs_here = std::min(kPairsPerItem, pair_count - first_pair);
    const int64_t first = item % chunks * kRowChunk, last = std::min(m, first + kRowChunk);
    alignas(64) c10::BFloat16 tail[kPairsPerItem][2][kPanelStep];
    if (tail_pairs) {
      std::memset(tail, 0, sizeof(tail));
      const int64_t bytes = tail_pairs * 2 * kLanes * sizeof(c10::BFloat16);
      for (int64_t q = 0; q < pairs_here; ++q) {
        for (int half = 0; half < 2; ++half) {
          std::memcpy(tail[q][half], packed + (2 * (first_pair + q) + half) * panel_values + full_steps * kPanelStep,
                      bytes);
        }
      }
    }
    alignas(64) float sums[2 * kTileRows * kBlockCols];
    _tile_loadconfig(&config);  // per thread: each OpenMP thread has its own tile state
    // Rows outside, panel pairs inside: 32 rows of A tiles stay in L1 while the item's panel pairs stream by.
    for (int64_t r0 = first; r0 < last; r0 += 2 * kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(2 * kTileRows, last - r0));
      const int64_t tile_at = r0 / kTileRows * steps * kTileValues;
      const uint32_t* a = tiles.hi.get() + tile_at;
      const uint32_t* a_lo = tiles.lo ? tiles.lo.get() + tile_at : nullptr;
      for (int64_t q = 0; q < pairs_here; ++q) {
        const int64_t p = 2 * (first_pair + q);
        const c10::BFloat16 *w0 = packed + p * panel_values, *w1 = w0 + panel_values;
        const c10::BFloat16 (*tail_q)[kPanelStep] = tail_pairs ? tail[q] : nullptr;
        if (rows > kTileRows) {
          row_block<true>(a, a_lo, steps, w0, w1, full_steps, tail_q, sums);
        } else {
          row_block<false>(a, a_lo, steps, w0, w1, full_steps, tail_q, sums);
        }
        store_block(sums, rows, r0, p, n, bias, out);
      }
    }
    _tile_release();
  });
}

#else  // no AMX in this build: linear_cpu.cpp never calls amx_linear

bool amx_available() { return false; }

template <typename Out>
void amx_linear(const at::Tensor&, const c10::BFloat16*, int64_t, int64_t, int64_t, const float*, Out*) {
  TORCH_CHECK(false, "kvscope_cpu: this build has no AMX");
}

#endif

template void amx_linear<float>(const at::Tensor&, const c10::BFloat16*, int64_t, int64_t, int64_t, const float*,
                                float*);
template void amx_linear<c10::BFloat16>(const at::Tensor&, const c10::BFloat16*, int64_t, int64_t, int64_t,
                                        const float*, c10::BFloat16*);

}  // namespace kvscope_linear
