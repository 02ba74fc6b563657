// Batch-invariant float32 GEMM for decode-sized batches on CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias).
// See dflash_trt/runtime/panel_gemm.py for why and how it is built.
//
// Layout: W is reordered once into panels of 16 output columns, [ceil(N/16)][K][16], zero-padded.
// A tile keeps R rows x NB panels of accumulators in vector registers (<= 24 of the 32 AVX-512
// registers) and reads each panel once per tile; the rows of a batch are taken 8 at a time over the
// same group of panels, so a group's panels stay in L1/L2 while every row uses them. While its first
// rows read a group, the tile prefetches the next group: the later row tiles of this group compute
// from cache while memory delivers the next one (1.1-1.25x at 4-64 rows; a single row is left to
// the hardware prefetcher, which keeps up with it).
//
// Invariant: every output element is ONE sequential sum over k = 0..K-1 (fused multiply-adds in
// that order), whatever M, the tile shape or the thread split, so a row's result does not depend on
// the other rows of the batch, bit for bit. The bias is added after the sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

// 16 floats: one AVX-512 register (two AVX2 registers, or four SSE ones, on other builds). The
// compiler splits the vector ops of the narrower builds into registers it has; every lane still
// sums its k in the same order, so the x86-64-v3 (AVX2 + FMA) and x86-64-v4 builds give the same
// bits (tests/test_panel_gemm.py checks it wherever both run; a build without FMA rounds twice).
typedef float v16 __attribute__((vector_size(64), aligned(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

inline v16 splat(float a) { return (v16){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }

// Panels per tile for R rows: wide for few rows (independent accumulators hide the FMA latency,
// and a single row is bound by reading the weight), narrow for many (registers run out).
constexpr int panels_for(int64_t rows) {
  return rows == 1 ? 8 : rows == 2 ? 6 : rows <= 4 ? 6 : rows <= 6 ? 4 : 3;
}

// The same for the last M % 8 rows of a batch past 8, which run over the panel groups of the 8-row
// tiles (3 panels wide): a width that keeps those tiles whole and the group small. Widening the
// group to panels_for(M % 8) split the 8-row tiles into 3+3+1+1 at one leftover row, and a
// 9-row pass cost more than a 16-row one (210 decoder layers: 45.6 vs 44.4 ms; now 40.4).
constexpr int tail_panels_for(int64_t rows) { return rows <= 4 ? 6 : 3; }

// ahead: offset (floats) from these panels to the ones to prefetch, 0 = none
template <int R, int NB>
inline void tile(const float* x, int64_t K, const float* panels, const float* bias, float* y, int64_t N,
                 int64_t b0, int64_t ahead) {
  v16 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = splat(0.f);
  const float* w0 = panels + b0 * K * 16;
  for (int64_t k = 0; k < K; ++k) {
    v16 w[NB];
    for (int b = 0; b < NB; ++b) w[b] = *(const v16*)(w0 + (b * K + k) * 16);
    if (ahead)  // one cache line per panel row read: the same lines of the next group, into L1
      for (int b = 0; b < NB; ++b) __builtin_prefetch(w0 + ahead + (b * K + k) * 16, 0, 3);
    for (int r = 0; r < R; ++r) {
      const v16 xr = splat(x[r * K + k]);
      for (int b = 0; b < NB; ++b) acc[r][b] += w[b] * xr;  // one FMA (-ffp-contract=fast)
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = (b0 + b) * 16;
    const int64_t width = std::min<int64_t>(16, N - n);
    float bias16[16] = {0};
    if (bias != nullptr) std::memcpy(bias16, bias + n, width * sizeof(float));
    const v16 bv = *(const v16u*)bias16;
    for (int r = 0; r < R; ++r) {
      const v16 out = acc[r][b] + bv;
      if (width == 16) {
        *(v16u*)(y + r * N + n) = out;
      } else {
        std::memcpy(y + r * N + n, &out, width * sizeof(float));
      }
    }
  }
}

// R rows over panels [b, b + count): tiles of NB panels, then single panels.
template <int R, int NB>
void rows_over(const float* x, int64_t K, const float* panels, const float* bias, float* y, int64_t N,
               int64_t b, int64_t count, int64_t ahead) {
  int64_t i = 0;
  for (; i + NB <= count; i += NB) tile<R, NB>(x, K, panels, bias, y, N, b + i, ahead);
  for (; i < count; ++i) tile<R, 1>(x, K, panels, bias, y, N, b + i, ahead);
}

// tail: these rows follow 8-row tiles over the same groups (tail_panels_for), else panels_for
template <int R>
void rows_over(bool tail, const float* x, int64_t K, const float* panels, const float* bias, float* y, int64_t N,
               int64_t b, int64_t count, int64_t ahead) {
  if (tail)
    rows_over<R, tail_panels_for(R)>(x, K, panels, bias, y, N, b, count, ahead);
  else
    rows_over<R, panels_for(R)>(x, K, panels, bias, y, N, b, count, ahead);
}

void rows_over(int64_t rows, bool tail, const float* x, int64_t K, const float* panels, const float* bias, float* y,
               int64_t N, int64_t b, int64_t count, int64_t ahead) {
  switch (rows) {
    case 8: rows_over<8, panels_for(8)>(x, K, panels, bias, y, N, b, count, ahead); break;
    case 7: rows_over<7>(tail, x, K, panels, bias, y, N, b, count, ahead); break;
    case 6: rows_over<6>(tail, x, K, panels, bias, y, N, b, count, ahead); break;
    case 5: rows_over<5>(tail, x, K, panels, bias, y, N, b, count, ahead); break;
    case 4: rows_over<4>(tail, x, K, panels, bias, y, N, b, count, ahead); break;
    case 3: rows_over<3>(tail, x, K, panels, bias, y, N, b, count, ahead); break;
    case 2: rows_over<2>(tail, x, K, panels, bias, y, N, b, count, ahead); break;
    case 1: rows_over<1>(tail, x, K, panels, bias, y, N, b, count, ahead); break;
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
  const int64_t tail = M % 8;
  const int64_t group = M < 8 ? panels_for(M) : std::max<int64_t>(panels_for(8), tail ? tail_panels_for(tail) : 0);
  const int64_t groups = (nb + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * group, count = std::min(group, nb - b);
      // the next group's panels sit right after this group's (prefetching past the last group's
      // end is harmless: a prefetch never faults)
      const int64_t ahead = M >= 2 ? group * K * 16 : 0;
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) rows_over(8, false, xp + m * K, K, wp, bp, yp + m * n, n, b, count, m == 0 ? ahead : 0);
      if (m < M) rows_over(M - m, M > 8, xp + m * K, K, wp, bp, yp + m * n, n, b, count, m == 0 ? ahead : 0);
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
