// GAE over packed trajectories: argument checks and kernel entry points shared by the CPU and
// CUDA implementations. Semantics: docs/design.md, "GAE over packed trajectories".
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace agentrl_fast {

// Checks shapes, dtypes and devices (always) and values (when `validate`, one host sync on the
// GPU), then computes into the preallocated `advantages` and `returns` ([T], float32, or float64
// when the inputs are float64). Every element of the outputs is written. `sequence_lam` ([B],
// optional) gives each sequence its own lambda in place of `lam`.
void gae_out(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& cu_seqlens,
             const std::optional<at::Tensor>& action_mask,
             const std::optional<at::Tensor>& bootstrap_values, double gamma, double lam,
             bool validate, at::Tensor& advantages, at::Tensor& returns,
             const std::optional<at::Tensor>& sequence_lam);

std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values,
                                       const at::Tensor& cu_seqlens,
                                       const std::optional<at::Tensor>& action_mask,
                                       const std::optional<at::Tensor>& bootstrap_values,
                                       double gamma, double lam, bool validate,
                                       const std::optional<at::Tensor>& sequence_lam);

// The kernels. Inputs are contiguous, on one device, already checked; rewards and values share
// one dtype; `action_mask` (bool), `bootstrap_values` and `sequence_lam` (float64 on the CPU, the
// accumulation dtype on CUDA) may be undefined, meaning all ones, all zeros and `lam` everywhere.
void gae_cpu_kernel(const at::Tensor& rewards, const at::Tensor& values,
                    const at::Tensor& cu_seqlens, const at::Tensor& action_mask,
                    const at::Tensor& bootstrap_values, double gamma, double lam,
                    const at::Tensor& sequence_lam, at::Tensor& advantages, at::Tensor& returns);

#ifdef AGENTRL_FAST_WITH_CUDA
void gae_cuda_kernel(const at::Tensor& rewards, const at::Tensor& values,
                     const at::Tensor& cu_seqlens, const at::Tensor& action_mask,
                     const at::Tensor& bootstrap_values, double gamma, double lam,
                     const at::Tensor& sequence_lam, at::Tensor& advantages,
                     at::Tensor& returns);
#endif

// For the tests: the CUDA kernel's tile scan emulated on the host (gae_lookback_emulation.cpp),
// float32 or float64 in and out, the third output the look-back's statistics.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gae_lookback_emulation(
    const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& cu_seqlens,
    const std::optional<at::Tensor>& action_mask,
    const std::optional<at::Tensor>& bootstrap_values, double gamma, double lam,
    int64_t tile_size, int64_t threads, int64_t tiles_per_thread, int64_t max_delay_us,
    int64_t seed, double deadline_seconds, int64_t drop_tile);

// Accumulation dtype of the kernels for a given input dtype on a given device.
at::ScalarType gae_output_dtype(at::ScalarType input_dtype);

}  // namespace agentrl_fast
