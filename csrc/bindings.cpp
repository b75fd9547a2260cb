// The one place where agentrl_fast's C++/CUDA ops are declared (schema strings) and bound to
// their per-device implementations. Python reaches them as torch.ops.agentrl_fast.<op>; the
// fake (meta) implementations live next to each op's Python wrapper (agentrl_fast/ops/<op>.py).
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "gae.h"

TORCH_LIBRARY(agentrl_fast, m) {
  m.def(
      "gae(Tensor rewards, Tensor values, Tensor cu_seqlens, Tensor? action_mask=None, "
      "Tensor? bootstrap_values=None, float gamma=1.0, float lam=1.0, bool validate=True) "
      "-> (Tensor advantages, Tensor returns)");
  m.def(
      "gae_out(Tensor rewards, Tensor values, Tensor cu_seqlens, Tensor? action_mask, "
      "Tensor? bootstrap_values, float gamma, float lam, bool validate, Tensor(a!) advantages, "
      "Tensor(b!) returns) -> ()");
}

namespace {
void gae_out_op(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& cu_seqlens,
                const std::optional<at::Tensor>& action_mask,
                const std::optional<at::Tensor>& bootstrap_values, double gamma, double lam,
                bool validate, at::Tensor advantages, at::Tensor returns) {
  agentrl_fast::gae_out(rewards, values, cu_seqlens, action_mask, bootstrap_values, gamma, lam,
                        validate, advantages, returns);
}
}  // namespace

TORCH_LIBRARY_IMPL(agentrl_fast, CPU, m) {
  m.impl("gae", &agentrl_fast::gae);
  m.impl("gae_out", &gae_out_op);
}

#ifdef AGENTRL_FAST_WITH_CUDA
TORCH_LIBRARY_IMPL(agentrl_fast, CUDA, m) {
  m.impl("gae", &agentrl_fast::gae);
  m.impl("gae_out", &gae_out_op);
}
#endif

// pybind11 only for what is not a tensor op: build facts.
PYBIND11_MODULE(_C, module) {
  module.doc() = "agentrl_fast native extension (ops are registered under torch.ops.agentrl_fast)";
#ifdef AGENTRL_FAST_WITH_CUDA
  module.attr("cuda_built") = true;
  module.attr("cuda_arch_list") = AGENTRL_FAST_CUDA_ARCHS;
#else
  module.attr("cuda_built") = false;
  module.attr("cuda_arch_list") = "";
#endif
}
