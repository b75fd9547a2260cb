// Attention over packed variable-length trajectories on the CPU (the "native" backend).
//
// One task is a sequence and a KV head with all the query heads of its group, so that the
// backward's dk and dv are written by one thread without atomics (the backward is deterministic).
// A task copies its rows into float32 buffers (any input dtype; the head dim padded to a whole
// number of 8-float vectors, K and V also transposed to [D, L]), computes there, and writes its
// results back. Per query row: the scores against all its keys as 8-wide vectors over keys (no
// horizontal sums), the softmax with a vectorised exp, then the weighted sum of V rows in
// registers. Tasks are dealt to threads by cost (longest first, to the least loaded).
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

// The buffers of one task: the sequence's L rows, its G = Hq / Hk query heads, head dim D
// padded to Dp = NV * kWidth, keys padded to Lp (a multiple of kWidth).
struct TaskShape {
  int64_t groups, length, padded_length;
  int head_dim;
  bool causal;
  float scale;
};

struct ForwardBuffers {
  const float* q;   // [G, L, Dp]
  const float* kt;  // [D, Lp] (keys >= L zero)
  const float* v;   // [L, Dp]
  float* out;       // [G, L, Dp]
  float* lse;       // [G, L]
  float* row;       // [Lp] scratch
};

template <int NV>
AGENTRL_FAST_INLINE void forward_rows(const TaskShape& t, const ForwardBuffers& m) {
  constexpr int64_t Dp = NV * kWidth;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < t.groups; ++g) {
    for (int64_t i = 0; i < t.length; ++i) {
      const float* qi = m.q + (g * t.length + i) * Dp;
      const int64_t n = t.causal ? i + 1 : t.length;
      const int64_t nb = (n + kWidth - 1) / kWidth;
      row_scores(qi, m.kt, t.padded_length, t.head_dim, nb, t.scale, m.row);
      vf top = splat(-inf);
      for (int64_t b = 0; b < nb; ++b) {
        const vf s = mask_tail(load(m.row + b * kWidth), b, n, -inf);
        top = s > top ? s : top;
      }
      const float row_max = horizontal_max(top);
      vf sums = {};
      for (int64_t b = 0; b < nb; ++b) {
        const vf p = mask_tail(vector_exp(load(m.row + b * kWidth) - row_max), b, n, 0.f);
        store(m.row + b * kWidth, p);
        sums += p;
      }
      const float sum = horizontal_sum(sums);
      vf acc[NV];
      weighted_rows<NV>(m.row, m.v, n, acc);
      float* oi = m.out + (g * t.length + i) * Dp;
      const float inverse = 1.f / sum;
      for (int c = 0; c < NV; ++c) store(oi + c * kWidth, acc[c] * inverse);
      m.lse[g * t.length + i] = row_max + std::log(sum);
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
  const float* k;     // [L, Dp]
  float* dq;          // [G, L, Dp]
  float* dk;          // [L, Dp], accumulated over the group (zeroed by the caller)
  float* dv;          // [L, Dp], likewise
  float* p;           // [Lp] scratch
  float* ds;          // [Lp] scratch
};

template <int NV>
AGENTRL_FAST_INLINE void backward_rows(const TaskShape& t, const BackwardBuffers& m) {
  constexpr int64_t Dp = NV * kWidth;
  for (int64_t g = 0; g < t.groups; ++g) {
    for (int64_t i = 0; i < t.length; ++i) {
      const int64_t row = g * t.length + i;
      const float* qi = m.q + row * Dp;
      const float* doi = m.dout + row * Dp;
      const float* oi = m.out + row * Dp;
      vf q_row[NV], do_row[NV], dq_row[NV];
      vf dot = {};
      for (int c = 0; c < NV; ++c) {
        q_row[c] = load(qi + c * kWidth);
        do_row[c] = load(doi + c * kWidth);
        dot += do_row[c] * load(oi + c * kWidth);
      }
      const float delta = horizontal_sum(dot);  // sum_j p_j dp_j = dout . out
      const float row_lse = m.lse[row];
      const int64_t n = t.causal ? i + 1 : t.length;
      const int64_t nb = (n + kWidth - 1) / kWidth;
      row_scores(qi, m.kt, t.padded_length, t.head_dim, nb, t.scale, m.p);
      row_scores(doi, m.vt, t.padded_length, t.head_dim, nb, 1.f, m.ds);
      for (int64_t b = 0; b < nb; ++b) {
        const vf p = mask_tail(vector_exp(load(m.p + b * kWidth) - row_lse), b, n, 0.f);
        store(m.p + b * kWidth, p);
        store(m.ds + b * kWidth, p * (load(m.ds + b * kWidth) - delta) * t.scale);
      }
      weighted_rows<NV>(m.ds, m.k, n, dq_row);
      for (int64_t j = 0; j < n; ++j) {
        const vf ds = splat(m.ds[j]), p = splat(m.p[j]);
        float* dkj = m.dk + j * Dp;
        float* dvj = m.dv + j * Dp;
        for (int c = 0; c < NV; ++c) {
          store(dkj + c * kWidth, load(dkj + c * kWidth) + ds * q_row[c]);
          store(dvj + c * kWidth, load(dvj + c * kWidth) + p * do_row[c]);
        }
      }
      for (int c = 0; c < NV; ++c) store(m.dq + row * Dp + c * kWidth, dq_row[c]);
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
// Tasks, threads, and the copies between the packed tensors and a task's buffers.

struct Task {
  int64_t start, length, kv_head;
};

// (start, end) per non-empty sequence, clamped into [0, T] and non-decreasing (the reference
// backend's rule), so unvalidated cu_seqlens never index out of range.
std::vector<Task> tasks_of(const at::Tensor& cu_seqlens, int64_t num_tokens, int64_t kv_heads) {
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* c = cu.data_ptr<int64_t>();
  std::vector<Task> tasks;
  int64_t previous_end = 0;
  for (int64_t b = 0; b + 1 < cu.numel(); ++b) {
    const int64_t start = std::min(std::max(c[b], previous_end), num_tokens);
    const int64_t end = std::min(std::max(c[b + 1], start), num_tokens);
    previous_end = end;
    if (end > start) {
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({start, end - start, h});
    }
  }
  return tasks;
}

// Tasks dealt to at most `bins` threads by cost L^2, longest first to the least loaded.
std::vector<std::vector<Task>> deal(std::vector<Task> tasks, int64_t bins) {
  bins = std::max<int64_t>(1, std::min<int64_t>(bins, static_cast<int64_t>(tasks.size())));
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.length > b.length; });
  std::vector<std::vector<Task>> dealt(bins);
  std::vector<double> load(bins, 0.0);
  for (const Task& task : tasks) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    dealt[least].push_back(task);
    load[least] += static_cast<double>(task.length) * static_cast<double>(task.length);
  }
  return dealt;
}

template <typename F>
void for_each_task(const std::vector<Task>& tasks, const F& run) {
  const auto dealt = deal(tasks, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(dealt.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t bin = begin; bin < end; ++bin) {
      for (const Task& task : dealt[bin]) run(task);
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
  // [L, Dp] rows of one head (padding zero).
  void gather(const Task& t, int64_t head, int64_t dp, float* dst) const {
    for (int64_t j = 0; j < t.length; ++j) {
      const scalar_t* src = at(t.start + j, head);
      float* d = dst + j * dp;
      for (int64_t x = 0; x < head_dim; ++x) d[x] = static_cast<float>(src[x]);
      std::fill(d + head_dim, d + dp, 0.f);
    }
  }
  // [D, Lp] transpose of one head (keys >= L zero).
  void gather_transposed(const Task& t, int64_t head, int64_t lp, float* dst) const {
    for (int64_t x = 0; x < head_dim; ++x) std::fill(dst + x * lp + t.length, dst + (x + 1) * lp, 0.f);
    for (int64_t j = 0; j < t.length; ++j) {
      const scalar_t* src = at(t.start + j, head);
      for (int64_t x = 0; x < head_dim; ++x) dst[x * lp + j] = static_cast<float>(src[x]);
    }
  }
  // [G, L, Dp] rows of the query heads of a task's group.
  void gather_group(const Task& t, int64_t groups, int64_t dp, float* dst) const {
    for (int64_t g = 0; g < groups; ++g) gather(t, t.kv_head * groups + g, dp, dst + g * t.length * dp);
  }
};

template <typename scalar_t>
void scatter(const float* src, const Task& t, int64_t head, int64_t heads, int64_t head_dim,
             int64_t dp, scalar_t* dst) {
  for (int64_t j = 0; j < t.length; ++j) {
    scalar_t* d = dst + ((t.start + j) * heads + head) * head_dim;
    const float* s = src + j * dp;
    for (int64_t x = 0; x < head_dim; ++x) d[x] = static_cast<scalar_t>(s[x]);
  }
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

}  // namespace

bool varlen_attention_cpu_uses_avx2() { return use_avx2(); }

void varlen_attention_cpu_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_seqlens, bool causal, double scale,
                              at::Tensor& out, at::Tensor& lse) {
  check_inputs(q, k, v, cu_seqlens);
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2);
  check_output(out, "out", q.sizes(), q.scalar_type());
  check_output(lse, "lse", {Hq, T}, at::kFloat);
  out.zero_();  // tokens in no sequence (only with unvalidated cu_seqlens)
  lse.fill_(-std::numeric_limits<float>::infinity());
  const int nv = vectors_for(D);
  const int64_t dp = nv * kWidth, groups = Hq / Hk;
  float* lse_data = lse.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(),
                                  "varlen_attention_cpu_out", [&] {
    const Rows<scalar_t> qr{q.const_data_ptr<scalar_t>(), Hq, D};
    const Rows<scalar_t> kr{k.const_data_ptr<scalar_t>(), Hk, D};
    const Rows<scalar_t> vr{v.const_data_ptr<scalar_t>(), Hk, D};
    scalar_t* out_data = out.data_ptr<scalar_t>();
    for_each_task(tasks_of(cu_seqlens, T, Hk), [&](const Task& task) {
      const int64_t L = task.length, lp = (L + kWidth - 1) / kWidth * kWidth;
      std::vector<float> qb(groups * L * dp), kt(D * lp), vb(L * dp), ob(groups * L * dp),
          lb(groups * L), row(lp);
      qr.gather_group(task, groups, dp, qb.data());
      kr.gather_transposed(task, task.kv_head, lp, kt.data());
      vr.gather(task, task.kv_head, dp, vb.data());
      const TaskShape shape{groups, L, lp, static_cast<int>(D), causal,
                            static_cast<float>(scale)};
      row_kernels(nv).forward(shape, {qb.data(), kt.data(), vb.data(), ob.data(), lb.data(),
                                      row.data()});
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t h = task.kv_head * groups + g;
        scatter(ob.data() + g * L * dp, task, h, Hq, D, dp, out_data);
        std::copy(lb.begin() + g * L, lb.begin() + (g + 1) * L, lse_data + h * T + task.start);
      }
    });
  });
}

void varlen_attention_cpu_backward_out(const at::Tensor& dout, const at::Tensor& q,
                                       const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& out, const at::Tensor& lse,
                                       const at::Tensor& cu_seqlens, bool causal, double scale,
                                       at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  check_inputs(q, k, v, cu_seqlens);
  check_rows(dout, "dout", q);
  check_rows(out, "out", q);
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2);
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes(),
                    "dout and out must have q's shape ", q.sizes());
  check_output(lse.contiguous(), "lse", {Hq, T}, at::kFloat);
  check_output(dq, "dq", q.sizes(), q.scalar_type());
  check_output(dk, "dk", k.sizes(), k.scalar_type());
  check_output(dv, "dv", v.sizes(), v.scalar_type());
  dq.zero_();
  dk.zero_();
  dv.zero_();
  const at::Tensor lse_c = lse.contiguous();
  const float* lse_data = lse_c.const_data_ptr<float>();
  const int nv = vectors_for(D);
  const int64_t dp = nv * kWidth, groups = Hq / Hk;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(),
                                  "varlen_attention_cpu_backward_out", [&] {
    const Rows<scalar_t> qr{q.const_data_ptr<scalar_t>(), Hq, D};
    const Rows<scalar_t> dor{dout.const_data_ptr<scalar_t>(), Hq, D};
    const Rows<scalar_t> outr{out.const_data_ptr<scalar_t>(), Hq, D};
    const Rows<scalar_t> kr{k.const_data_ptr<scalar_t>(), Hk, D};
    const Rows<scalar_t> vr{v.const_data_ptr<scalar_t>(), Hk, D};
    scalar_t* dq_data = dq.data_ptr<scalar_t>();
    scalar_t* dk_data = dk.data_ptr<scalar_t>();
    scalar_t* dv_data = dv.data_ptr<scalar_t>();
    for_each_task(tasks_of(cu_seqlens, T, Hk), [&](const Task& task) {
      const int64_t L = task.length, lp = (L + kWidth - 1) / kWidth * kWidth;
      const int64_t rows = groups * L * dp;
      std::vector<float> qb(rows), dob(rows), ob(rows), dqb(rows), lb(groups * L), kt(D * lp),
          vt(D * lp), kb(L * dp), dkb(L * dp, 0.f), dvb(L * dp, 0.f), p(lp), ds(lp);
      qr.gather_group(task, groups, dp, qb.data());
      dor.gather_group(task, groups, dp, dob.data());
      outr.gather_group(task, groups, dp, ob.data());
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = lse_data + (task.kv_head * groups + g) * T + task.start;
        std::copy(src, src + L, lb.begin() + g * L);
      }
      kr.gather_transposed(task, task.kv_head, lp, kt.data());
      vr.gather_transposed(task, task.kv_head, lp, vt.data());
      kr.gather(task, task.kv_head, dp, kb.data());
      const TaskShape shape{groups, L, lp, static_cast<int>(D), causal,
                            static_cast<float>(scale)};
      row_kernels(nv).backward(shape, {qb.data(), dob.data(), ob.data(), lb.data(), kt.data(),
                                       vt.data(), kb.data(), dqb.data(), dkb.data(),
                                       dvb.data(), p.data(), ds.data()});
      for (int64_t g = 0; g < groups; ++g) {
        scatter(dqb.data() + g * L * dp, task, task.kv_head * groups + g, Hq, D, dp, dq_data);
      }
      scatter(dkb.data(), task, task.kv_head, Hk, D, dp, dk_data);
      scatter(dvb.data(), task, task.kv_head, Hk, D, dp, dv_data);
    });
  });
}

}  // namespace agentrl_fast
