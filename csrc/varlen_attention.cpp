// Attention over packed variable-length trajectories on the CPU (the "native" backend).
//
// One task is a sequence and a KV head with all the query heads of its group, so that the
// backward's dk and dv are written by one thread without atomics (the backward is deterministic).
// A task copies its rows into float32 buffers (any input dtype; the head dim padded to a whole
// number of 8-float vectors, K and V also transposed to [D, L]), computes there, and writes its
// results back. Per query row: the scores against all its keys as 8-wide vectors over keys (no
// horizontal sums), the softmax with a vectorised exp, then the weighted sum of V rows in
// registers. Above head dim 16, query rows go two at a time, each key, value and dk/dv row
// read once for both (1.55x forward + backward at 2048-token sequences, D 64), with every
// row's arithmetic in the same order as alone: the same bits. Tasks are dealt to threads by
// cost (longest first, to the least loaded).
//
// Prefix-shared (tree) mode: a suffix segment's queries attend to all keys of its prefix segment
// and causally to their own: its task's key buffers hold the prefix's keys and then its own, and
// query row i sees the first key_offset + i + 1 of them (key_offset = the prefix's length; 0 in
// the plain op, whose kernels these are). The backward runs a prefix and all its suffixes as one
// task per KV head (the prefix's queries, then each suffix's in order), so a prefix's dk and dv
// sum over every query that sees them in a fixed order, still without atomics.
//
// The row loops are compiled twice on x86-64 (AVX2 + FMA, and the baseline) and picked once by
// what the CPU supports; GCC vector extensions keep the code portable.
#include "varlen_attention.h"

#include "cpu_vector.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace agentrl_fast {
namespace {

using namespace cpu_vector;

constexpr int kMaxHeadDim = 256;
AGENTRL_FAST_INLINE float horizontal_sum(vf x) {
  float s = 0.f;
  for (int64_t l = 0; l < kWidth; ++l) s += x[l];
  return s;
}
AGENTRL_FAST_INLINE float horizontal_max(vf x) {
  float m = x[0];
  for (int64_t l = 1; l < kWidth; ++l) m = x[l] > m ? x[l] : m;
  return m;
}

// Lanes j >= n of the vector of keys b * kWidth .. set to `fill` (lane counts in 64 bits: no
// overflow whatever the length).
AGENTRL_FAST_INLINE vf mask_tail(vf x, int64_t b, int64_t n, float fill) {
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const int32_t valid = static_cast<int32_t>(std::clamp<int64_t>(n - b * kWidth, 0, kWidth));
  return lane < valid ? x : splat(fill);
}

// s[b] = scale * sum_x a[x] * bt[x][b * kWidth ..] for the vectors of keys b < nb; four vectors
// at a time, so that four independent multiply-add chains hide the instruction latency.
AGENTRL_FAST_INLINE void row_scores(const float* a, const float* bt, int64_t stride, int d,
                                    int64_t nb, float scale, float* s) {
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    vf s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (int x = 0; x < d; ++x) {
      const vf ax = splat(a[x]);
      const float* r = bt + x * stride + b * kWidth;
      s0 += ax * load(r);
      s1 += ax * load(r + kWidth);
      s2 += ax * load(r + 2 * kWidth);
      s3 += ax * load(r + 3 * kWidth);
    }
    store(s + b * kWidth, s0 * scale);
    store(s + (b + 1) * kWidth, s1 * scale);
    store(s + (b + 2) * kWidth, s2 * scale);
    store(s + (b + 3) * kWidth, s3 * scale);
  }
  for (; b < nb; ++b) {
    vf acc = {};
    for (int x = 0; x < d; ++x) acc += splat(a[x]) * load(bt + x * stride + b * kWidth);
    store(s + b * kWidth, acc * scale);
  }
}

// row_scores of two rows against the same keys, each vector of keys loaded once for both: s0's
// first nb0 vectors and s1's first nb1 (nb0 <= nb1). Each score is the same chain over x as
// row_scores makes, so the bits are row_scores' whatever the pairing.
AGENTRL_FAST_INLINE void row_scores2(const float* a0, const float* a1, const float* bt,
                                     int64_t stride, int d, int64_t nb0, int64_t nb1,
                                     float scale, float* s0, float* s1) {
  int64_t b = 0;
  for (; b + 4 <= nb0; b += 4) {
    vf r0[4] = {}, r1[4] = {};
    for (int x = 0; x < d; ++x) {
      const vf x0 = splat(a0[x]), x1 = splat(a1[x]);
      const float* r = bt + x * stride + b * kWidth;
      for (int u = 0; u < 4; ++u) {
        const vf key = load(r + u * kWidth);
        r0[u] += x0 * key;
        r1[u] += x1 * key;
      }
    }
    for (int u = 0; u < 4; ++u) {
      store(s0 + (b + u) * kWidth, r0[u] * scale);
      store(s1 + (b + u) * kWidth, r1[u] * scale);
    }
  }
  row_scores(a0, bt + b * kWidth, stride, d, nb0 - b, scale, s0 + b * kWidth);
  row_scores(a1, bt + b * kWidth, stride, d, nb1 - b, scale, s1 + b * kWidth);
}

// acc[c] = sum_{j < n} w[j] * rows[j][c * kWidth ..], c < NV; U interleaved partial sums (more
// for short rows) so that the multiply-add chains overlap.
template <int NV>
AGENTRL_FAST_INLINE void weighted_rows(const float* w, const float* rows, int64_t n, vf* acc) {
  constexpr int64_t Dp = NV * kWidth;
  constexpr int U = NV >= 8 ? 1 : (NV >= 4 ? 2 : 4);
  vf part[U][NV] = {};
  int64_t j = 0;
  for (; j + U <= n; j += U) {
    for (int u = 0; u < U; ++u) {
      const vf wj = splat(w[j + u]);
      const float* r = rows + (j + u) * Dp;
      for (int c = 0; c < NV; ++c) part[u][c] += wj * load(r + c * kWidth);
    }
  }
  for (; j < n; ++j) {
    const vf wj = splat(w[j]);
    for (int c = 0; c < NV; ++c) part[0][c] += wj * load(rows + j * Dp + c * kWidth);
  }
  for (int c = 0; c < NV; ++c) {
    acc[c] = part[0][c];
    for (int u = 1; u < U; ++u) acc[c] += part[u][c];
  }
}

// weighted_rows of two rows of weights over the same rows (n0 <= n1), each row of `rows` loaded
// once for both while both take it: C vectors of the head dim at a time (8 partial sums in
// registers), and for each row the same partial sums over the same j as weighted_rows, so the
// same bits.
template <int NV>
AGENTRL_FAST_INLINE void weighted_rows2(const float* w0, const float* w1, const float* rows,
                                        int64_t n0, int64_t n1, vf* acc0, vf* acc1) {
  constexpr int64_t Dp = NV * kWidth;
  constexpr int U = NV >= 8 ? 1 : (NV >= 4 ? 2 : 4);
  constexpr int C = NV < 4 / U ? NV : 4 / U;  // U * C = 4 partial sums a row
  for (int c0 = 0; c0 < NV; c0 += C) {
    vf p0[U][C] = {}, p1[U][C] = {};
    int64_t j = 0;
    for (; j + U <= n0; j += U) {
      for (int u = 0; u < U; ++u) {
        const vf a = splat(w0[j + u]), b = splat(w1[j + u]);
        const float* r = rows + (j + u) * Dp + c0 * kWidth;
        for (int c = 0; c < C; ++c) {
          const vf x = load(r + c * kWidth);
          p0[u][c] += a * x;
          p1[u][c] += b * x;
        }
      }
    }
    for (int64_t t = j; t < n0; ++t) {  // row 0's tail
      const vf a = splat(w0[t]);
      for (int c = 0; c < C; ++c) p0[0][c] += a * load(rows + t * Dp + (c0 + c) * kWidth);
    }
    for (; j + U <= n1; j += U) {  // row 1 goes on alone
      for (int u = 0; u < U; ++u) {
        const vf b = splat(w1[j + u]);
        for (int c = 0; c < C; ++c) p1[u][c] += b * load(rows + (j + u) * Dp + (c0 + c) * kWidth);
      }
    }
    for (; j < n1; ++j) {
      const vf b = splat(w1[j]);
      for (int c = 0; c < C; ++c) p1[0][c] += b * load(rows + j * Dp + (c0 + c) * kWidth);
    }
    for (int c = 0; c < C; ++c) {
      acc0[c0 + c] = p0[0][c];
      acc1[c0 + c] = p1[0][c];
      for (int u = 1; u < U; ++u) {
        acc0[c0 + c] += p0[u][c];
        acc1[c0 + c] += p1[u][c];
      }
    }
  }
}

// The buffers of one task: L query rows, its G = Hq / Hk query heads, head dim D padded to
// Dp = NV * kWidth, K keys (key_offset + L: a suffix's prefix, then its own rows) padded to Lp
// (a multiple of kWidth). Causal: query row i sees keys j < key_offset + i + 1.
struct TaskShape {
  int64_t groups, length, padded_length;
  int head_dim;
  bool causal;
  float scale;
  int64_t key_offset = 0;
};

struct ForwardBuffers {
  const float* q;   // [G, L, Dp]
  const float* kt;  // [D, Lp] (keys >= K zero)
  const float* v;   // [K, Dp]
  float* out;       // [G, L, Dp]
  float* lse;       // [G, L]
  float* row;       // [2, Lp] scratch (two query rows at a time)
};

// Query rows per step of the row loops: 2 above head dim 16 (NV >= 4), unless
// AGENTRL_FAST_NATIVE_ROWS_ALONE=1 (read once; how the tests compare the pairs' bits with one
// row at a time).
template <int NV>
AGENTRL_FAST_INLINE int64_t row_step() {
  static const bool alone = [] {
    const char* value = std::getenv("AGENTRL_FAST_NATIVE_ROWS_ALONE");
    return value != nullptr && std::string(value) == "1";
  }();
  return NV >= 4 && !alone ? 2 : 1;
}

// The keys query row i sees: causal, its prefix's and its own up to itself; else all L.
AGENTRL_FAST_INLINE int64_t keys_seen(const TaskShape& t, int64_t i) {
  return t.causal ? t.key_offset + i + 1 : t.length;
}

// The softmax of one row of scores (its first n, in nb vectors) in place: (max, sum of exps).
AGENTRL_FAST_INLINE std::pair<float, float> softmax_row(float* row, int64_t n, int64_t nb) {
  const float inf = std::numeric_limits<float>::infinity();
  vf top = splat(-inf);
  for (int64_t b = 0; b < nb; ++b) {
    const vf s = mask_tail(load(row + b * kWidth), b, n, -inf);
    top = s > top ? s : top;
  }
  const float row_max = horizontal_max(top);
  vf sums = {};
  for (int64_t b = 0; b < nb; ++b) {
    const vf p = mask_tail(vector_exp(load(row + b * kWidth) - row_max), b, n, 0.f);
    store(row + b * kWidth, p);
    sums += p;
  }
  return {row_max, horizontal_sum(sums)};
}

// Query rows two at a time above head dim 16 (each key and value row loaded once for both;
// the last row of an odd count alone): the same arithmetic per row as one at a time. At head
// dim 16 pairs ran 6 % slower (a row of V is two vectors: the pair's passes over it cost more
// than they share), so rows go one at a time there.
template <int NV>
AGENTRL_FAST_INLINE void forward_rows(const TaskShape& t, const ForwardBuffers& m) {
  constexpr int64_t Dp = NV * kWidth;
  const int64_t step = row_step<NV>();
  float* const rows[2] = {m.row, m.row + t.padded_length};
  for (int64_t g = 0; g < t.groups; ++g) {
    for (int64_t i = 0; i < t.length; i += step) {
      const int pair = step == 2 && i + 1 < t.length ? 2 : 1;
      int64_t n[2], nb[2];
      for (int r = 0; r < pair; ++r) {
        n[r] = keys_seen(t, i + r);
        nb[r] = (n[r] + kWidth - 1) / kWidth;
      }
      const float* qi = m.q + (g * t.length + i) * Dp;
      vf acc[2][NV];
      std::pair<float, float> stats[2];
      if (pair == 2) {
        row_scores2(qi, qi + Dp, m.kt, t.padded_length, t.head_dim, nb[0], nb[1], t.scale,
                    rows[0], rows[1]);
        stats[0] = softmax_row(rows[0], n[0], nb[0]);
        stats[1] = softmax_row(rows[1], n[1], nb[1]);
        weighted_rows2<NV>(rows[0], rows[1], m.v, n[0], n[1], acc[0], acc[1]);
      } else {
        row_scores(qi, m.kt, t.padded_length, t.head_dim, nb[0], t.scale, rows[0]);
        stats[0] = softmax_row(rows[0], n[0], nb[0]);
        weighted_rows<NV>(rows[0], m.v, n[0], acc[0]);
      }
      for (int r = 0; r < pair; ++r) {
        float* oi = m.out + (g * t.length + i + r) * Dp;
        const float inverse = 1.f / stats[r].second;
        for (int c = 0; c < NV; ++c) store(oi + c * kWidth, acc[r][c] * inverse);
        m.lse[g * t.length + i + r] = stats[r].first + std::log(stats[r].second);
      }
    }
  }
}

struct BackwardBuffers {
  const float* q;     // [G, L, Dp]
  const float* dout;  // [G, L, Dp]
  const float* out;   // [G, L, Dp]
  const float* lse;   // [G, L]
  const float* kt;    // [D, Lp]
  const float* vt;    // [D, Lp]
  const float* k;     // [K, Dp]
  float* dq;          // [G, L, Dp]
  float* dk;          // [K, Dp], accumulated over the group (zeroed by the caller)
  float* dv;          // [K, Dp], likewise
  float* p;           // [2, Lp] scratch (two query rows at a time)
  float* ds;          // [2, Lp] scratch
};

// One query row's backward inputs: its q, dout and (dout . out) row, its lse and key count.
struct BackwardRow {
  const float *q, *dout;
  float delta, lse;
  int64_t n, nb;
};

template <int NV>
AGENTRL_FAST_INLINE BackwardRow backward_row(const TaskShape& t, const BackwardBuffers& m,
                                             int64_t g, int64_t i) {
  constexpr int64_t Dp = NV * kWidth;
  const int64_t row = g * t.length + i;
  const float *qi = m.q + row * Dp, *doi = m.dout + row * Dp, *oi = m.out + row * Dp;
  vf dot = {};
  for (int c = 0; c < NV; ++c) dot += load(doi + c * kWidth) * load(oi + c * kWidth);
  const int64_t n = keys_seen(t, i);
  // delta = sum_j p_j dp_j = dout . out
  return {qi, doi, horizontal_sum(dot), m.lse[row], n, (n + kWidth - 1) / kWidth};
}

// p = exp(s - lse) and ds = p * (dp - delta) * scale of one row, in place of s and dp.
AGENTRL_FAST_INLINE void row_probabilities(const BackwardRow& r, float scale, float* p,
                                           float* ds) {
  for (int64_t b = 0; b < r.nb; ++b) {
    const vf pb = mask_tail(vector_exp(load(p + b * kWidth) - r.lse), b, r.n, 0.f);
    store(p + b * kWidth, pb);
    store(ds + b * kWidth, pb * (load(ds + b * kWidth) - r.delta) * scale);
  }
}

// dk[j] += ds[j] q and dv[j] += p[j] dout for j < n of one row.
template <int NV>
AGENTRL_FAST_INLINE void accumulate_keys(const BackwardRow& r, const float* p, const float* ds,
                                         const BackwardBuffers& m, int64_t from) {
  constexpr int64_t Dp = NV * kWidth;
  vf q_row[NV], do_row[NV];
  for (int c = 0; c < NV; ++c) {
    q_row[c] = load(r.q + c * kWidth);
    do_row[c] = load(r.dout + c * kWidth);
  }
  for (int64_t j = from; j < r.n; ++j) {
    const vf dsj = splat(ds[j]), pj = splat(p[j]);
    float* dkj = m.dk + j * Dp;
    float* dvj = m.dv + j * Dp;
    for (int c = 0; c < NV; ++c) {
      store(dkj + c * kWidth, load(dkj + c * kWidth) + dsj * q_row[c]);
      store(dvj + c * kWidth, load(dvj + c * kWidth) + pj * do_row[c]);
    }
  }
}

// Query rows two at a time above head dim 16, as forward_rows: each key row's dk and dv read
// and written once for both (row 0's term added first, then row 1's: the same sums in the same
// order as one row at a time), K, V and the scores' keys loaded once for both.
template <int NV>
AGENTRL_FAST_INLINE void backward_rows(const TaskShape& t, const BackwardBuffers& m) {
  constexpr int64_t Dp = NV * kWidth;
  const int64_t step = row_step<NV>();
  float* const p[2] = {m.p, m.p + t.padded_length};
  float* const ds[2] = {m.ds, m.ds + t.padded_length};
  for (int64_t g = 0; g < t.groups; ++g) {
    for (int64_t i = 0; i < t.length; i += step) {
      const int pair = step == 2 && i + 1 < t.length ? 2 : 1;
      BackwardRow r[2];
      for (int k = 0; k < pair; ++k) r[k] = backward_row<NV>(t, m, g, i + k);
      vf dq_row[2][NV];
      if (pair == 2) {
        row_scores2(r[0].q, r[1].q, m.kt, t.padded_length, t.head_dim, r[0].nb, r[1].nb,
                    t.scale, p[0], p[1]);
        row_scores2(r[0].dout, r[1].dout, m.vt, t.padded_length, t.head_dim, r[0].nb, r[1].nb,
                    1.f, ds[0], ds[1]);
        row_probabilities(r[0], t.scale, p[0], ds[0]);
        row_probabilities(r[1], t.scale, p[1], ds[1]);
        weighted_rows2<NV>(ds[0], ds[1], m.k, r[0].n, r[1].n, dq_row[0], dq_row[1]);
        for (int64_t j = 0; j < r[0].n; ++j) {
          const vf ds0 = splat(ds[0][j]), ds1 = splat(ds[1][j]);
          const vf p0 = splat(p[0][j]), p1 = splat(p[1][j]);
          float* dkj = m.dk + j * Dp;
          float* dvj = m.dv + j * Dp;
          for (int c = 0; c < NV; ++c) {
            const vf k0 = load(dkj + c * kWidth) + ds0 * load(r[0].q + c * kWidth);
            store(dkj + c * kWidth, k0 + ds1 * load(r[1].q + c * kWidth));
            const vf v0 = load(dvj + c * kWidth) + p0 * load(r[0].dout + c * kWidth);
            store(dvj + c * kWidth, v0 + p1 * load(r[1].dout + c * kWidth));
          }
        }
        accumulate_keys<NV>(r[1], p[1], ds[1], m, r[0].n);  // row 1's keys past row 0's
      } else {
        row_scores(r[0].q, m.kt, t.padded_length, t.head_dim, r[0].nb, t.scale, p[0]);
        row_scores(r[0].dout, m.vt, t.padded_length, t.head_dim, r[0].nb, 1.f, ds[0]);
        row_probabilities(r[0], t.scale, p[0], ds[0]);
        weighted_rows<NV>(ds[0], m.k, r[0].n, dq_row[0]);
        accumulate_keys<NV>(r[0], p[0], ds[0], m, 0);
      }
      for (int k = 0; k < pair; ++k) {
        for (int c = 0; c < NV; ++c) {
          store(m.dq + (g * t.length + i + k) * Dp + c * kWidth, dq_row[k][c]);
        }
      }
    }
  }
}

// The entry points, one per vector count (NV a constant keeps a row's accumulators in registers),
// each compiled for AVX2 + FMA and for the baseline.
#define AGENTRL_FAST_ROWS(NV)                                                                    \
  AGENTRL_FAST_AVX2 void forward_rows_avx2_##NV(const TaskShape& t, const ForwardBuffers& m) {   \
    forward_rows<NV>(t, m);                                                                      \
  }                                                                                              \
  AGENTRL_FAST_AVX2 void backward_rows_avx2_##NV(const TaskShape& t, const BackwardBuffers& m) { \
    backward_rows<NV>(t, m);                                                                     \
  }                                                                                              \
  void forward_rows_base_##NV(const TaskShape& t, const ForwardBuffers& m) {                     \
    forward_rows<NV>(t, m);                                                                      \
  }                                                                                              \
  void backward_rows_base_##NV(const TaskShape& t, const BackwardBuffers& m) {                   \
    backward_rows<NV>(t, m);                                                                     \
  }
AGENTRL_FAST_ROWS(1)
AGENTRL_FAST_ROWS(2)
AGENTRL_FAST_ROWS(4)
AGENTRL_FAST_ROWS(8)
AGENTRL_FAST_ROWS(16)
AGENTRL_FAST_ROWS(32)
#undef AGENTRL_FAST_ROWS

// The AVX2 + FMA build when the CPU has them, unless AGENTRL_FAST_CPU_BASELINE=1 (read once;
// how the tests run the baseline build on an AVX2 machine).
bool use_avx2() {
#if AGENTRL_FAST_X86
  static const bool chosen = [] {
    const char* baseline = std::getenv("AGENTRL_FAST_CPU_BASELINE");
    if (baseline != nullptr && std::string(baseline) == "1") return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return chosen;
#else
  return false;
#endif
}

// Vectors per padded head dim: the smallest power of two with NV * kWidth >= D.
int vectors_for(int64_t head_dim) {
  int nv = 1;
  while (nv * kWidth < head_dim) nv *= 2;
  return nv;
}

// The row loops of a vector count, in the build use_avx2() picks.
struct RowKernels {
  void (*forward)(const TaskShape&, const ForwardBuffers&);
  void (*backward)(const TaskShape&, const BackwardBuffers&);
};

const RowKernels& row_kernels(int nv) {
#define AGENTRL_FAST_KERNELS(BUILD)                                                  \
  {{forward_rows_##BUILD##_1, backward_rows_##BUILD##_1},                           \
   {forward_rows_##BUILD##_2, backward_rows_##BUILD##_2},                           \
   {forward_rows_##BUILD##_4, backward_rows_##BUILD##_4},                           \
   {forward_rows_##BUILD##_8, backward_rows_##BUILD##_8},                           \
   {forward_rows_##BUILD##_16, backward_rows_##BUILD##_16},                         \
   {forward_rows_##BUILD##_32, backward_rows_##BUILD##_32}}
  static const RowKernels avx2[] = AGENTRL_FAST_KERNELS(avx2);
  static const RowKernels base[] = AGENTRL_FAST_KERNELS(base);
#undef AGENTRL_FAST_KERNELS
  int index = 0;  // log2(nv), nv a power of two <= 32 (vectors_for)
  while ((1 << index) < nv) ++index;
  return (use_avx2() ? avx2 : base)[index];
}

// ---------------------------------------------------------------------------------------------
// Segments, tasks, threads, and the copies between the packed tensors and a task's buffers.

struct Span {
  int64_t start, length;
};

// (start, length) per segment, clamped into [0, T] and non-decreasing (the reference backend's
// rule), so unvalidated cu_seqlens never index out of range; empty segments are kept, so that
// prefix_of's indices address them.
std::vector<Span> segments_of(const at::Tensor& cu_seqlens, int64_t num_tokens) {
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* c = cu.data_ptr<int64_t>();
  std::vector<Span> segments;
  int64_t previous_end = 0;
  for (int64_t b = 0; b + 1 < cu.numel(); ++b) {
    const int64_t start = std::min(std::max(c[b], previous_end), num_tokens);
    const int64_t end = std::min(std::max(c[b + 1], start), num_tokens);
    previous_end = end;
    segments.push_back({start, end - start});
  }
  return segments;
}

// Each segment's prefix segment as the kernels use it: prefix_of[b] when 0 <= prefix_of[b] < b
// and that segment is no suffix itself, else -1 (unvalidated values never index out of range).
std::vector<int64_t> prefixes_of(const at::Tensor& prefix_of, int64_t num_segments) {
  const at::Tensor values = prefix_of.to(at::kLong).contiguous();
  const int64_t* p = values.data_ptr<int64_t>();
  std::vector<int64_t> prefix(num_segments, -1);
  for (int64_t b = 0; b < std::min(num_segments, values.numel()); ++b) {
    if (p[b] >= 0 && p[b] < b && prefix[p[b]] == -1) prefix[b] = p[b];
  }
  return prefix;
}

// A forward task: one segment's queries and a KV head. Its keys are its prefix's (empty unless
// the segment is a suffix), then its own.
struct Task {
  Span own, prefix;
  int64_t kv_head;
};

// A segment and its suffixes (in packed order; none for a plain segment): the backward runs them
// as one task per KV head, so that one thread sums the prefix's dk and dv.
struct Group {
  Span prefix;
  std::vector<Span> suffixes;
};

struct GroupTask {
  const Group* group;
  int64_t kv_head;
};

// Forward tasks of the non-empty segments; `prefix` empty: the plain op (no prefixes).
std::vector<Task> tasks_of(const std::vector<Span>& segments, const std::vector<int64_t>& prefix,
                           int64_t kv_heads) {
  std::vector<Task> tasks;
  for (size_t b = 0; b < segments.size(); ++b) {
    const Span own = segments[b];
    const bool suffix = !prefix.empty() && prefix[b] >= 0;
    const Span before = suffix ? segments[prefix[b]] : Span{own.start, 0};
    if (own.length == 0) continue;
    for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({own, before, h});
  }
  return tasks;
}

// Backward groups: each non-empty segment that is no suffix, with its non-empty suffixes (a
// suffix of an empty prefix is a group of its own: it has no shared keys).
std::vector<Group> groups_of(const std::vector<Span>& segments,
                             const std::vector<int64_t>& prefix) {
  std::vector<Group> groups;
  std::vector<int64_t> group_of(segments.size(), -1);
  for (size_t b = 0; b < segments.size(); ++b) {
    const int64_t p = prefix.empty() ? -1 : prefix[b];
    if (p >= 0 && segments[p].length > 0) {
      if (segments[b].length > 0) groups[group_of[p]].suffixes.push_back(segments[b]);
    } else if (segments[b].length > 0) {
      group_of[b] = static_cast<int64_t>(groups.size());
      groups.push_back({segments[b], {}});
    }
  }
  return groups;
}

std::vector<GroupTask> group_tasks(const std::vector<Group>& groups, int64_t kv_heads) {
  std::vector<GroupTask> tasks;
  for (const Group& group : groups) {
    for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({&group, h});
  }
  return tasks;
}

// A task's cost: its scores, counted as L^2 for a plain segment of L rows and S (2P + S) for a
// suffix of S rows after P prefix keys.
double cost_of(const Task& t) {
  const double own = static_cast<double>(t.own.length);
  return own * (2.0 * static_cast<double>(t.prefix.length) + own);
}
double cost_of(const GroupTask& t) {
  const double before = static_cast<double>(t.group->prefix.length);
  double cost = before * before;
  for (const Span& s : t.group->suffixes) {
    cost += static_cast<double>(s.length) * (2.0 * before + static_cast<double>(s.length));
  }
  return cost;
}

// Tasks dealt to at most `bins` threads by cost, the costliest first to the least loaded.
template <typename T>
std::vector<std::vector<T>> deal(std::vector<T> tasks, int64_t bins) {
  bins = std::max<int64_t>(1, std::min<int64_t>(bins, static_cast<int64_t>(tasks.size())));
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const T& a, const T& b) { return cost_of(a) > cost_of(b); });
  std::vector<std::vector<T>> dealt(bins);
  std::vector<double> load(bins, 0.0);
  for (const T& task : tasks) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    dealt[least].push_back(task);
    load[least] += cost_of(task);
  }
  return dealt;
}

template <typename T, typename F>
void for_each_task(const std::vector<T>& tasks, const F& run) {
  const auto dealt = deal(tasks, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(dealt.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t bin = begin; bin < end; ++bin) {
      for (const T& task : dealt[bin]) run(task);
    }
  });
}

// Packed [T, H, D] <-> a task's buffers.
template <typename scalar_t>
struct Rows {
  const scalar_t* data;
  int64_t heads, head_dim;

  const scalar_t* at(int64_t token, int64_t head) const {
    return data + (token * heads + head) * head_dim;
  }
  // [S, Dp] rows of one head (padding zero).
  void gather(const Span& s, int64_t head, int64_t dp, float* dst) const {
    for (int64_t j = 0; j < s.length; ++j) {
      const scalar_t* src = at(s.start + j, head);
      float* d = dst + j * dp;
      for (int64_t x = 0; x < head_dim; ++x) d[x] = static_cast<float>(src[x]);
      std::fill(d + head_dim, d + dp, 0.f);
    }
  }
  // Columns column .. column + S of the [D, lp] transpose of one head.
  void gather_columns(const Span& s, int64_t head, int64_t lp, int64_t column, float* dst) const {
    for (int64_t j = 0; j < s.length; ++j) {
      const scalar_t* src = at(s.start + j, head);
      for (int64_t x = 0; x < head_dim; ++x) dst[x * lp + column + j] = static_cast<float>(src[x]);
    }
  }
  // [G, S, Dp] rows of the query heads of a KV head's group.
  void gather_group(const Span& s, int64_t groups, int64_t kv_head, int64_t dp, float* dst) const {
    for (int64_t g = 0; g < groups; ++g) {
      gather(s, kv_head * groups + g, dp, dst + g * s.length * dp);
    }
  }
};

template <typename scalar_t>
void scatter(const float* src, const Span& s, int64_t head, int64_t heads, int64_t head_dim,
             int64_t dp, scalar_t* dst) {
  for (int64_t j = 0; j < s.length; ++j) {
    scalar_t* d = dst + ((s.start + j) * heads + head) * head_dim;
    const float* from = src + j * dp;
    for (int64_t x = 0; x < head_dim; ++x) d[x] = static_cast<scalar_t>(from[x]);
  }
}

int64_t padded_keys(int64_t keys) { return (keys + kWidth - 1) / kWidth * kWidth; }

// The sizes every task of an op call shares.
struct OpShape {
  int64_t tokens, heads_q, heads_k, head_dim, dp, groups;
  int nv;
  bool causal;
  float scale;
};

OpShape op_shape(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  const int nv = vectors_for(q.size(2));
  return {q.size(0), q.size(1), k.size(1), q.size(2), nv * kWidth, q.size(1) / k.size(1), nv,
          causal, static_cast<float>(scale)};
}

template <typename scalar_t>
struct ForwardTensors {
  Rows<scalar_t> q, k, v;
  scalar_t* out;
  float* lse;
};

// One forward task: its rows gathered into float32 buffers (keys: the prefix's, then its own),
// the row loops, out and lse written back.
template <typename scalar_t>
void forward_task(const Task& task, const OpShape& z, const ForwardTensors<scalar_t>& x) {
  const int64_t L = task.own.length, P = task.prefix.length, lp = padded_keys(P + L);
  const int64_t G = z.groups, dp = z.dp, h = task.kv_head;
  std::vector<float> qb(G * L * dp), kt(z.head_dim * lp), vb((P + L) * dp), ob(G * L * dp),
      lb(G * L), row(2 * lp);
  x.q.gather_group(task.own, G, h, dp, qb.data());
  x.k.gather_columns(task.prefix, h, lp, 0, kt.data());
  x.k.gather_columns(task.own, h, lp, P, kt.data());
  x.v.gather(task.prefix, h, dp, vb.data());
  x.v.gather(task.own, h, dp, vb.data() + P * dp);
  const TaskShape shape{G, L, lp, static_cast<int>(z.head_dim), z.causal, z.scale, P};
  row_kernels(z.nv).forward(shape, {qb.data(), kt.data(), vb.data(), ob.data(), lb.data(),
                                    row.data()});
  for (int64_t g = 0; g < G; ++g) {
    scatter(ob.data() + g * L * dp, task.own, h * G + g, z.heads_q, z.head_dim, dp, x.out);
    std::copy(lb.begin() + g * L, lb.begin() + (g + 1) * L,
              x.lse + (h * G + g) * z.tokens + task.own.start);
  }
}

template <typename scalar_t>
struct BackwardTensors {
  Rows<scalar_t> dout, q, out, k, v;
  const float* lse;
  scalar_t *dq, *dk, *dv;
};

// The float32 buffers of a backward task: keys K = P + the longest suffix, queries Q = the most
// rows of one query range.
struct BackwardScratch {
  std::vector<float> q, dout, out, dq, lse, kt, vt, k, dk, dv, p, ds;
  BackwardScratch(int64_t G, int64_t Q, int64_t K, int64_t lp, int64_t D, int64_t dp)
      : q(G * Q * dp), dout(G * Q * dp), out(G * Q * dp), dq(G * Q * dp), lse(G * Q), kt(D * lp),
        vt(D * lp), k(K * dp), dk(K * dp), dv(K * dp), p(2 * lp), ds(2 * lp) {}
};

// A query range's backward: the prefix's own rows (key_offset 0) or a suffix's (after the
// prefix's P keys), its keys already in `b`; writes dq, accumulates into b.dk and b.dv.
template <typename scalar_t>
void backward_queries(const Span& s, int64_t h, int64_t key_offset, bool causal, int64_t lp,
                      const OpShape& z, const BackwardTensors<scalar_t>& x, BackwardScratch& b) {
  const int64_t G = z.groups, L = s.length, dp = z.dp;
  x.q.gather_group(s, G, h, dp, b.q.data());
  x.dout.gather_group(s, G, h, dp, b.dout.data());
  x.out.gather_group(s, G, h, dp, b.out.data());
  for (int64_t g = 0; g < G; ++g) {
    const float* src = x.lse + (h * G + g) * z.tokens + s.start;
    std::copy(src, src + L, b.lse.begin() + g * L);
  }
  const TaskShape shape{G, L, lp, static_cast<int>(z.head_dim), causal, z.scale, key_offset};
  row_kernels(z.nv).backward(shape, {b.q.data(), b.dout.data(), b.out.data(), b.lse.data(),
                                     b.kt.data(), b.vt.data(), b.k.data(), b.dq.data(),
                                     b.dk.data(), b.dv.data(), b.p.data(), b.ds.data()});
  for (int64_t g = 0; g < G; ++g) {
    scatter(b.dq.data() + g * L * dp, s, h * G + g, z.heads_q, z.head_dim, dp, x.dq);
  }
}

// One backward task: a group's prefix (or plain segment) and then each suffix in order, so
// that the prefix's dk and dv sum over all their queries in a fixed order.
template <typename scalar_t>
void backward_group(const GroupTask& task, const OpShape& z, const BackwardTensors<scalar_t>& x) {
  const Group& group = *task.group;
  const int64_t h = task.kv_head, P = group.prefix.length, dp = z.dp, D = z.head_dim;
  int64_t longest = 0;
  for (const Span& s : group.suffixes) longest = std::max(longest, s.length);
  const int64_t K = P + longest, lp = padded_keys(K);
  BackwardScratch b(z.groups, std::max(P, longest), K, lp, D, dp);
  x.k.gather_columns(group.prefix, h, lp, 0, b.kt.data());
  x.v.gather_columns(group.prefix, h, lp, 0, b.vt.data());
  x.k.gather(group.prefix, h, dp, b.k.data());
  backward_queries(group.prefix, h, 0, z.causal, lp, z, x, b);
  for (const Span& s : group.suffixes) {
    for (int64_t c = 0; c < D; ++c) {  // clear the previous suffix's key columns
      std::fill(b.kt.begin() + c * lp + P, b.kt.begin() + (c + 1) * lp, 0.f);
      std::fill(b.vt.begin() + c * lp + P, b.vt.begin() + (c + 1) * lp, 0.f);
    }
    x.k.gather_columns(s, h, lp, P, b.kt.data());
    x.v.gather_columns(s, h, lp, P, b.vt.data());
    x.k.gather(s, h, dp, b.k.data() + P * dp);
    std::fill(b.dk.begin() + P * dp, b.dk.end(), 0.f);
    std::fill(b.dv.begin() + P * dp, b.dv.end(), 0.f);
    backward_queries(s, h, P, true, lp, z, x, b);
    scatter(b.dk.data() + P * dp, s, h, z.heads_k, D, dp, x.dk);
    scatter(b.dv.data() + P * dp, s, h, z.heads_k, D, dp, x.dv);
  }
  scatter(b.dk.data(), group.prefix, h, z.heads_k, D, dp, x.dk);
  scatter(b.dv.data(), group.prefix, h, z.heads_k, D, dp, x.dv);
}

// ---------------------------------------------------------------------------------------------
// Argument checks (the op can be called directly through torch.ops).

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 3, name, " must be 3-D [T, heads, head_dim], got shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), name, " must have q's dtype ",
                   q.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.size(0) == q.size(0) && t.size(2) == q.size(2), name,
                    " must have q's T and head_dim, got shape ", t.sizes(), " against ",
                    q.sizes());
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cu_seqlens) {
  check_rows(q, "q", q);
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf ||
                       q.scalar_type() == at::kBFloat16,
                   "q must be float32, float16 or bfloat16, got ", q.scalar_type());
  check_rows(k, "k", q);
  check_rows(v, "v", q);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got ", k.sizes(),
                    " and ", v.sizes());
  TORCH_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                    "q's heads must be a multiple of k's, got ", q.size(1), " and ", k.size(1));
  TORCH_CHECK_VALUE(q.size(2) >= 1 && q.size(2) <= kMaxHeadDim, "head_dim must be in [1, ",
                    kMaxHeadDim, "], got ", q.size(2));
  TORCH_CHECK_VALUE(cu_seqlens.device().is_cpu(), "cu_seqlens must be on the CPU, got ",
                    cu_seqlens.device());
  TORCH_CHECK_VALUE(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
                    "cu_seqlens must be 1-D with at least one element, got shape ",
                    cu_seqlens.sizes());
  TORCH_CHECK_TYPE(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong,
                   "cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
}

void check_output(const at::Tensor& t, const char* name, at::IntArrayRef shape,
                  at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ",
                   t.scalar_type());
}


void check_prefix_of(const at::Tensor& prefix_of, const at::Tensor& cu_seqlens) {
  TORCH_CHECK_VALUE(prefix_of.device().is_cpu(), "prefix_of must be on the CPU, got ",
                    prefix_of.device());
  TORCH_CHECK_TYPE(prefix_of.scalar_type() == at::kInt || prefix_of.scalar_type() == at::kLong,
                   "prefix_of must be int32 or int64, got ", prefix_of.scalar_type());
  TORCH_CHECK_VALUE(prefix_of.dim() == 1 && prefix_of.numel() == cu_seqlens.numel() - 1,
                    "prefix_of must be 1-D with one entry per segment (cu_seqlens has ",
                    cu_seqlens.numel() - 1, " segments), got shape ", prefix_of.sizes());
}

// Shared by both forward ops: outputs checked and cleared, the tasks run.
void run_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::vector<Task>& tasks, const OpShape& z, at::Tensor& out,
                 at::Tensor& lse) {
  check_output(out, "out", q.sizes(), q.scalar_type());
  check_output(lse, "lse", {z.heads_q, z.tokens}, at::kFloat);
  out.zero_();  // tokens in no segment (only with unvalidated cu_seqlens)
  lse.fill_(-std::numeric_limits<float>::infinity());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(),
                                  "varlen_attention_cpu_out", [&] {
    const ForwardTensors<scalar_t> x{{q.const_data_ptr<scalar_t>(), z.heads_q, z.head_dim},
                                     {k.const_data_ptr<scalar_t>(), z.heads_k, z.head_dim},
                                     {v.const_data_ptr<scalar_t>(), z.heads_k, z.head_dim},
                                     out.data_ptr<scalar_t>(), lse.data_ptr<float>()};
    for_each_task(tasks, [&](const Task& task) { forward_task(task, z, x); });
  });
}

// Shared by both backward ops: the gradient inputs and outputs checked, the groups run.
void run_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                  const std::vector<Group>& groups, const OpShape& z, at::Tensor& dq,
                  at::Tensor& dk, at::Tensor& dv) {
  check_rows(dout, "dout", q);
  check_rows(out, "out", q);
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes(),
                    "dout and out must have q's shape ", q.sizes());
  const at::Tensor lse_c = lse.contiguous();
  check_output(lse_c, "lse", {z.heads_q, z.tokens}, at::kFloat);
  check_output(dq, "dq", q.sizes(), q.scalar_type());
  check_output(dk, "dk", k.sizes(), k.scalar_type());
  check_output(dv, "dv", v.sizes(), v.scalar_type());
  dq.zero_();
  dk.zero_();
  dv.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(),
                                  "varlen_attention_cpu_backward_out", [&] {
    const BackwardTensors<scalar_t> x{
        {dout.const_data_ptr<scalar_t>(), z.heads_q, z.head_dim},
        {q.const_data_ptr<scalar_t>(), z.heads_q, z.head_dim},
        {out.const_data_ptr<scalar_t>(), z.heads_q, z.head_dim},
        {k.const_data_ptr<scalar_t>(), z.heads_k, z.head_dim},
        {v.const_data_ptr<scalar_t>(), z.heads_k, z.head_dim},
        lse_c.const_data_ptr<float>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
        dv.data_ptr<scalar_t>()};
    for_each_task(group_tasks(groups, z.heads_k),
                  [&](const GroupTask& task) { backward_group(task, z, x); });
  });
}

}  // namespace

bool varlen_attention_cpu_uses_avx2() { return use_avx2(); }

void varlen_attention_cpu_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_seqlens, bool causal, double scale,
                              at::Tensor& out, at::Tensor& lse) {
  check_inputs(q, k, v, cu_seqlens);
  const OpShape z = op_shape(q, k, causal, scale);
  run_forward(q, k, v, tasks_of(segments_of(cu_seqlens, z.tokens), {}, z.heads_k), z, out, lse);
}

void varlen_attention_cpu_backward_out(const at::Tensor& dout, const at::Tensor& q,
                                       const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& out, const at::Tensor& lse,
                                       const at::Tensor& cu_seqlens, bool causal, double scale,
                                       at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  check_inputs(q, k, v, cu_seqlens);
  const OpShape z = op_shape(q, k, causal, scale);
  run_backward(dout, q, k, v, out, lse, groups_of(segments_of(cu_seqlens, z.tokens), {}), z, dq,
               dk, dv);
}

void varlen_attention_cpu_prefix_out(const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& cu_seqlens,
                                     const at::Tensor& prefix_of, double scale, at::Tensor& out,
                                     at::Tensor& lse) {
  check_inputs(q, k, v, cu_seqlens);
  check_prefix_of(prefix_of, cu_seqlens);
  const OpShape z = op_shape(q, k, true, scale);
  const auto segments = segments_of(cu_seqlens, z.tokens);
  const auto prefix = prefixes_of(prefix_of, static_cast<int64_t>(segments.size()));
  run_forward(q, k, v, tasks_of(segments, prefix, z.heads_k), z, out, lse);
}

void varlen_attention_cpu_prefix_backward_out(const at::Tensor& dout, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& out, const at::Tensor& lse,
                                              const at::Tensor& cu_seqlens,
                                              const at::Tensor& prefix_of, double scale,
                                              at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  check_inputs(q, k, v, cu_seqlens);
  check_prefix_of(prefix_of, cu_seqlens);
  const OpShape z = op_shape(q, k, true, scale);
  const auto segments = segments_of(cu_seqlens, z.tokens);
  const auto prefix = prefixes_of(prefix_of, static_cast<int64_t>(segments.size()));
  run_backward(dout, q, k, v, out, lse, groups_of(segments, prefix), z, dq, dk, dv);
}

}  // namespace agentrl_fast
