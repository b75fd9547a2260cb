// Fused RMSNorm and SwiGLU on the CPU (see fused_layers.h). Rows are dealt to threads in
// fixed chunks; each row is read once and written once, the arithmetic in float32 (float64
// for float64 tensors). The weight gradient of RMSNorm is summed per chunk, then over chunks in
// chunk order, so it does not depend on scheduling.
#include "fused_layers.h"

#include "cpu_vector.h"
#include "varlen_attention.h"  // varlen_attention_cpu_uses_avx2: which build of the loops runs

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace agentrl_fast {
namespace {

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

void check_same(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), a_name, " and ", b_name,
                   " must have one dtype, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK_VALUE(a.sizes() == b.sizes(), a_name, " and ", b_name, " must have one shape, got ",
                    a.sizes(), " and ", b.sizes());
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), name,
                   " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

// Rows per chunk: about 16k elements, so a chunk is worth a thread's start.
int64_t row_grain(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)); }

template <typename T>
void rms_norm_forward(const T* x, const T* w, T* y, acc_t<T>* rstd, int64_t n, int64_t d,
                      double eps) {
  using A = acc_t<T>;
  at::parallel_for(0, n, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * d;
      T* yr = y + row * d;
      A ss = 0;
      for (int64_t j = 0; j < d; ++j) ss += static_cast<A>(xr[j]) * static_cast<A>(xr[j]);
      const A r = A(1) / std::sqrt(ss / static_cast<A>(d) + static_cast<A>(eps));
      rstd[row] = r;
      for (int64_t j = 0; j < d; ++j) {
        // HF: weight * normalised.to(dtype): the normalised value is rounded first.
        const T normed = static_cast<T>(static_cast<A>(xr[j]) * r);
        yr[j] = static_cast<T>(static_cast<A>(w[j]) * static_cast<A>(normed));
      }
    }
  });
}

template <typename T, typename W>
void rms_norm_backward(const T* dy, const T* x, const T* w, const acc_t<T>* rstd, T* dx, W* dw,
                       int64_t n, int64_t d) {
  using A = acc_t<T>;
  const int64_t grain = row_grain(d);
  const int64_t chunks = std::max<int64_t>(1, (n + grain - 1) / grain);
  std::vector<A> partial(static_cast<size_t>(chunks * d), A(0));
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t chunk = first; chunk < last; ++chunk) {
      A* acc = partial.data() + chunk * d;
      const int64_t stop = std::min(n, (chunk + 1) * grain);
      for (int64_t row = chunk * grain; row < stop; ++row) {
        const T* xr = x + row * d;
        const T* gr = dy + row * d;
        T* dxr = dx + row * d;
        const A r = rstd[row];
        A dot = 0;  // sum_j dn_j * n_j, dn = dy * w, n = x * rstd
        for (int64_t j = 0; j < d; ++j) {
          const A normed = static_cast<A>(xr[j]) * r;
          const A g = static_cast<A>(gr[j]);
          dot += g * static_cast<A>(w[j]) * normed;
          acc[j] += g * normed;
        }
        const A mean = dot / static_cast<A>(d);
        for (int64_t j = 0; j < d; ++j) {
          const A normed = static_cast<A>(xr[j]) * r;
          dxr[j] = static_cast<T>(r * (static_cast<A>(gr[j]) * static_cast<A>(w[j]) - normed * mean));
        }
      }
    }
  });
  for (int64_t j = 0; j < d; ++j) {
    A total = 0;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) total += partial[chunk * d + j];
    dw[j] = static_cast<W>(total);
  }
}

template <typename A>
inline A sigmoid(A g) {
  return A(1) / (A(1) + std::exp(-g));
}

using namespace cpu_vector;

// float32 SwiGLU over [begin, end), 8 lanes at a time with the vectorised exp, then the tail.
AGENTRL_FAST_INLINE void swiglu_forward_f32(const float* g, const float* u, float* o,
                                            int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    const vf a = load(g + i);
    store(o + i, a / (1.0f + vector_exp(-a)) * load(u + i));
  }
  for (; i < end; ++i) o[i] = g[i] * sigmoid(g[i]) * u[i];
}

AGENTRL_FAST_INLINE void swiglu_backward_f32(const float* go, const float* g, const float* u,
                                             float* dg, float* du, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    const vf a = load(g + i), d = load(go + i);
    const vf s = 1.0f / (1.0f + vector_exp(-a));
    store(du + i, d * a * s);
    store(dg + i, d * load(u + i) * s * (1.0f + a * (1.0f - s)));
  }
  for (; i < end; ++i) {
    const float s = sigmoid(g[i]);
    du[i] = go[i] * g[i] * s;
    dg[i] = go[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
  }
}

AGENTRL_FAST_AVX2 void swiglu_forward_f32_avx2(const float* g, const float* u, float* o,
                                               int64_t begin, int64_t end) {
  swiglu_forward_f32(g, u, o, begin, end);
}
void swiglu_forward_f32_baseline(const float* g, const float* u, float* o, int64_t begin,
                                 int64_t end) {
  swiglu_forward_f32(g, u, o, begin, end);
}
AGENTRL_FAST_AVX2 void swiglu_backward_f32_avx2(const float* go, const float* g, const float* u,
                                                float* dg, float* du, int64_t begin, int64_t end) {
  swiglu_backward_f32(go, g, u, dg, du, begin, end);
}
void swiglu_backward_f32_baseline(const float* go, const float* g, const float* u, float* dg,
                                  float* du, int64_t begin, int64_t end) {
  swiglu_backward_f32(go, g, u, dg, du, begin, end);
}

}  // namespace

void rms_norm_cpu_out(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y,
                      at::Tensor& rstd) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  check_cpu_contiguous(y, "y");
  check_cpu_contiguous(rstd, "rstd");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [N, D], got shape ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [D] = [",
                    x.size(1), "], got shape ", weight.sizes());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype ",
                   x.scalar_type(), ", got ", weight.scalar_type());
  check_same(x, "x", y, "y");
  const bool wide = x.scalar_type() == at::kDouble;
  TORCH_CHECK_TYPE(rstd.scalar_type() == (wide ? at::kDouble : at::kFloat), "rstd must be ",
                   wide ? "float64" : "float32");
  TORCH_CHECK_VALUE(rstd.numel() == x.size(0), "rstd must have N = ", x.size(0), " entries");
  TORCH_CHECK_VALUE(eps >= 0 && std::isfinite(eps), "eps must be a finite number >= 0, got ", eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_cpu", [&] {
    rms_norm_forward<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                               y.data_ptr<scalar_t>(), rstd.data_ptr<acc_t<scalar_t>>(), x.size(0),
                               x.size(1), eps);
  });
}

void rms_norm_cpu_backward_out(const at::Tensor& dy, const at::Tensor& x,
                               const at::Tensor& weight, const at::Tensor& rstd, at::Tensor& dx,
                               at::Tensor& dweight) {
  for (auto [t, name] : {std::pair{&dy, "dy"}, {&x, "x"}, {&weight, "weight"}, {&rstd, "rstd"},
                         {&dx, "dx"}, {&dweight, "dweight"}})
    check_cpu_contiguous(*t, name);
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [N, D], got shape ", x.sizes());
  check_same(dy, "dy", x, "x");
  check_same(dx, "dx", x, "x");
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [D]");
  const bool wide = x.scalar_type() == at::kDouble;
  TORCH_CHECK_TYPE(rstd.scalar_type() == (wide ? at::kDouble : at::kFloat) &&
                       rstd.numel() == x.size(0),
                   "rstd must be ", wide ? "float64" : "float32", " [N]");
  TORCH_CHECK_VALUE(dweight.dim() == 1 && dweight.size(0) == x.size(1), "dweight must be [D]");
  TORCH_CHECK_TYPE(dweight.scalar_type() == (wide ? at::kDouble : at::kFloat),
                   "dweight must be ", wide ? "float64" : "float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_cpu_backward", [&] {
    using W = acc_t<scalar_t>;
    rms_norm_backward<scalar_t, W>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                   weight.data_ptr<scalar_t>(), rstd.data_ptr<W>(),
                                   dx.data_ptr<scalar_t>(), dweight.data_ptr<W>(), x.size(0),
                                   x.size(1));
  });
}

void swiglu_cpu_out(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  for (auto [t, name] : {std::pair{&gate, "gate"}, {&up, "up"}, {&out, "out"}})
    check_cpu_contiguous(*t, name);
  check_same(gate, "gate", up, "up");
  check_same(out, "out", gate, "gate");
  if (gate.scalar_type() == at::kFloat) {
    const auto kernel = varlen_attention_cpu_uses_avx2() ? swiglu_forward_f32_avx2
                                                         : swiglu_forward_f32_baseline;
    const float* g = gate.data_ptr<float>();
    const float* u = up.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, gate.numel(), 16384, [&](int64_t begin, int64_t end) {
      kernel(g, u, o, begin, end);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "swiglu_cpu", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* g = gate.data_ptr<scalar_t>();
    const scalar_t* u = up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), 16384, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const A a = static_cast<A>(g[i]);
        o[i] = static_cast<scalar_t>(a * sigmoid(a) * static_cast<A>(u[i]));
      }
    });
  });
}

void swiglu_cpu_backward_out(const at::Tensor& dout, const at::Tensor& gate, const at::Tensor& up,
                             at::Tensor& dgate, at::Tensor& dup) {
  for (auto [t, name] : {std::pair{&dout, "dout"}, {&gate, "gate"}, {&up, "up"},
                         {&dgate, "dgate"}, {&dup, "dup"}})
    check_cpu_contiguous(*t, name);
  check_same(gate, "gate", up, "up");
  check_same(dout, "dout", gate, "gate");
  check_same(dgate, "dgate", gate, "gate");
  check_same(dup, "dup", gate, "gate");
  if (gate.scalar_type() == at::kFloat) {
    const auto kernel = varlen_attention_cpu_uses_avx2() ? swiglu_backward_f32_avx2
                                                         : swiglu_backward_f32_baseline;
    const float* go = dout.data_ptr<float>();
    const float* g = gate.data_ptr<float>();
    const float* u = up.data_ptr<float>();
    float* dg = dgate.data_ptr<float>();
    float* du = dup.data_ptr<float>();
    at::parallel_for(0, gate.numel(), 16384, [&](int64_t begin, int64_t end) {
      kernel(go, g, u, dg, du, begin, end);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "swiglu_cpu_backward", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* go = dout.data_ptr<scalar_t>();
    const scalar_t* g = gate.data_ptr<scalar_t>();
    const scalar_t* u = up.data_ptr<scalar_t>();
    scalar_t* dg = dgate.data_ptr<scalar_t>();
    scalar_t* du = dup.data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), 16384, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const A a = static_cast<A>(g[i]);
        const A s = sigmoid(a);
        const A d = static_cast<A>(go[i]);
        du[i] = static_cast<scalar_t>(d * a * s);
        dg[i] = static_cast<scalar_t>(d * static_cast<A>(u[i]) * s * (A(1) + a * (A(1) - s)));
      }
    });
  });
}

}  // namespace agentrl_fast
