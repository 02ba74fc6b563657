// Batch-invariant float32 GEMM for decode-sized batches on CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias).
// See dflash_trt/runtime/cpu/panel_gemm.py for why and how it is built.
//
// Layout: W is reordered once into panels of 16 output columns, [ceil(N/16)][K][16], zero-padded.
// A tile keeps R rows x NB panels of accumulators in vector registers (<= 24 of the 32 AVX-512
// registers, <= 12 of the 16 AVX2 ones) and reads each panel once per tile; the rows of a batch
// are taken TILE_ROWS (8; 6 on AVX2) at a time over the same group of panels, so a group's panels
// stay in L1/L2 while every row uses them. The first row tile, which streams the group from memory,
// prefetches each of its panel streams PREFETCH_ROWS rows ahead (see there).
//
// Invariant: every output element is ONE sequential sum over k = 0..K-1 (fused multiply-adds in
// that order), whatever M, the tile shape or the thread split, so a row's result does not depend on
// the other rows of the batch, bit for bit. The bias is added after the sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

// The vector registers this build has: 16 floats (AVX-512), 8 (AVX2), 4 (SSE). A panel's 16
// columns take LANES of them. The accumulators are arrays of these native vectors: with a 16-float
// vector type on a build without AVX-512, GCC kept every accumulator in memory (no register holds
// 64 bytes) and loaded and stored it around each FMA, and the x86-64-v3 build ran 5-10x slower than
// the v4 one at 2-32 rows (issue 35). Every lane sums its k in the same order whatever the width,
// so the x86-64-v3 (AVX2 + FMA) and x86-64-v4 builds give the same bits (tests/test_panel_gemm.py
// checks it wherever both run; a build without FMA rounds twice and differs).
#if defined(__AVX512F__)
constexpr int WIDTH = 16;
#elif defined(__AVX__)
constexpr int WIDTH = 8;
#else
constexpr int WIDTH = 4;
#endif
constexpr int LANES = 16 / WIDTH;
typedef float vec __attribute__((vector_size(WIDTH * 4)));
typedef float vecu __attribute__((vector_size(WIDTH * 4), aligned(4)));

inline vec splat(float a) {  // one broadcast instruction (vec{} + a would add +0.0 first)
#if defined(__AVX512F__)
  return vec{a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a};
#elif defined(__AVX__)
  return vec{a, a, a, a, a, a, a, a};
#else
  return vec{a, a, a, a};
#endif
}

#if defined(__AVX512F__)
// 32 registers of 16 floats: a panel is one register.
// Rows per tile: a batch's rows are taken this many at a time over the same group of panels.
constexpr int64_t TILE_ROWS = 8;

// Panels per tile for R rows: wide for few rows (independent accumulators hide the FMA latency,
// and a single row is bound by reading the weight), narrow for many (registers run out: <= 24
// accumulators).
constexpr int panels_for(int64_t rows) {
  return rows == 1 ? 8 : rows == 2 ? 6 : rows <= 4 ? 6 : rows <= 6 ? 4 : 3;
}

// The same for the last M % 8 rows of a batch past 8, which run over the panel groups of the 8-row
// tiles (3 panels wide): a width that keeps those tiles whole and the group small. Widening the
// group to panels_for(M % 8) split the 8-row tiles into 3+3+1+1 at one leftover row, and a
// 9-row pass cost more than a 16-row one (210 decoder layers: 45.6 vs 44.4 ms; now 40.4).
constexpr int tail_panels_for(int64_t rows) { return rows <= 4 ? 6 : 3; }
#else
// 16 registers (AVX2: 8 floats each, a panel takes 2; SSE: 4 floats, a panel takes 4). The AVX-512
// tiles (up to 24 panel accumulators) would need 48 of them here: the compiler spilled them to the
// stack on every k, and a 16-row pass of the x86-64-v3 build cost 7x the v4 build's (issue 35).
// Here a tile keeps <= 12 registers of accumulators; the others hold the broadcast x and the panel.
#if defined(__AVX__)
constexpr int64_t REGS_PER_PANEL = 2;
#else
constexpr int64_t REGS_PER_PANEL = 4;
#endif
constexpr int64_t ACCUMULATORS = 12;
constexpr int64_t TILE_ROWS = ACCUMULATORS / REGS_PER_PANEL;  // 6 on AVX2, 3 on SSE: one panel wide
constexpr int panels_for(int64_t rows) {
  return ACCUMULATORS / (rows * REGS_PER_PANEL) > 1 ? ACCUMULATORS / (rows * REGS_PER_PANEL) : 1;
}
constexpr int tail_panels_for(int64_t rows) { return panels_for(TILE_ROWS); }
#endif

// Rows per tile for a batch of M rows: TILE_ROWS, except 4-5 rows on 16 registers (AVX2), which run
// as a NARROW-row tile NARROW_PANELS wide and a 1-2-row tile over the same panels. In one tile, 4
// rows would be one panel wide: 8 accumulators, too few chains to hide the FMA latency. The 211
// linears of the embedded target at 4 rows, x86-64-v3 build, one thread, the same packed weights:
// 46.1 against 50.0 ms (2-row tiles 47.5); at 6-16 rows 3-row tiles lose (16 rows: 95.0 against
// 80.8), so those keep TILE_ROWS.
constexpr int64_t NARROW = TILE_ROWS == 6 ? 3 : TILE_ROWS;  // 3 on AVX2; AVX-512 and SSE: none narrower
constexpr int NARROW_PANELS = panels_for(NARROW);          // 2 on AVX2
inline int64_t tile_rows_for(int64_t M) { return NARROW < TILE_ROWS && (M == 4 || M == 5) ? NARROW : TILE_ROWS; }

// How far ahead (rows of k, 64 bytes each) a tile prefetches each panel it streams. A tile reads NB
// panels as NB separate streams, 36 KB apart for K = 576. With more than one row the weight came
// in at ~13 GB/s against 15.4 at one (the FMAs between two loads, we think, let the hardware
// prefetcher fall behind). Software prefetches 3 KB ahead in every stream keep it at one row's
// pace: the embedded target's 211 linears cost 13-15% less at 2-4 rows, 6% at 8, 3% at 16, 1-4% at
// one (one thread, AVX-512 and AVX2 builds alike; 32 and 64 rows ahead read alike, 16 and 128 less
// well). The previous scheme, prefetching the next panel group from the first row tile, cost 2.5
// ms at 2 rows where it gained at 6-8. Reading past a panel's end prefetches the next panel's first
// rows, what the next tile reads; past the weight's end, nothing (a prefetch never faults).
constexpr int64_t PREFETCH_ROWS = 48;

// prefetch: this tile streams its panels from memory (the first row tile of a group)
template <int R, int NB>
inline void tile(const float* x, int64_t K, const float* panels, const float* bias, float* y, int64_t N,
                 int64_t b0, bool prefetch) {
  vec acc[R][NB * LANES];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB * LANES; ++j) acc[r][j] = splat(0.f);
  const float* w0 = panels + b0 * K * 16;
  for (int64_t k = 0; k < K; ++k) {
    vec w[NB * LANES];
    for (int b = 0; b < NB; ++b)
      for (int l = 0; l < LANES; ++l) w[b * LANES + l] = *(const vec*)(w0 + (b * K + k) * 16 + l * WIDTH);
    if (prefetch)  // one cache line per panel: the row PREFETCH_ROWS ahead in each stream, into L1
      for (int b = 0; b < NB; ++b) __builtin_prefetch(w0 + (b * K + k + PREFETCH_ROWS) * 16, 0, 3);
    for (int r = 0; r < R; ++r) {
      const vec xr = splat(x[r * K + k]);
      for (int j = 0; j < NB * LANES; ++j) acc[r][j] += w[j] * xr;  // one FMA (-ffp-contract=fast)
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = (b0 + b) * 16;
    const int64_t width = std::min<int64_t>(16, N - n);
    float bias16[16] = {0};
    if (bias != nullptr) std::memcpy(bias16, bias + n, width * sizeof(float));
    for (int r = 0; r < R; ++r) {
      float ragged[16];
      float* out = width == 16 ? y + r * N + n : ragged;  // the last panel of a ragged N: its first columns
      for (int l = 0; l < LANES; ++l)
        *(vecu*)(out + l * WIDTH) = acc[r][b * LANES + l] + *(const vecu*)(bias16 + l * WIDTH);
      if (width < 16) std::memcpy(y + r * N + n, ragged, width * sizeof(float));
    }
  }
}

// R rows over panels [b, b + count): tiles of NB panels, then single panels.
template <int R, int NB>
void rows_over(const float* x, int64_t K, const float* panels, const float* bias, float* y, int64_t N,
               int64_t b, int64_t count, bool prefetch) {
  int64_t i = 0;
  for (; i + NB <= count; i += NB) tile<R, NB>(x, K, panels, bias, y, N, b + i, prefetch);
  for (; i < count; ++i) tile<R, 1>(x, K, panels, bias, y, N, b + i, prefetch);
}

// What a tile of R rows follows: nothing (its own width, panels_for), TILE_ROWS-row tiles over the
// same groups (tail_panels_for), or NARROW-row tiles (NARROW_PANELS wide: see tile_rows_for)
enum Tail : int { NONE = 0, AFTER_FULL = 1, AFTER_NARROW = 2 };

template <int R>
void rows_over(Tail tail, const float* x, int64_t K, const float* panels, const float* bias, float* y, int64_t N,
               int64_t b, int64_t count, bool prefetch) {
  if (tail == AFTER_FULL)
    rows_over<R, tail_panels_for(R)>(x, K, panels, bias, y, N, b, count, prefetch);
  else if (tail == AFTER_NARROW)
    rows_over<R, NARROW_PANELS>(x, K, panels, bias, y, N, b, count, prefetch);
  else
    rows_over<R, panels_for(R)>(x, K, panels, bias, y, N, b, count, prefetch);
}

void rows_over(int64_t rows, Tail tail, const float* x, int64_t K, const float* panels, const float* bias, float* y,
               int64_t N, int64_t b, int64_t count, bool prefetch) {
  switch (rows) {
    case 8: rows_over<8, panels_for(8)>(x, K, panels, bias, y, N, b, count, prefetch); break;
    case 7: rows_over<7>(tail, x, K, panels, bias, y, N, b, count, prefetch); break;
    case 6: rows_over<6>(tail, x, K, panels, bias, y, N, b, count, prefetch); break;
    case 5: rows_over<5>(tail, x, K, panels, bias, y, N, b, count, prefetch); break;
    case 4: rows_over<4>(tail, x, K, panels, bias, y, N, b, count, prefetch); break;
    case 3: rows_over<3>(tail, x, K, panels, bias, y, N, b, count, prefetch); break;
    case 2: rows_over<2>(tail, x, K, panels, bias, y, N, b, count, prefetch); break;
    case 1: rows_over<1>(tail, x, K, panels, bias, y, N, b, count, prefetch); break;
    default: TORCH_CHECK(false, "panel_linear: 1..8 rows per chunk, got ", rows);
  }
}

// weight [N, K] float32 -> panels [ceil(N/16), K, 16]
at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "panel_pack: a 2-D float32 CPU weight, got ", weight.sizes(), " ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), nb = (N + 15) / 16;
  at::Tensor out = at::zeros({nb, K, 16}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < 16 && b * 16 + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * 16 + j] = src[(b * 16 + j) * K + k];
  });
  return out;
}

// x [M, K] float32, panels from panel_pack, n = N (the weight's rows), bias [N] or None -> y [M, N]
at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "panel_linear: x must be [M, K] float32");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 16 && panels.size(1) == x_in.size(1) &&
                  panels.size(0) == (n + 15) / 16 && panels.is_contiguous(),
              "panel_linear: panels ", panels.sizes(), " do not match x ", x_in.sizes(), " and n=", n);
  const at::Tensor x = x_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.numel() == n && bias.scalar_type() == at::kFloat, "panel_linear: bias must be [n] float32");
  }
  const int64_t M = x.size(0), K = x.size(1), nb = panels.size(0);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Panel groups are the unit of work (and of threads): a group is as wide as the widest tile
  // that runs over it, so its panels are read from memory once for all rows.
  const int64_t rows = tile_rows_for(M);
  const bool narrow = rows != TILE_ROWS;
  const int64_t tail = M % rows;
  const int64_t group = M < rows ? panels_for(M)
                        : narrow ? NARROW_PANELS
                                 : std::max<int64_t>(panels_for(rows), tail ? tail_panels_for(tail) : 0);
  const Tail after = narrow ? AFTER_NARROW : AFTER_FULL;
  const int64_t groups = (nb + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * group, count = std::min(group, nb - b);
      // the first row tile streams the group from memory; the later ones read it from cache
      int64_t m = 0;
      for (; m + rows <= M; m += rows)
        rows_over(rows, NONE, xp + m * K, K, wp, bp, yp + m * n, n, b, count, m == 0);
      if (m < M) rows_over(M - m, M > rows ? after : NONE, xp + m * K, K, wp, bp, yp + m * n, n, b, count, m == 0);
    }
  });
  return y;
}

}  // namespace

// Each ISA variant registers its ops under its own namespace (panel_gemm.py passes
// -DDFLASH_OPS_NAMESPACE=dflash_x86_64_v4, ...), so one process can load several variants and
// the tests run every variant this CPU can execute. The indirection expands the macro before
// TORCH_LIBRARY pastes and stringifies its argument.
#ifndef DFLASH_OPS_NAMESPACE
#define DFLASH_OPS_NAMESPACE dflash
#endif
#define DFLASH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define DFLASH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

DFLASH_LIBRARY(DFLASH_OPS_NAMESPACE, m) {
  m.def("panel_pack(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

DFLASH_LIBRARY_IMPL(DFLASH_OPS_NAMESPACE, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &panel_linear);
}
