// The one place where agentrl_fast's C++/CUDA ops are declared (schema strings) and bound to
// their per-device implementations. Python reaches them as torch.ops.agentrl_fast.<op>; the
// fake (meta) implementations live next to each op's Python wrapper (agentrl_fast/ops/<op>.py).
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "fused_layers.h"
#include "gae.h"
#include "varlen_attention.h"

TORCH_LIBRARY(agentrl_fast, m) {
  m.def(
      "gae(Tensor rewards, Tensor values, Tensor cu_seqlens, Tensor? action_mask=None, "
      "Tensor? bootstrap_values=None, float gamma=1.0, float lam=1.0, bool validate=True, "
      "Tensor? sequence_lam=None) -> (Tensor advantages, Tensor returns)");
  m.def(
      "gae_out(Tensor rewards, Tensor values, Tensor cu_seqlens, Tensor? action_mask, "
      "Tensor? bootstrap_values, float gamma, float lam, bool validate, Tensor(a!) advantages, "
      "Tensor(b!) returns, Tensor? sequence_lam=None) -> ()");
  // Tests only: the CUDA GAE kernel's look-back run by host threads (gae_lookback_emulation.cpp).
  m.def(
      "_gae_lookback_emulation(Tensor rewards, Tensor values, Tensor cu_seqlens, "
      "Tensor? action_mask, Tensor? bootstrap_values, float gamma, float lam, int tile_size, "
      "int threads, int tiles_per_thread, int max_delay_us, int seed, float deadline_seconds, "
      "int drop_tile) "
      "-> (Tensor advantages, Tensor returns, Tensor stats)");
  m.def(
      "varlen_attention_cpu_out(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, bool causal, "
      "float scale, Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def("rms_norm_cpu_out(Tensor x, Tensor weight, float eps, Tensor(a!) y, Tensor(b!) rstd) -> ()");
  m.def(
      "rms_norm_cpu_backward_out(Tensor dy, Tensor x, Tensor weight, Tensor rstd, Tensor(a!) dx, "
      "Tensor(b!) dweight) -> ()");
  m.def("swiglu_cpu_out(Tensor gate, Tensor up, Tensor(a!) out) -> ()");
  m.def(
      "swiglu_cpu_backward_out(Tensor dout, Tensor gate, Tensor up, Tensor(a!) dgate, "
      "Tensor(b!) dup) -> ()");
  m.def(
      "varlen_attention_cpu_backward_out(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor cu_seqlens, bool causal, float scale, Tensor(a!) dq, Tensor(b!) dk, "
      "Tensor(c!) dv) -> ()");
  m.def(
      "varlen_attention_cpu_prefix_out(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, "
      "Tensor prefix_of, float scale, Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def(
      "varlen_attention_cpu_prefix_backward_out(Tensor dout, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, Tensor cu_seqlens, Tensor prefix_of, float scale, Tensor(a!) dq, "
      "Tensor(b!) dk, Tensor(c!) dv) -> ()");
}

namespace {
void gae_out_op(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& cu_seqlens,
                const std::optional<at::Tensor>& action_mask,
                const std::optional<at::Tensor>& bootstrap_values, double gamma, double lam,
                bool validate, at::Tensor advantages, at::Tensor returns,
                const std::optional<at::Tensor>& sequence_lam) {
  agentrl_fast::gae_out(rewards, values, cu_seqlens, action_mask, bootstrap_values, gamma, lam,
                        validate, advantages, returns, sequence_lam);
}

void varlen_attention_cpu_out_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cu_seqlens, bool causal, double scale,
                                 at::Tensor out, at::Tensor lse) {
  agentrl_fast::varlen_attention_cpu_out(q, k, v, cu_seqlens, causal, scale, out, lse);
}

void varlen_attention_cpu_backward_out_op(const at::Tensor& dout, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& out, const at::Tensor& lse,
                                          const at::Tensor& cu_seqlens, bool causal, double scale,
                                          at::Tensor dq, at::Tensor dk, at::Tensor dv) {
  agentrl_fast::varlen_attention_cpu_backward_out(dout, q, k, v, out, lse, cu_seqlens, causal,
                                                  scale, dq, dk, dv);
}

void varlen_attention_cpu_prefix_out_op(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& cu_seqlens,
                                        const at::Tensor& prefix_of, double scale, at::Tensor out,
                                        at::Tensor lse) {
  agentrl_fast::varlen_attention_cpu_prefix_out(q, k, v, cu_seqlens, prefix_of, scale, out, lse);
}

void varlen_attention_cpu_prefix_backward_out_op(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens,
    const at::Tensor& prefix_of, double scale, at::Tensor dq, at::Tensor dk, at::Tensor dv) {
  agentrl_fast::varlen_attention_cpu_prefix_backward_out(dout, q, k, v, out, lse, cu_seqlens,
                                                         prefix_of, scale, dq, dk, dv);
}

void rms_norm_cpu_out_op(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor y,
                         at::Tensor rstd) {
  agentrl_fast::rms_norm_cpu_out(x, weight, eps, y, rstd);
}

void rms_norm_cpu_backward_out_op(const at::Tensor& dy, const at::Tensor& x,
                                  const at::Tensor& weight, const at::Tensor& rstd, at::Tensor dx,
                                  at::Tensor dweight) {
  agentrl_fast::rms_norm_cpu_backward_out(dy, x, weight, rstd, dx, dweight);
}

void swiglu_cpu_out_op(const at::Tensor& gate, const at::Tensor& up, at::Tensor out) {
  agentrl_fast::swiglu_cpu_out(gate, up, out);
}

void swiglu_cpu_backward_out_op(const at::Tensor& dout, const at::Tensor& gate,
                                const at::Tensor& up, at::Tensor dgate, at::Tensor dup) {
  agentrl_fast::swiglu_cpu_backward_out(dout, gate, up, dgate, dup);
}
}  // namespace

TORCH_LIBRARY_IMPL(agentrl_fast, CPU, m) {
  m.impl("rms_norm_cpu_out", &rms_norm_cpu_out_op);
  m.impl("rms_norm_cpu_backward_out", &rms_norm_cpu_backward_out_op);
  m.impl("swiglu_cpu_out", &swiglu_cpu_out_op);
  m.impl("swiglu_cpu_backward_out", &swiglu_cpu_backward_out_op);
  m.impl("gae", &agentrl_fast::gae);
  m.impl("gae_out", &gae_out_op);
  m.impl("_gae_lookback_emulation", &agentrl_fast::gae_lookback_emulation);
  m.impl("varlen_attention_cpu_out", &varlen_attention_cpu_out_op);
  m.impl("varlen_attention_cpu_backward_out", &varlen_attention_cpu_backward_out_op);
  m.impl("varlen_attention_cpu_prefix_out", &varlen_attention_cpu_prefix_out_op);
  m.impl("varlen_attention_cpu_prefix_backward_out", &varlen_attention_cpu_prefix_backward_out_op);
}

#ifdef AGENTRL_FAST_WITH_CUDA
TORCH_LIBRARY_IMPL(agentrl_fast, CUDA, m) {
  m.impl("gae", &agentrl_fast::gae);
  m.impl("gae_out", &gae_out_op);
}
#endif

// pybind11 only for what is not a tensor op: build and dispatch facts.
PYBIND11_MODULE(_C, module) {
  module.doc() = "agentrl_fast native extension (ops are registered under torch.ops.agentrl_fast)";
#ifdef AGENTRL_FAST_WITH_CUDA
  module.attr("cuda_built") = true;
  module.attr("cuda_arch_list") = AGENTRL_FAST_CUDA_ARCHS;
#else
  module.attr("cuda_built") = false;
  module.attr("cuda_arch_list") = "";
#endif
  module.def("varlen_attention_cpu_uses_avx2", &agentrl_fast::varlen_attention_cpu_uses_avx2,
             "whether the CPU attention kernel runs its AVX2 + FMA build");
}
